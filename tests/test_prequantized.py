"""Pre-quantized 4-bit checkpoints (a model saved after 4-bit loading, like the shared ``*-bnb-4bit`` repos).

Built here: the tiny Llama loaded in 4 bits with bitsandbytes' default uint8 storage (NF4 and FP4, double quant on
and off) and saved. ``load_qlora_model`` keeps the checkpoint's quantization, views its packed bytes as the run's
dtype (bit-equal to the saved bytes, never re-quantized) and refuses, before any weight is read, a checkpoint it
cannot train. Under FSDP1 and FSDP2 (the suite's shared launches) such a checkpoint trains with the first step's
logits and loss equal to the same checkpoint run single-process; ``low_cpu_ram=True`` gives every rank the
saved bytes.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from dist_utils import (
    SCRIPTS,
    assert_first_logits_equal,
    assert_scenario_trained_under_fsdp,
    packed_digests,
    with_initial_adapters,
)
from tiny_models import PREQUANTIZED, build_tiny_model, tiny_config

sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="module")
def checkpoints(shared_models):
    return {arch: build_tiny_model(shared_models / arch, arch) for arch in PREQUANTIZED}


def _packed(model):
    """{checkpoint key of each 4-bit weight: the Params4bit}."""
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit":
            found[name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"] = weight
    return found


@pytest.mark.parametrize("arch", sorted(PREQUANTIZED))
def test_loads_bit_equal_in_one_dtype(checkpoints, arch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora._bnb_cpu import disable_cpu_repack_in_model

    path = checkpoints[arch]
    saved = load_file(str(path / "model.safetensors"))
    model = load_qlora_model(path, dtype=torch.bfloat16, gradient_checkpointing=False)
    # The one-dtype rule holds: the packed weights too are bf16 (transformers alone leaves them uint8).
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # master weights
    packed = _packed(model)
    assert len(packed) == 14
    quant_type, double_quant = PREQUANTIZED[arch]
    for key, weight in packed.items():
        assert torch.equal(weight.data.reshape(-1).view(torch.uint8), saved[key].reshape(-1)), key
        assert weight.quant_state.quant_type == quant_type and weight.quant_state.nested == double_quant
    # Same values as the stock load of the same checkpoint (no adapter contribution: peft's lora_B starts at 0).
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    disable_cpu_repack_in_model(stock)
    assert {p.dtype for n, p in stock.named_parameters() if n.endswith("proj.weight")} == {torch.uint8}
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train(), stock.train()  # an eval-mode no_grad forward would repack the weights for the CPU kernel
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)


def _config_only(folder, quantization_config, **overrides):
    """A checkpoint folder holding only config.json: anything that reads weights fails with another error."""
    config = tiny_config("llama").to_dict()
    config.update(overrides, quantization_config=quantization_config)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


BNB4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


@pytest.mark.parametrize(
    ("quantization", "overrides", "dtype", "expected"),
    [
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, {}, "bfloat16", "pre-quantized in 8 bits"),
        ({"quant_method": "gptq", "bits": 4}, {}, "bfloat16", "quant_method='gptq'"),
        ({**BNB4, "bnb_4bit_quant_storage": "float8_e4m3fn"}, {}, "bfloat16", "cannot be viewed"),
        # 64 x 36 values pack into 1,152 bytes, 36 x 36 into 648: not a multiple of float32's 4 bytes.
        ({**BNB4, "bnb_4bit_quant_storage": "uint8"}, {"hidden_size": 36, "intermediate_size": 37}, "float32",
         "pass dtype='bfloat16'"),
    ],
)  # fmt: skip
def test_unfit_checkpoint_refused_before_loading(tmp_path, quantization, overrides, dtype, expected):
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.errors import UnsupportedSetupError

    folder = _config_only(tmp_path / "ckpt", quantization, **overrides)
    with pytest.raises(UnsupportedSetupError, match="load_qlora_model|dtype=") as err:
        load_qlora_model(folder, dtype=dtype)
    assert expected in str(err.value)


def test_doctor_reads_the_checkpoints_quantization(checkpoints, tmp_path):
    from hf_fsdp_qlora.doctor import diagnose

    # No quantization asked for: the checkpoint's own is planned (4-bit, its double quant).
    found = diagnose(checkpoints["llama_bnb4_fp4_nodq"], quantization=None, double_quant=True, gpu_memory=8 * 2**30)
    assert found.setup.quantization == "4bit" and found.setup.double_quant is False
    assert found.setup.storage == "bfloat16"  # our loader views the uint8 bytes as the run's dtype
    plain = diagnose(build_tiny_model(tmp_path / "plain", "llama"), quantization="4bit", gpu_memory=8 * 2**30)
    assert found.plan.total == pytest.approx(plain.plan.total, rel=0.02)
    stock = diagnose(checkpoints["llama_bnb4_nf4_dq"], trainer="transformers")
    assert stock.setup.storage == "uint8"  # a stock Trainer keeps what transformers loads
    eight_bit = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    eight = diagnose(_config_only(tmp_path / "eight", eight_bit), accelerate_config="fsdp2_qlora")
    # a checkpoint saved after 8-bit loading loads with load_qlora_model(path, bits=8): planned, not refused
    assert eight.setup.quantization == "8bit" and not eight.errors, eight.errors
    assert "8bit-under-fsdp" in {f.id for f in eight.findings if f.severity == "info"}


# Distributed: the same checkpoints trained in the suite's shared FSDP1 and FSDP2 launches (tests/conftest.py).
FSDP1 = {"pq1": ("llama_bnb4_nf4_dq", "ours_loader"), "pq2": ("llama_bnb4_fp4_nodq", "ours_loader")}
FSDP2 = {
    "pq3": ("llama_bnb4_nf4_nodq", "ours_loader"),
    "pq4": ("llama_bnb4_fp4_dq", "ours_loader"),
    "pq5": ("llama_bnb4_nf4_dq", "lowram"),
}
SHARED_TRAIN_SCENARIOS = {1: FSDP1, 2: FSDP2}


def _oracle(path, init):
    """The same checkpoint, single process, with the run's initial adapters."""
    import train_scenarios as worker

    from hf_fsdp_qlora import load_qlora_model

    model = load_qlora_model(path, lora_config=worker.lora_config(), gradient_checkpointing=False)
    return with_initial_adapters(model, init)


@pytest.mark.distributed
@pytest.mark.parametrize(("version", "name"), [(1, n) for n in FSDP1] + [(2, n) for n in FSDP2])
def test_trains_under_fsdp_as_single_process(shared_launch, version, name):
    import train_scenarios as worker

    models, out, results, _ = shared_launch(version)
    arch = {**FSDP1, **FSDP2}[name][0]
    for rank in (0, 1):
        found = results[rank][name]
        assert_scenario_trained_under_fsdp(found, version)
        assert found["frozen_dtypes_before_wrap"] == ["torch.bfloat16"] == found["packed_dtypes"]
        assert found["trainable_dtypes_before_wrap"] == ["torch.float32"]  # float32 master weights
        if version == 2:  # every 4-bit weight sharded: half its bytes on each rank
            assert found["packed_dtensor"] == found["packed_count"] == 14
            assert found["packed_local_bytes"] * 2 == found["packed_full_bytes"]
    weights = torch.load(out / name / "weights.pt")
    model = _oracle(str(models / arch), weights["init"])
    first = results[0][name]["first_batch"]
    assert_first_logits_equal(model, out, name, first, worker.BATCH)
    ids = torch.tensor(first)
    with torch.no_grad():
        for rank, chunk in enumerate(ids.split(worker.BATCH)):
            loss = float(model(input_ids=chunk, labels=chunk, attention_mask=torch.ones_like(chunk)).loss)
            assert results[0][name]["step0_losses"][rank] == pytest.approx(loss, rel=1e-6)
    changed = [k for k, v in weights["trained"].items() if "lora_B" in k and v.abs().sum() > 0]
    assert changed, "training did not move the adapters"


@pytest.mark.distributed
def test_low_cpu_ram_gives_every_rank_the_saved_bytes(shared_launch):
    from hf_fsdp_qlora import load_qlora_model

    models, out, _, _ = shared_launch(2)
    arch, kind = FSDP2["pq5"]
    found = {r: json.loads((out / f"lowram_{kind}_{arch}_rank{r}.json").read_text()) for r in (0, 1)}
    oracle = load_qlora_model(str(models / arch), gradient_checkpointing=False)
    for rank in (0, 1):
        world = 2 if found[rank]["partial"] else None
        assert found[rank]["digests"] == packed_digests(oracle, rank, world), rank
        assert found[rank]["meta_left"] == []


@pytest.mark.distributed
def test_trl_sft_script_trains_a_prequantized_checkpoint(tmp_path):
    """trl's sft.py, unchanged, through `-m hf_fsdp_qlora.run` under FSDP2 (trl's QLoRA flags: --load_in_4bit), with
    forked ranks (the real launcher runs trl's sft.py in tests/test_recipes.py and README's route 3)."""
    from dist_utils import check
    from recipe_fixtures import build_chat_dataset, build_recipe_model
    from safetensors.torch import load_file
    from test_recipes import _launch_script, _script_args
    from tiny_models import build_prequantized

    model = build_prequantized(tmp_path / "bnb4", "nf4", True, source=build_recipe_model(tmp_path / "recipe"))
    out = tmp_path / "sft"
    args = _script_args(model, build_chat_dataset(tmp_path / "chat"), out)
    proc = _launch_script("cpu_fsdp2_rehearsal.yaml", "sft", *args, fork=True)
    check(proc)
    text = proc.stdout + proc.stderr
    assert "hf_fsdp_qlora: FSDP2 engaged on 2 rank(s)" in text
    assert "non-floating frozen Params4bit" not in text  # accelerate would have left them unsharded
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
