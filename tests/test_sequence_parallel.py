"""Ulysses sequence parallelism (hf_fsdp_qlora.train.sequence_parallel, train/ulysses.py).

Single process: the batch split (labels shifted before it, padding to a multiple of sp_size, global positions),
the packed mask, and the refusals. Distributed: ONE 2-rank FSDP2 launch (gloo) of tests/scripts/
sequence_parallel_scenarios.py with sp_size=2, against the same scenarios run by one process on the whole sequence.

Measured (float32 compute, 4-bit NF4 base, LoRA r=4 on every linear layer, random lora_B): the first-step loss equal
(difference 0), every LoRA gradient within 2.0e-6 of its largest element (summation order only: the attention
runs on the same tokens, the partial gradients of the two ranks are summed by FSDP's reduce-scatter); the 8 logged
losses of the run within 1.7e-7 relative. Asserted with a 10x margin.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hf_fsdp_qlora.errors import UnsupportedSetupError
from hf_fsdp_qlora.train.sequence_parallel import check_sequence_parallel, split_batch
from hf_fsdp_qlora.train.ulysses import _packed_mask

LOSS_RTOL = 2e-6
GRAD_TOL = 2e-5  # max |difference| / max |oracle gradient|, per tensor
SCENARIOS = ("plain", "ckpt", "packed", "gqa")


# --- single process ---------------------------------------------------------------------------------------------


def test_split_shifts_labels_before_splitting_and_pads():
    ids = torch.arange(10, 25).unsqueeze(0)  # 15 tokens: padded to 16, split 8 + 8
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    first, positions, count = split_batch(batch, 2, 0)
    second, _, _ = split_batch(batch, 2, 1)
    assert positions is None and int(count) == 12  # labels 3..14 are the targets of tokens 2..13
    assert first["input_ids"].tolist() == [list(range(10, 18))]
    assert second["input_ids"].tolist() == [[*range(18, 25), 0]]
    # the target of the last token of rank 0 (position 7) is the first token of rank 1: not lost at the boundary
    assert int(first["shift_labels"][0, -1]) == 18
    assert second["shift_labels"][0, -2:].tolist() == [-100, -100]  # the last real token and the pad: no target
    assert second["position_ids"].tolist() == [list(range(8, 16))]  # global positions for RoPE
    assert "attention_mask" not in first and torch.equal(first["labels"], first["shift_labels"])


def test_split_keeps_packed_positions_and_refuses_padding():
    ids = torch.arange(8).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    local, packed, _ = split_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, 2, 1)
    assert torch.equal(packed, positions) and local["position_ids"].tolist() == [[1, 0, 1, 2]]
    padded = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1] * 6 + [0] * 2])}
    with pytest.raises(UnsupportedSetupError, match=r"sp_size=2\) with a padded batch"):
        split_batch(padded, 2, 0)
    with pytest.raises(UnsupportedSetupError, match="per-token input 'token_type_ids'"):
        split_batch({"input_ids": ids, "labels": ids, "token_type_ids": ids}, 2, 0)


def test_packed_mask_is_causal_within_each_sequence():
    mask = _packed_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def _model():
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")


def test_refusals_name_the_setting():
    model = _model()
    assert check_sequence_parallel(model, 2, 4) == "sdpa"
    with pytest.raises(UnsupportedSetupError, match=r"sp_size=3\) on 4 processes"):
        check_sequence_parallel(model, 3, 4)
    with pytest.raises(UnsupportedSetupError, match="num_attention_heads=4, not divisible"):
        check_sequence_parallel(model, 8, 8)
    model.config._attn_implementation = "eager"
    with pytest.raises(UnsupportedSetupError, match="attn_implementation='eager'"):
        check_sequence_parallel(model, 2, 2)
    from transformers import AutoModelForCausalLM, MistralConfig

    mistral = AutoModelForCausalLM.from_config(
        MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, sliding_window=8),
        attn_implementation="sdpa",
    )  # fmt: skip
    with pytest.raises(UnsupportedSetupError, match="sliding_attention layers"):
        check_sequence_parallel(mistral, 2, 2)


# --- 2 ranks, FSDP2, sp_size=2, against one process on the whole sequence ---------------------------------------


def _build_one_kv_head(path):
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.num_key_value_heads = 1  # fewer key/value heads than sp_size=2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dist_utils import SCRIPTS, _env, accelerate_launch, check, read_results
    from tiny_models import build_tiny_model

    models = tmp_path_factory.mktemp("models")
    build_tiny_model(models / "llama")
    _build_one_kv_head(models / "llama_kv1")
    out = tmp_path_factory.mktemp("sp") / "run"
    proc = accelerate_launch(
        "cpu_fsdp2_rehearsal.yaml", "sequence_parallel_scenarios.py", "--models", str(models), "--out", str(out),
        timeout=500,
    )  # fmt: skip
    check(proc)
    single = subprocess.run(
        [sys.executable, str(SCRIPTS / "sequence_parallel_scenarios.py"), "--models", str(models), "--out", str(out),
         "--single"],
        env=_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-4000:]
    import json

    return out, read_results(out), json.loads((out / "single.json").read_text()), models


@pytest.mark.parametrize("name", SCENARIOS)
def test_sp2_under_fsdp2_equals_one_process_on_the_whole_sequence(runs, name):
    out, ranks, single, _ = runs
    assert set(ranks) == {0, 1}
    oracle = single[name]
    assert "error" not in oracle, oracle.get("error")
    for rank, found in ranks.items():
        assert "error" not in found[name], found[name].get("error")
        got = found[name]
        assert got["distributed_type"] == "DistributedType.FSDP" and got["world"] == 2
        assert got["engaged"]["fsdp2_modules"] > 0 and got["dtensor_params"] > 0, got["engaged"]  # FSDP2 engaged
        assert (got["checkpointed"] > 0) == (name == "ckpt"), got["checkpointed"]
        assert len(got["losses"]) == 8
        torch.testing.assert_close(got["losses"], oracle["losses"], rtol=LOSS_RTOL, atol=0)
        if name == "plain":  # evaluation after training: the eval dataloader is sharded by group too
            assert got["eval_loss"] == pytest.approx(oracle["eval_loss"], rel=LOSS_RTOL)
    grads = torch.load(out / f"grads_{name}_sp2.pt")
    want = torch.load(out / f"grads_{name}_sp1.pt")
    assert set(grads) == set(want) and len(want) == 2 * 7 * 2  # lora_A and lora_B of 7 linears in 2 layers
    k_out = next(v for k, v in want.items() if "k_proj.lora_B" in k).shape[0]
    assert k_out == (16 if name == "gqa" else 32)  # head_dim 16: the gqa model has 1 key/value head, the others 2
    for key, ref in want.items():
        scale = float(ref.abs().max())
        assert scale > 0, key  # random lora_B at start (init_lora_weights=False): no gradient is trivially 0
        error = float((grads[key] - ref).abs().max())
        assert error <= GRAD_TOL * max(scale, 1e-12), (key, error, scale)


def test_resume_under_sp2_is_bit_exact(runs):
    """A run with sp_size=2 under FSDP2 checkpointed at step 2 (AdamW) and resumed by a fresh trainer: steps 3 and 4
    log the uninterrupted run's losses and end with its adapter, bit for bit."""
    out, ranks, _, _ = runs
    for found in ranks.values():
        got = found["resume"]
        assert "error" not in got, got.get("error")
        # the resumed trainer's history: steps 1-2 read from the checkpoint, steps 3-4 computed after the resume
        assert len(got["whole"]) == 4 and got["resumed"] == got["whole"]
        assert got["whole_steps_run"] == [1, 2, 3, 4] and got["resumed_steps_run"] == [3, 4]  # it did resume
    whole, resumed = torch.load(out / "resume_whole.pt"), torch.load(out / "resume_resumed.pt")
    assert set(whole) == set(resumed) and whole
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key


def test_stock_sequence_parallelism_is_deepspeed_only():
    """Canary (_compat ulysses_sequence_parallel): accelerate's ParallelismConfig knows sp_size, but only with the
    DeepSpeed backend; when it accepts another, read whether FSDP2 sequence parallelism can move upstream."""
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match=r"sp_backend must be one of \['deepspeed'\]"):
        ParallelismConfig(sp_size=2, sp_backend="fsdp")


@pytest.mark.parametrize("route", ["ours", "stock", "sft"])
def test_sp_size_is_never_ignored(tmp_path, route):
    """sp_size > 1 works through our trainer mixin's hooks only: a stock Trainer given it adopts the mixin (so the
    setting is honoured or refused, never ignored), and a trainer with its own loss (trl's SFT) is refused by name."""
    from transformers import Trainer

    from hf_fsdp_qlora import FSDPQLoRASFTTrainer, FSDPQLoRATrainer, FSDPQLoRATrainingArguments

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], sp_size=2)  # noqa: C408
    if route == "sft":
        from trl import SFTConfig

        args = SFTConfig(**{k: v for k, v in common.items() if k != "sp_size"}, bf16=False)
        args.sp_size = 2
        kind, match = FSDPQLoRASFTTrainer, "with SFTTrainer, which computes its own loss"
    else:
        args = FSDPQLoRATrainingArguments(**common)
        kind, match = (FSDPQLoRATrainer if route == "ours" else Trainer), r"sp_size=2\) in a single process"
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8]] * 2})
    with pytest.raises(UnsupportedSetupError, match=match):
        extra = {}
        if route == "sft":
            from tiny_models import build_tokenizer

            extra["processing_class"] = build_tokenizer()
        kind(model=_model(), args=args, train_dataset=data, **extra)


def test_sp2_under_fsdp1_equals_one_process(runs, tmp_path):
    """The same under FSDP1 (FlatParameters, one launch): the plain scenario's 8 losses and evaluation equal the
    oracle's (measured within 8.6e-8; eval equal), and the sp_size=2 resume is bit-exact. (FSDP1's gradients are
    flat shards: the gradients are compared under FSDP2 above.)"""
    from dist_utils import accelerate_launch, check, read_results

    _, _, single, models = runs
    proc = accelerate_launch(
        "cpu_fsdp1_rehearsal.yaml", "sequence_parallel_scenarios.py", "--models", str(models), "--out",
        str(tmp_path / "run"), "--scenarios", "plain", timeout=500,
    )  # fmt: skip
    check(proc)
    for found in read_results(tmp_path / "run").values():
        got, oracle = found["plain"], single["plain"]
        assert "error" not in got, got.get("error")
        assert got["engaged"]["flat_params"] > 0 and got["distributed_type"] == "DistributedType.FSDP"
        torch.testing.assert_close(got["losses"], oracle["losses"], rtol=LOSS_RTOL, atol=0)
        assert got["eval_loss"] == pytest.approx(oracle["eval_loss"], rel=LOSS_RTOL)
        resume = found["resume"]
        assert resume["resumed"] == resume["whole"] and resume["resumed_steps_run"] == [3, 4], resume
