"""The doctor plans sequence parallelism and tiled MLP (hf_fsdp_qlora/doctor/plan_context.py `_long_context`) and
answers "the longest sequence that fits" (hf_fsdp_qlora/doctor/longest.py, `hf-fsdp-qlora doctor --longest`).

Every documented plan is unchanged (tests/test_plan_golden.py): both settings default off. Here: each setting
against the plan's own closed form, the bisection's boundary, and docs/long-context.md's table of answers recomputed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hf_fsdp_qlora.doctor import diagnose
from hf_fsdp_qlora.doctor.longest import longest_sequence
from hf_fsdp_qlora.doctor.memory import plan_memory, verdict

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
GB = 2**30
MODELS = {"Llama-3.1-8B": "llama3_1_8b_config.json", "Llama-3.1-70B": "llama3_1_70b_config.json"}


def _diagnose(model="Llama-3.1-8B", **settings):
    settings = {"quantization": "4bit", "gpu_memory": 80 * GB, **settings}
    return diagnose(DATA / MODELS[model], accelerate_config="fsdp2_qlora", **settings)


def test_sp_size_plans_each_gpus_share_of_the_tokens_plus_the_all_to_all_buffers():
    """sp_size=2 at 16384 tokens holds what sp_size=1 holds at 8192, plus one layer's all-to-all send and receive
    buffers of query, key and value (bf16, key/value repeated to the 32 heads): 2 x 2 x 8192 x 3 x 4096 bytes."""
    whole = _diagnose(seq_len=8192).plan
    shared = _diagnose(seq_len=16384, sp_size=2).plan
    assert shared.parts["activations"] - whole.parts["activations"] == 2 * 2 * 8192 * 3 * 4096
    assert shared.parts["logits_loss"] == whole.parts["logits_loss"]
    assert any("1/2 of every sequence" in note for note in shared.notes)


def test_tiled_mlp_drops_the_mlps_saved_intermediates():
    """Llama-3.1-8B, 8192 tokens, FSDP's checkpointing: the layer being back-propagated no longer keeps gate, up,
    activation and product (4 x 14336 bf16 values per token), and the MLP's transients are one 1024-token tile's."""
    plain = _diagnose(seq_len=8192).plan
    tiled = _diagnose(seq_len=8192, tiled_mlp_tokens=1024).plan
    act, inter, tokens, tile = 2, 14336, 8192, 1024
    saved = tokens * 4 * act * inter
    transient = tokens * 3 * act * inter - tile * 7 * act * inter
    assert plain.parts["activations"] - tiled.parts["activations"] == saved + transient
    assert plain.checkpointing == tiled.checkpointing == "fsdp"


def test_tiled_mlp_plans_a_tile_of_every_row_of_the_batch():
    """A tile holds batch x tiled_mlp_tokens tokens (tiles are cut along the sequence of [batch, length, hidden]):
    Llama-3.1-8B at 4 x 2048 plans 3 x 1024 more tokens of tile transients (7 x 14336 bf16 values each, 0.57 GiB)
    than at 1 x 8192, the same number of tokens. (The plan had min(tokens, tile) for both: the same figure.)"""
    one = _diagnose(seq_len=8192, tiled_mlp_tokens=1024).plan
    four = _diagnose(seq_len=2048, batch_size=4, tiled_mlp_tokens=1024).plan
    assert four.parts["activations"] - one.parts["activations"] == 3 * 1024 * 7 * 2 * 14336


def _tokens_per_mlp_call(batch, length, tile):
    """Tokens each call of a real tiled Llama MLP's gate projection computes (forward and the backward's
    recomputation), at batch x length with tiles of `tile` tokens."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hf_fsdp_qlora.train.tiled_mlp import install_tiled_mlp

    holder = torch.nn.Module()
    holder.mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=64, num_attention_heads=4))
    install_tiled_mlp(holder, tile_tokens=tile)
    calls = []
    holder.mlp.gate_proj.register_forward_hook(lambda module, args, out: calls.append(out.numel() // 64))
    holder.mlp(torch.randn(batch, length, 16, requires_grad=True)).sum().backward()
    return calls


@pytest.mark.parametrize("batch, length", [(4, 32), (1, 128), (3, 20), (2, 6)])
def test_tiled_mlp_plan_tile_is_the_codes_tile(tmp_path, batch, length):
    """The plan's tile (PlanContext.mlp_tile) against the tiles the tiled MLP really runs, at a tiny shape with
    tiles of 8 tokens: 4 x 32 runs tiles of 32 tokens, 1 x 128 of 8; 2 x 6 (a row within one tile) runs the MLP
    whole, and the plan is then the untiled plan."""
    import json

    from transformers import LlamaConfig

    from hf_fsdp_qlora.doctor.plan_context import plan_context

    config = LlamaConfig(hidden_size=16, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                         vocab_size=128)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    tiny = diagnose(tmp_path / "config.json", accelerate_config="fsdp2_qlora", quantization="4bit",
                    gpu_memory=GB, seq_len=length, batch_size=batch, tiled_mlp_tokens=8)  # fmt: skip
    calls = _tokens_per_mlp_call(batch, length, tile=8)
    ctx = plan_context(tiny.shape, tiny.setup)
    if len(calls) == 1:  # not tiled: one call over every token, nothing recomputed
        assert calls == [batch * length] and ctx.mlp_tile == 0
        untiled = plan_memory(tiny.shape, tiny.setup.replace(tiled_mlp_tokens=0))
        assert untiled.parts == tiny.plan.parts
    else:
        assert max(calls) == ctx.mlp_tile == batch * 8, (calls, ctx.mlp_tile)


def test_longest_sequence_is_the_boundary():
    """The answer is the verdict's "fits" boundary (the plan within 90% of memory); fraction=1.0 the 100% edge."""
    diagnosis = _diagnose(gpu_memory=24 * GB, num_gpus=1, tiled_mlp_tokens=1024)
    answers = {}
    for fraction in (0.9, 1.0):
        n = answers[fraction] = longest_sequence(diagnosis.shape, diagnosis.setup, fraction=fraction)
        assert plan_memory(diagnosis.shape, diagnosis.setup.replace(seq_len=n)).total <= fraction * 24 * GB
        assert plan_memory(diagnosis.shape, diagnosis.setup.replace(seq_len=n + 1)).total > fraction * 24 * GB
    assert longest_sequence(diagnosis.shape, diagnosis.setup) == answers[0.9] < answers[1.0]
    with pytest.raises(ValueError, match="gpu_memory"):
        longest_sequence(diagnosis.shape, diagnosis.setup.replace(gpu_memory=None))


def _cli(*args):
    """`hf-fsdp-qlora doctor` on Llama-3.1-8B's config (fsdp2_qlora, 4-bit): (exit code, stdout)."""
    import contextlib
    import io

    from hf_fsdp_qlora.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", "--model", str(DATA / MODELS["Llama-3.1-8B"]), "--accelerate-config", "fsdp2_qlora",
                     "--load-in-4bit", *args])  # fmt: skip
    return code, out.getvalue()


def _verdict_and_ids(*args):
    import json

    _, out = _cli(*args, "--json")
    document = json.loads(out)
    plan = document["memory"]["per_gpu"]
    total, memory = plan["total"], document["memory"]["gpu_memory"]
    return verdict(total, memory), {f["id"] for f in document["findings"]}


@pytest.mark.parametrize(
    "setup",
    [
        ("--gpu-memory", "24GB", "--num-gpus", "1"),
        ("--gpu-memory", "80GB", "--num-gpus", "1", "--tiled-mlp"),
        ("--gpu-memory", "24GB", "--num-gpus", "2", "--batch-size", "2", "--tiled-mlp", "--tiled-mlp-tokens", "512"),
    ],
    ids=["24GB", "80GB-tiled", "2x24GB-batch2-tiled"],
)
def test_longest_answer_is_a_length_the_doctor_calls_fits(setup):
    """`--longest`'s answer run back through `--seq-len` gets verdict fits and no memory-tight warning; one token
    more does not fit. (The answer was the 100% edge: 20,077 at 24 GB, which `--seq-len` calls tight.)"""
    _, out = _cli(*setup, "--longest")
    answer = int(re.search(r"longest sequence that fits: ([\d,]+) tokens", out).group(1).replace(",", ""))
    assert _verdict_and_ids(*setup, "--seq-len", str(answer)) == ("fits", _ids_without_memory(setup, answer))
    more, ids = _verdict_and_ids(*setup, "--seq-len", str(answer + 1))
    assert more == "tight" and "memory-tight" in ids
    edge = int(re.search(r"; ([\d,]+) at 100% of it, verdict tight", out).group(1).replace(",", ""))
    assert _verdict_and_ids(*setup, "--seq-len", str(edge))[0] == "tight"
    assert _verdict_and_ids(*setup, "--seq-len", str(edge + 1))[0] == "does_not_fit"


def _ids_without_memory(setup, seq_len):
    _, ids = _verdict_and_ids(*setup, "--seq-len", str(seq_len))
    assert not ids & {"memory-tight", "memory-does-not-fit"}, ids
    return ids


def test_longest_is_capped_at_the_models_positions_and_says_what_the_memory_allows():
    """8x80 GB with sp_size=8: the memory allows more than Llama-3.1-8B's 131,072 positions. The answer is 131,072
    (no seq-len-above-max-positions warning when run back), with the memory's figure beside it (was: 805,936 bare)."""
    setup = ("--gpu-memory", "80GB", "--num-gpus", "8", "--sp-size", "8")
    _, out = _cli(*setup, "--longest")
    diagnosis = _diagnose(num_gpus=8, sp_size=8)
    memory = longest_sequence(diagnosis.shape, diagnosis.setup)
    assert memory > 131072 == diagnosis.shape.max_positions
    assert "longest sequence that fits: 131,072 tokens per sample (the model's max_position_embeddings" in out
    assert f"the memory would allow {memory:,} (verdict fits)" in out
    assert "seq-len-above-max-positions" not in _verdict_and_ids(*setup, "--seq-len", "131072")[1]
    assert "seq-len-above-max-positions" in _verdict_and_ids(*setup, "--seq-len", str(memory))[1]


def test_memory_tight_advises_the_longest_length_that_fits():
    """At 17,000 tokens on 24 GB the plan is tight: the advice is max_length = the longest length that fits (the
    same search as --longest), which the doctor then calls fits (was: half the length, 8,500)."""
    diagnosis = _diagnose(gpu_memory=24 * GB, num_gpus=1, seq_len=17000)
    (tight,) = [f for f in diagnosis.findings if f.id == "memory-tight"]
    longest = longest_sequence(diagnosis.shape, diagnosis.setup)
    assert (tight.setting, tight.value.split(" (")[0]) == ("max_length", str(longest)), tight
    assert f"max_length -> {longest} saves" in tight.problem
    assert _diagnose(gpu_memory=24 * GB, num_gpus=1, seq_len=longest).plan.verdict == "fits"
    assert _diagnose(gpu_memory=24 * GB, num_gpus=1, seq_len=longest + 1).plan.verdict == "tight"


def _docs_rows():
    """docs/long-context.md's answers: | model | GPUs | sp_size | checkpointing | + tiled MLP | + offloading |."""
    text = (REPO / "docs" / "long-context.md").read_text()
    rows = re.findall(
        r"^\| (Llama-3\.1-\d+B) \| (\d+)x(\d+) GB \| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", text, re.MULTILINE
    )
    assert len(rows) == 4, rows
    return rows


def test_docs_longest_sequence_answers_are_the_doctors():
    for model, gpus, memory, sp, *answers in _docs_rows():
        common = {"gpu_memory": int(memory) * GB, "num_gpus": int(gpus), "sp_size": int(sp)}
        variants = [{}, {"tiled_mlp_tokens": 1024}, {"tiled_mlp_tokens": 1024, "activation_offloading": True}]
        for answer, variant in zip(answers, variants, strict=True):
            diagnosis = _diagnose(model, **common, **variant)
            assert longest_sequence(diagnosis.shape, diagnosis.setup) == int(answer.replace(",", "")), (model, variant)


def test_doctor_cli_longest(capsys):
    from hf_fsdp_qlora.cli.main import main

    code = main(["doctor", "--model", str(DATA / MODELS["Llama-3.1-8B"]), "--accelerate-config", "fsdp2_qlora", "--load-in-4bit",
                 "--gpu-memory", "24GB", "--num-gpus", "1", "--tiled-mlp", "--longest"])  # fmt: skip
    out = capsys.readouterr().out
    assert code in (0, 1)
    diagnosis = _diagnose(gpu_memory=24 * GB, num_gpus=1, tiled_mlp_tokens=1024)  # the CLI's default tile
    expected = longest_sequence(diagnosis.shape, diagnosis.setup)
    assert f"longest sequence that fits: {expected:,} tokens per sample" in out and "tiled MLP on" in out


def _sp_findings(tmp_path, sp_size, num_gpus, **config_changes):
    import json

    config = json.loads((DATA / MODELS["Llama-3.1-8B"]).read_text())
    config.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = diagnose(tmp_path / "config.json", accelerate_config="fsdp2_qlora", quantization="4bit",
                     gpu_memory=80 * GB, seq_len=8192, sp_size=sp_size, num_gpus=num_gpus)  # fmt: skip
    return [f for f in found.findings if f.id == "sequence-parallel-refused"]


@pytest.mark.parametrize(
    "sp_size, num_gpus, changes, says",
    [
        (2, 8, {}, None),  # Llama-3.1-8B: 32 heads, full attention: trains
        (3, 8, {}, "sp_size must divide the number of processes"),
        (3, 3, {}, "num_attention_heads=32, not divisible by sp_size"),
        (2, 2, {"layer_types": ["sliding_attention", "full_attention"] * 16, "sliding_window": 4096},
         "sliding_attention layers (sliding_window=4096)"),
    ],
)  # fmt: skip
def test_doctor_says_what_the_trainer_refuses_under_sp_size(tmp_path, sp_size, num_gpus, changes, says):
    """The same config-level refusals as the trainer's (hf_fsdp_qlora.sp_rules), before launch, with the fix."""
    found = _sp_findings(tmp_path, sp_size, num_gpus, **changes)
    if says is None:
        assert not found
        return
    assert len(found) == 1 and found[0].severity == "error", found
    assert says in found[0].problem and f"sp_size={sp_size}" in found[0].problem, found[0]
    assert found[0].value.startswith(("Use an sp_size", "Train this model with sp_size=1")), found[0]
