"""Tiled MLP (hf_fsdp_qlora.train.tiled_mlp) against the untiled MLP, on a real 4-bit NF4 + LoRA model.

The oracle is the same MLP module called whole: forward values, the input's gradient and every LoRA gradient.
Measured (float32 compute, tiles of 8 of 37 tokens): outputs and gradients within 1e-6; bf16 within one bf16 ulp.
"""

from __future__ import annotations

import pytest
import torch

from hf_fsdp_qlora.train.tiled_mlp import install_tiled_mlp, tiled_mlp_modules

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-3)}


@pytest.fixture(scope="module")
def qlora_models(tmp_path_factory):
    from peft import LoraConfig
    from tiny_models import build_tiny_model

    from hf_fsdp_qlora import load_qlora_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiled") / "llama")
    # No LoRA dropout: a tile draws its own mask, so with dropout the two runs would differ by design.
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = load_qlora_model(str(path), dtype=dtype, lora_config=lora)
        for name, p in model.named_parameters():  # LoRA B starts at 0: give it values so its A gradient is not 0
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        models[dtype] = model
    return models


def _mlp_grads(model, mlp, x):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = mlp(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()  # a gradient that differs per channel
    grads = {n: p.grad.detach().clone() for n, p in mlp.named_parameters() if p.requires_grad}
    return out.detach(), x.grad.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_mlp_equals_untiled_forward_and_lora_grads(qlora_models, dtype):
    import bitsandbytes as bnb

    model = qlora_models[dtype]
    name, mlp = tiled_mlp_modules(model)[0]
    assert isinstance(mlp.gate_proj.base_layer, bnb.nn.Linear4bit)  # a real 4-bit base under LoRA
    x = torch.randn(2, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = _mlp_grads(model, mlp, x)
    original = mlp.forward
    try:
        assert install_tiled_mlp(_Holder(mlp), tile_tokens=8) == 1
        got = _mlp_grads(model, mlp, x)
    finally:
        mlp.forward = original
        del mlp._hf_fsdp_qlora_tiled_mlp
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=atol)
    assert set(got[2]) == set(want[2]) and len(got[2]) == 6  # lora_A and lora_B of gate, up and down
    for key in want[2]:
        assert want[2][key].abs().sum() > 0, key
        torch.testing.assert_close(got[2][key], want[2][key], rtol=rtol, atol=atol)


class _Holder(torch.nn.Module):
    """One MLP under the attribute name decoder layers use, so tiled_mlp_modules finds it."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


def test_tiled_mlp_keeps_one_tiles_intermediates():
    """What forward keeps for backward: tiled, the input and output only (the intermediates of the whole sequence,
    gate/up/act/product of 4 x intermediate values per token, are never saved); untiled, all of them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=16, intermediate_size=64, hidden_act="silu", num_attention_heads=4)
    x = torch.randn(1, 256, 16, requires_grad=True)

    def saved_bytes(module):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x).sum().backward()
        return total[0]

    torch.manual_seed(0)
    plain = _Holder(LlamaMLP(config))
    untiled = saved_bytes(plain.mlp)
    install_tiled_mlp(plain, tile_tokens=32)
    tiled = saved_bytes(plain.mlp)
    assert untiled >= 256 * 64 * 4 * 3  # at least gate, up and the activation of every token
    assert tiled * 4 <= untiled, (tiled, untiled)


def test_moe_blocks_keep_their_path():
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    assert tiled_mlp_modules(moe) == []
    assert install_tiled_mlp(moe) == 0
    dense = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert len(tiled_mlp_modules(dense)) == dense.config.num_hidden_layers


def test_tile_size_must_be_positive():
    with pytest.raises(ValueError, match="tiled_mlp_tokens=0"):
        install_tiled_mlp(torch.nn.Module(), tile_tokens=0)
