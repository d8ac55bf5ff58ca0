"""Parameters transformers keeps in float32 in a 16-bit model (``_keep_in_fp32_modules_strict``) train on the 4-bit
base: stored in the training dtype like every frozen tensor (one dtype for FSDP), computed in float32 as the class
computes them. Inkling 2's router multiplies float32 hidden states by its weight uncast: cast down to bf16 it raised
"expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16" at the first forward.

Single-process, real bitsandbytes 4-bit and real peft, a tiny model built from the family's config; no hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from family_build import build
from family_sweep import _lora_config, _train_fresh


def test_a_float32_router_trains_in_float32_on_a_bf16_base(tmp_path):
    from hf_fsdp_qlora.loading.qlora import load_qlora_model

    path = build("inkling2_text", tmp_path / "m")
    model = load_qlora_model(path, dtype=torch.bfloat16, lora_config=_lora_config())
    router = model.get_submodule("base_model.model.model.layers.1.mlp.gate")
    assert router.weight.dtype == torch.bfloat16 and isinstance(router.weight, torch.nn.Parameter)
    seen = {}
    # (hooks run in the order registered: the loader's upcast before the first, its put-back before the second)
    handles = [router.register_forward_pre_hook(lambda m, args: seen.update(w=m.weight.dtype)),
               router.register_forward_hook(lambda m, args, out: seen.update(logits=out[0], x=args[0]))]  # fmt: skip
    assert "LoRA tensors with gradient" in _train_fresh(model)  # raised the dtype error before
    for handle in handles:
        handle.remove()
    assert seen["w"] == torch.float32  # upcast for its forward ...
    assert router.weight.dtype == torch.bfloat16 and isinstance(router.weight, torch.nn.Parameter)  # ... put back
    expected = torch.nn.functional.linear(seen["x"].float().reshape(-1, seen["x"].shape[-1]), router.weight.float())
    assert torch.equal(seen["logits"], expected)


def test_a_linear_layer_kept_float32_stays_out_of_4_bits(tmp_path):
    """HY-V4's indexer ``weights_proj`` (``_keep_in_fp32_modules_strict``) was quantized, and merge-adapters with
    ``dequantize="nf4"`` wrote it back round-tripped through NF4 (113 of 128 values changed): it is no 4-bit layer
    now, and the merged checkpoint holds the base's bytes."""
    from safetensors.torch import load_file

    from hf_fsdp_qlora.loading.qlora import load_qlora_model
    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    path = build("hy_v4", tmp_path / "m")
    model = load_qlora_model(path, dtype=torch.bfloat16, lora_config=_lora_config())
    name = "model.layers.0.self_attn.indexer.weights_proj"
    layer = model.get_submodule(f"base_model.model.{name}")
    assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.bfloat16, type(layer)
    model.save_pretrained(tmp_path / "adapter")
    out = merge_adapters(path, tmp_path / "adapter", tmp_path / "merged", progress=False, dequantize="nf4")
    base = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    merged = {k: v for f in Path(out).glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(merged[f"{name}.weight"], base[f"{name}.weight"])
