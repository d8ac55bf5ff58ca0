"""Padding-free packing (trl's padding_free=True): the loss of a packed batch equals the loss of the same sequences
padded, with every attention implementation that trains on CPU (eager, sdpa; flex_attention has no CPU backward), through our chunked loss
and trl's own, single-process and under FSDP1 and FSDP2 (the suite's shared launches, gradient accumulation over 2
micro-batches, per-token normalisation across ranks). An attention implementation transformers builds no mask for
is refused at train() start.
"""

from __future__ import annotations

import sys

import pytest
import torch
from dist_utils import SCRIPTS
from tiny_models import build_tiny_model

sys.path.insert(0, str(SCRIPTS))

# flex_attention cannot train on CPU ("FlexAttention does not support backward on CPU"), and its CPU forward of a
# packed row is not reliable in torch 2.13 (NaN through a 4-bit model, 1e-2 off the padded loss without
# transformers' cu_seq_lens keys): the CPU implementations that train are eager and sdpa.
TRAINABLE = ("eager", "sdpa")
# Float32 weights: packed and padded runs differ only by the summation order of different matmul shapes.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def llama(shared_models):
    return build_tiny_model(shared_models / "llama", "llama")


def _sequences():
    import packing_scenarios

    data = packing_scenarios.dataset()
    return [{"input_ids": ids} for ids in data["input_ids"][:4]]


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("attention", TRAINABLE)
def test_packed_loss_equals_padded_single_process(llama, tmp_path, attention, use_cache):
    """TrainingArguments(use_cache=True) (for PEFT methods that read past_key_values) puts a KV cache in every
    training forward, and transformers then skips the packed-sequence mask (tests/test_compat.py's
    test_packed_mask_skipped_with_a_cache): train() start switches it off for padding-free batches."""
    import packing_scenarios

    runs = {
        mode: packing_scenarios._train(
            str(llama), tmp_path / mode, None, "llama", "ours", attention, mode == "packed", use_cache=use_cache
        )
        for mode in ("packed", "padded")
    }
    assert len(runs["packed"]["losses"]) == 4  # 2 steps x 2 micro-batches
    assert runs["packed"]["loss_path"] == "ours"  # the chunked loss
    packed, padded = runs["packed"]["losses"], runs["padded"]["losses"]
    worst = max(abs(a - b) / b for a, b in zip(packed, padded))
    print(f"measured {attention} use_cache={use_cache}: max rel diff {worst:.2e}")
    torch.testing.assert_close(packed, padded, rtol=TOLERANCE, atol=0)
    assert runs["packed"]["use_cache"] is False
    assert runs["padded"]["use_cache"] is use_cache  # not padding-free: left as asked


def test_attention_without_mask_refused_at_train_start(llama, tmp_path):
    import packing_scenarios

    from hf_fsdp_qlora.errors import UnsupportedSetupError

    impl = packing_scenarios.register_custom_attention()
    with pytest.raises(UnsupportedSetupError, match="attn_implementation='custom_sdpa'.*'sdpa'"):
        packing_scenarios._train(str(llama), tmp_path / "p", None, "llama", "ours", impl, True)
    # Not padding-free: nothing to refuse (padded batches carry an attention mask).
    packing_scenarios._train(str(llama), tmp_path / "q", None, "llama", "ours", impl, False)


def test_decided_once_not_per_step():
    """The check is a train-start callback event, not part of the step: the plain path pays nothing per step."""
    from hf_fsdp_qlora.train.callbacks import FSDPQLoRACallback

    source = __import__("inspect").getsource
    assert "check_padding_free" in source(FSDPQLoRACallback.on_train_begin)
    for hook in ("on_step_begin", "on_step_end", "on_substep_end"):
        method = getattr(FSDPQLoRACallback, hook)
        assert "padding" not in source(method) if method.__qualname__.startswith("FSDPQLoRA") else True


# Distributed: FSDP1 and FSDP2 in the suite's shared launches (tests/conftest.py); route x attention spread over both.
FSDP1 = {"pk1": ("llama", "pack_ours_sdpa_cache"), "pk2": ("llama", "pack_sft_eager")}
FSDP2 = {
    "pk3": ("llama", "pack_ours_eager_cache"),
    "pk4": ("llama", "pack_sft_sdpa"),
    "pk5": ("llama", "pack_ours_custom"),
}
SHARED_TRAIN_SCENARIOS = {1: FSDP1, 2: FSDP2}


@pytest.mark.distributed
@pytest.mark.parametrize(("version", "name"), [(1, n) for n in FSDP1] + [(2, n) for n in FSDP2 if n != "pk5"])
def test_packed_loss_equals_padded_under_fsdp(shared_launch, version, name):
    _, _, results, _ = shared_launch(version)
    kind = {**FSDP1, **FSDP2}[name][1]
    per_rank = []
    for rank in (0, 1):
        found = results[rank][name]
        assert found["ok"], found.get("traceback")
        for mode in ("packed", "padded"):
            run = found[mode]
            assert run["distributed_type"] == "DistributedType.FSDP"
            assert run["loss_path"] == ("sft" if "_sft_" in kind else "ours"), run["loss_path"]  # ours: chunked
            engaged = run["engagement"]
            assert engaged["flat_params"] > 0 if version == 1 else engaged["fsdp2_modules"] > 0, engaged
        assert len(found["packed"]["losses"]) == 4
        packed, padded = found["packed"]["losses"], found["padded"]["losses"]
        print(f"measured {name} rank {rank}: max rel diff {max(abs(a - b) / b for a, b in zip(packed, padded)):.2e}")
        torch.testing.assert_close(packed, padded, rtol=TOLERANCE, atol=0)
        per_rank.append(found["packed"]["losses"])
    assert per_rank[0] != per_rank[1]  # each rank trained on its own sequences


@pytest.mark.distributed
def test_attention_without_mask_refused_under_fsdp(shared_launch):
    _, _, results, _ = shared_launch(2)
    for rank in (0, 1):
        found = results[rank]["pk5"]
        assert not found["ok"] and found["error_type"] == "UnsupportedSetupError"
        assert "attn_implementation='custom_sdpa'" in found["error"] and "'flash_attention_2'" in found["error"]
