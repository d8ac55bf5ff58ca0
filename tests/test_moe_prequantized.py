"""Already-quantized mixture-of-experts checkpoints given to `load_qlora_model` (issue 27, bad input).

Two kinds, built here from the tiny Qwen3-MoE:

- a stock 4-bit checkpoint (transformers + bitsandbytes `load_in_4bit`, then `save_pretrained`, as the shared
  `*-bnb-4bit` repos are made): its linear layers are packed, its experts 16-bit. It loads, and the experts are
  quantized with the checkpoint's own quant type and double quant (the ones its linear layers were packed with);
  oracle: `load_qlora_model` on the original 16-bit checkpoint with that quantization, equal to the last bit.
- a checkpoint saved from a model holding our `QuantizedExperts`: packed expert bytes without their quantization
  constants (non-persistent buffers). transformers would initialise the experts at random (its load report only
  lists them as missing); `load_qlora_model` refuses it before reading any weight.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_prequantized, build_tiny_model

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.errors import UnsupportedSetupError
from hf_fsdp_qlora.experts.quantized import QuantizedExperts, quantize_experts

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def moe16(shared_models):
    return build_tiny_model(shared_models / "qwen3_moe", "qwen3_moe")


def _load(path, **kw):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ATTENTION)
    return load_qlora_model(str(path), lora_config=lora, gradient_checkpointing=False, **kw).train()


def _experts(model):
    found = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert found and all(isinstance(m, QuantizedExperts) for m in found), [type(m) for m in found]
    return found


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_stock_4bit_moe_checkpoint_quantizes_experts_like_the_checkpoint(moe16, tmp_path, quant_type, double_quant):
    from safetensors.torch import load_file

    path = build_prequantized(tmp_path / "bnb4", quant_type, double_quant, source=moe16)
    saved = load_file(str(path / "model.safetensors"))
    assert any(".mlp.experts.0." in k and v.dtype == torch.bfloat16 for k, v in saved.items())  # experts 16-bit
    assert any(k.endswith("q_proj.weight") and v.dtype == torch.uint8 for k, v in saved.items())  # linears packed
    # The caller's defaults (nf4, double quant) are not the checkpoint's in the fp4 case: the checkpoint wins.
    model = _load(path)
    oracle = _load(moe16, quant_type=quant_type, double_quant=double_quant)
    # one dtype among the frozen tensors, float32 master weights for the adapters (load_qlora_model's default)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    for got, want in zip(_experts(model), _experts(oracle), strict=True):
        assert got.quant_type == quant_type
        assert (got.gate_up_proj_absmax.dtype == torch.uint8) == double_quant  # double quant packs absmax in bytes
        for name in ("gate_up_proj_4bit", "down_proj_4bit"):
            assert torch.equal(getattr(got, name).view(torch.int16), getattr(want, name).view(torch.int16)), name
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, oracle(input_ids=ids).logits)


def _save_with_our_experts(source, path, max_shard_size=None):
    """The base as load_qlora_model builds it (4-bit linears and experts), written with save_pretrained."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=q, dtype=torch.bfloat16)
    assert quantize_experts(model)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_saved_with_our_4bit_experts_is_refused(moe16, tmp_path, sharded):
    from safetensors import safe_open

    path = _save_with_our_experts(moe16, tmp_path / "ours", "100KB" if sharded else None)
    files = sorted(path.glob("*.safetensors"))
    assert (len(files) > 1) == sharded and (path / "model.safetensors.index.json").exists() == sharded
    keys = [k for f in files for k in safe_open(str(f), "pt").keys()]  # noqa: SIM118 (safe_open is no dict)
    assert "model.layers.0.mlp.experts.gate_up_proj_4bit" in keys
    assert not any("absmax" in k and ".experts." in k for k in keys)  # the constants were not written
    for low_cpu_ram in (False, True):
        with pytest.raises(
            UnsupportedSetupError, match="saved from a model with hf_fsdp_qlora's 4-bit experts"
        ) as err:
            _load(path, low_cpu_ram=low_cpu_ram)
        assert "model.layers.0.mlp.experts." in str(err.value) and "original 16-bit checkpoint" in str(err.value)


def test_saved_quantized_experts_names_only_packed_expert_weights():
    from hf_fsdp_qlora.prequantized import saved_quantized_experts

    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj_4bit",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight_4bit"]  # fmt: skip
    assert saved_quantized_experts(names, {"gate_up_proj", "down_proj"}) == [
        "model.layers.0.mlp.experts.down_proj_4bit"
    ]
