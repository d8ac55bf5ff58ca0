"""FSDP2 really shards the 4-bit base, and the packed bytes reach the matmul unchanged.

One 2-rank launch (accelerate + the shipped CPU FSDP2 config) over the storage matrix: bf16, fp16, fp32
and uint8 storage (viewed as bf16 so it shards), NF4 and FP4, double quant on and off, including a model
whose packed bytes read as NaN, Inf and subnormal bf16 values. For each: every 4-bit weight is a DTensor
holding half the bytes on each rank, FSDP's param dtype equals the storage dtype, and the first-step
logits equal the unsharded model's bit for bit.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dist_utils import SCRIPTS, assert_first_logits_equal

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.distributed

SCENARIOS = {
    "p": ("llama_nanbytes", "st_bf16_nf4_dq"),
    "q": ("llama", "st_fp16_fp4_nodq"),
    "r": ("llama", "st_fp32_nf4_dq"),
    "s": ("llama_nanbytes", "st_uint8_nf4_dq"),
    "t": ("llama", "st_uint8_fp4_nodq"),
}


@pytest.fixture(scope="module")
def run(shared_launch):
    models, out, results, _ = shared_launch(2)
    return models, out, results


def _unsharded(models, arch, kind):
    import train_scenarios as worker
    from hf_fsdp_qlora.dtypes import harmonize_dtypes, training_dtype, view_packed_storage_as

    model = worker.load_storage_variant(str(models / arch), kind)
    dtype = training_dtype(model)
    view_packed_storage_as(model, dtype)  # the same bytes, re-typed: values cannot change
    harmonize_dtypes(model, dtype)
    model.train()  # an eval-mode no_grad forward would repack the weights for the CPU kernel (see hf_fsdp_qlora/_bnb_cpu.py)
    return model


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_4bit_weight_is_sharded(run, name):
    _, _, results = run
    for rank in (0, 1):
        found = results[rank][name]
        assert found["ok"], found.get("traceback")
        assert found["packed_count"] > 0 and found["packed_dtensor"] == found["packed_count"]
        assert found["packed_local_bytes"] * 2 == found["packed_full_bytes"]
        assert found["packed_dtypes"] != ["torch.uint8"]
        # No mixed-precision cast can touch the packed bytes: FSDP's param dtype is the storage dtype.
        assert found["mp_param_dtype"] in found["packed_dtypes"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_logits_equal_unsharded_bit_for_bit(run, name):
    import train_scenarios as worker

    models, out, results = run
    arch, kind = SCENARIOS[name]
    model = _unsharded(models, arch, kind)
    assert_first_logits_equal(model, out, name, results[0][name]["first_batch"], worker.BATCH)


def test_planted_bytes_read_as_nan_inf_subnormal(run):
    models, _, _ = run
    model = _unsharded(models, "llama_nanbytes", "st_bf16_nf4_dq")
    packed = torch.cat([p.data.reshape(-1) for p in model.parameters() if type(p).__name__ == "Params4bit"])
    tiny = torch.finfo(torch.bfloat16).tiny
    assert torch.isnan(packed).sum() > 100 and torch.isinf(packed).sum() > 100
    assert ((packed != 0) & (packed.abs() < tiny)).sum() > 100


# Under FSDP1 integer storage used to be refused ("Cannot flatten integer dtype tensors" upstream): trl's QLoRA recipe
# (`--load_in_4bit`) leaves bitsandbytes' default uint8. Ours views the same bytes as the compute dtype.
FSDP1_SCENARIOS = {"s": ("llama_nanbytes", "st_uint8_nf4_dq"), "t": ("llama", "st_uint8_fp4_nodq")}


# Both run in the suite's shared launches (tests/conftest.py), with other modules' trainer scenarios.
SHARED_TRAIN_SCENARIOS = {2: SCENARIOS, 1: FSDP1_SCENARIOS}


@pytest.fixture(scope="module")
def run_fsdp1(shared_launch):
    models, out, results, _ = shared_launch(1)
    return models, out, results


@pytest.mark.parametrize("name", sorted(FSDP1_SCENARIOS))
def test_fsdp1_integer_storage_flattens_bit_exact(run_fsdp1, name):
    import train_scenarios as worker

    models, out, results = run_fsdp1
    for rank in (0, 1):
        found = results[rank][name]
        assert found["ok"], found.get("traceback")
        assert found["engagement"]["flat_params"] > 0  # FSDP1 engaged: FlatParameters over the viewed bytes
        assert found["packed_dtypes"] == ["torch.bfloat16"] == [found["mp_param_dtype"]]
    arch, kind = FSDP1_SCENARIOS[name]
    model = _unsharded(models, arch, kind)
    assert_first_logits_equal(model, out, name, results[0][name]["first_batch"], worker.BATCH)
