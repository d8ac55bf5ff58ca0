"""Issue 48: routers are never LoRA targets under ``"all-linear"``.

Before: with ``quantize_experts=False`` (the refusal's own advice for experts classes outside the table), Phi-MoE and
``llama4_text`` crashed at the first forward: all-linear put LoRA on ``router``, an ``nn.Linear`` subclass whose
forward returns a tuple (``AttributeError: 'tuple' object has no attribute 'dtype'`` inside peft).

Single process, real bitsandbytes 4-bit and real peft; tiny models built from the families' config classes
(tests/family_build.py).
"""

from __future__ import annotations

import pytest
import torch
from family_build import build
from peft import LoraConfig

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.experts.routers import router_layers

IDS = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
ROUTERS = {
    "phimoe": {"model.layers.0.mlp.router", "model.layers.1.mlp.router"},
    "llama4_text": {f"model.layers.{i}.feed_forward.router" for i in range(4)},
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("router_families")
    return lambda family: build(family, root / family) if not (root / family).exists() else root / family


def _lora_layers(model) -> set[str]:
    base = model.get_base_model()
    return {n for n, m in base.named_modules() if hasattr(m, "lora_A") and m.lora_A}


def _loss(model):
    model.train()
    return model(input_ids=IDS, labels=IDS).loss


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_all_linear_trains_without_the_routers(bases, family):
    """One step with 16-bit experts and all-linear LoRA (dropout 0, for the oracle): no router adapted, every LoRA
    tensor moves, and the loss equals stock peft's on the same 4-bit base given the same layers by name."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = bases(family)
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "init_lora_weights": False}
    torch.manual_seed(0)
    model = load_qlora_model(str(path), quantize_experts=False, gradient_checkpointing=False, dtype=torch.float32,
                             lora_config=LoraConfig(target_modules="all-linear", **lora))  # fmt: skip
    loss = _loss(model)  # before: AttributeError: 'tuple' object has no attribute 'dtype'
    layers = _lora_layers(model)
    assert layers and not [n for n in layers if "router" in n]
    assert router_layers(model.get_base_model()) == ROUTERS[family]
    loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    torch.optim.SGD(trainable.values(), lr=0.5).step()
    assert torch.isfinite(loss) and all(not torch.equal(before[n], p) for n, p in trainable.items())
    # Oracle: stock transformers + peft on the same 4-bit base, the same layers named, the same start.
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)  # fmt: skip
    stock = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)
    torch.manual_seed(0)
    stock = get_peft_model(stock, LoraConfig(target_modules=sorted(layers), **lora), autocast_adapter_dtype=False)
    assert _lora_layers(stock) == layers
    torch.testing.assert_close(_loss(stock), loss.detach(), rtol=1e-5, atol=0)


def test_a_shared_expert_gate_is_no_router(tmp_path):
    """Qwen3-Next's ``shared_expert_gate`` (one output: a gate on the shared expert, not a score per expert) stays an
    all-linear target; its router is no ``nn.Linear``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build("qwen3_next", tmp_path / "qwen3_next"))
    assert router_layers(model) == set()
    assert any(n.endswith("shared_expert_gate") for n, _ in model.named_modules())


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_the_doctor_counts_no_router_lora(bases, family):
    """The doctor's all-linear targets are the loader's: every linear layer but the head and the routers."""
    from hf_fsdp_qlora.model_shapes import model_shape

    shape = model_shape(bases(family) / "config.json")
    lora = {s.name for s in shape.linears if s.lora}
    assert lora and not lora & ROUTERS[family]
    assert ROUTERS[family] <= {s.name for s in shape.linears}  # still counted as linear layers (4-bit)


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_scripts_all_linear_under_the_launcher(bases, family, monkeypatch):
    """trl's route (`-m hf_fsdp_qlora.run`, HF_FSDP_QLORA_QUANTIZE_EXPERTS=0: the refusal's advice there): the
    script's own 4-bit from_pretrained and get_peft_model with `--lora_target_modules all-linear` and trl's default
    dropout 0.05. Before: LoRA on the router, and the same AttributeError at the first forward."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

    from hf_fsdp_qlora.experts.lora import quantize_experts_before_peft
    from hf_fsdp_qlora.train.launcher import QUANTIZE_EXPERTS_ENV

    # The launcher's hooks are process-wide: both are restored after the test.
    monkeypatch.setattr(BaseTuner, "inject_adapter", BaseTuner.inject_adapter)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", PreTrainedModel.__dict__["from_pretrained"])
    quantize_experts_before_peft(QUANTIZE_EXPERTS_ENV, quantize=False)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(bases(family), quantization_config=quant, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear"))
    loss = _loss(model)  # before: AttributeError: 'tuple' object has no attribute 'dtype'
    loss.backward()
    layers = _lora_layers(model)
    assert layers and not [n for n in layers if "router" in n]
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad), "a LoRA without grad"
