"""Issue 48, item 5: an all-linear adapter of a shared-expert MoE (GLM-4-MoE, DeepSeek-V3: a dense first layer,
shared experts) reloads as trained by every route docs/moe.md names.

Before: the saved config listed ``gate_proj`` / ``up_proj`` / ``down_proj`` in ``target_modules``; peft 0.21 moves
such names onto the routed experts' fused parameters whenever it injects a config on these model types, so peft's
``load_adapter`` on a ``load_qlora_model`` base and stock ``PeftModel.from_pretrained`` on the 16-bit base put LoRA
on the routed experts and dropped the dense-MLP and shared-expert LoRA (logits 0.7 off, only rank_pattern warnings).

Single process, real bitsandbytes 4-bit and real peft; tiny models built from the families' config classes
(tests/family_build.py); float32 so that equal means equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from family_build import build
from peft import LoraConfig
from tiny_models import sgd_step

from hf_fsdp_qlora import load_qlora_model

FAMILIES = ["glm4_moe", "deepseek_v3"]
IDS = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _lora_layers(model) -> set[str]:
    """The base model's modules holding a LoRA (linear layers and peft's parameter wrappers alike)."""
    base = model.get_base_model()
    return {n.replace(".base_layer", "") for n, m in base.named_modules() if hasattr(m, "lora_A") and m.lora_A}


@pytest.fixture(scope="module", params=[(f, e) for f in FAMILIES for e in (False, True)],
                ids=lambda p: f"{p[0]}-{'experts' if p[1] else 'linear'}")  # fmt: skip
def trained(request, tmp_path_factory):
    """All-linear LoRA (default dropout 0.05; with expert LoRA too: dropout 0) trained one SGD step on a 4-bit base
    and saved with peft's save_pretrained. Returns its base, adapter folder, trained logits and LoRA layers."""
    family, experts = request.param
    root = tmp_path_factory.mktemp(family)
    base = build(family, root / "base")
    extra = {"target_parameters": EXPERTS, "lora_dropout": 0.0} if experts else {}
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **extra)
    torch.manual_seed(0)
    model = load_qlora_model(str(base), lora_config=config, dtype=torch.float32, gradient_checkpointing=False)
    layers = _lora_layers(model)
    assert any(".mlp.gate_proj" in n for n in layers) and any("shared_experts" in n for n in layers)
    assert any(n.endswith("mlp.experts") for n in layers) == experts
    sgd_step(model, IDS)
    model.save_pretrained(root / "adapter")
    logits = _logits(model)
    with model.disable_adapter():
        assert (logits - _logits(model)).abs().max() > 1e-2  # the adapter moves the logits
    return SimpleNamespace(base=base, folder=root / "adapter", logits=logits, layers=layers, experts=experts,
                           model=model)  # fmt: skip


def test_load_qlora_model_adapter(trained):
    base, folder, logits, layers = trained.base, trained.folder, trained.logits, trained.layers
    model = load_qlora_model(str(base), adapter=str(folder), dtype=torch.float32, gradient_checkpointing=False,
                             is_trainable=False)  # fmt: skip
    assert _lora_layers(model) == layers
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=1e-6)


def test_our_save_path_writes_the_same_form(trained, tmp_path):
    """hf_fsdp_qlora's own save (the FSDP path's, here on one process) writes the targets peft's save_pretrained
    wrote, and the same tensors."""
    import json

    from safetensors.torch import load_file

    from hf_fsdp_qlora.train.checkpoint import save_adapter

    save_adapter(trained.model, tmp_path, is_main_process=True)
    ours, peft = (json.loads((f / "adapter_config.json").read_text()) for f in (tmp_path, trained.folder))
    keys = ("target_modules", "target_parameters", "lora_dropout", "r", "lora_alpha")
    assert {k: ours[k] for k in keys} == {k: peft[k] for k in keys}
    saved, written = (load_file(f / "adapter_model.safetensors") for f in (tmp_path, trained.folder))
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)


@pytest.mark.parametrize("first", [["o_proj"], "all-linear"])
def test_peft_load_adapter_on_a_load_qlora_model_base(trained, first):
    """Beside a first adapter (on o_proj, or all-linear: on the same layers). Before: the LoRA landed on the routed
    experts (logits 0.74 off on DeepSeek-V3; with expert LoRA, a size mismatch error)."""
    base, folder, logits, layers = trained.base, trained.folder, trained.logits, trained.layers
    model = load_qlora_model(str(base), dtype=torch.float32, gradient_checkpointing=False,
                             lora_config=LoraConfig(r=2, target_modules=first))  # fmt: skip
    model.load_adapter(str(folder), adapter_name="trained")
    model.set_adapter("trained")
    layers_trained = {n for n in _lora_layers(model) if "trained" in model.get_base_model().get_submodule(n).lora_A}
    assert {n.replace(".base_layer", "") for n in layers_trained} == layers
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_loaders_after_quantize_experts(trained, loader):
    """The 4-bit base built by hand (transformers' 4-bit load, then our quantize_experts), then peft's
    ``PeftModel.from_pretrained`` or transformers' ``load_adapter``. Before: the same silent loss as through peft's
    load_adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp_qlora.experts.quantized import quantize_experts

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(trained.base, quantization_config=quant, dtype=torch.float32)
    assert quantize_experts(base, dtype=torch.float32)
    if loader == "peft":
        model = PeftModel.from_pretrained(base, str(trained.folder))
        assert _lora_layers(model) == trained.layers
    else:
        base.load_adapter(str(trained.folder))
        model = base
        layers = {n.replace(".base_layer", "") for n, m in base.named_modules() if hasattr(m, "lora_A") and m.lora_A}
        assert layers == trained.layers
    torch.testing.assert_close(_logits(model), trained.logits, rtol=0, atol=1e-6)


def _merged_by_hand(base, folder) -> torch.nn.Module:
    """The 16-bit base with W += (alpha / r) B A written into each adapted linear layer (the oracle)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tensors = load_file(folder / "adapter_model.safetensors")
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                model.get_submodule(name).weight += scale * (b @ a)
    return model


def test_stock_peft_from_pretrained_on_the_16bit_base(trained, monkeypatch):
    """Stock peft (our loaders' hook on peft taken off): every tensor of the adapter lands where it was trained.
    Before: the dense-MLP and shared-expert tensors were dropped and LoRA built on the routed experts (logits 0.71
    off the trained model's on DeepSeek-V3, which ran on 4-bit weights)."""
    import inspect

    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(BaseTuner, "inject_adapter", inspect.unwrap(BaseTuner.inject_adapter))
    base, folder, layers = trained.base, trained.folder, trained.layers
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(folder))
    assert _lora_layers(model) == layers
    saved = load_file(folder / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    if not trained.experts:  # the oracle adds linear updates only
        torch.testing.assert_close(_logits(model), _logits(_merged_by_hand(base, folder)), rtol=0, atol=1e-5)


def test_merge_adapters_takes_the_saved_form(trained, tmp_path, monkeypatch):
    """merge-adapters reads the linear layers named in target_parameters (and the experts): the merged model equals
    peft's own merge of the stock reload on the 16-bit base, tensor by tensor, and the hand-made oracle."""
    import inspect

    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.merge import merge_adapters

    monkeypatch.setattr(BaseTuner, "inject_adapter", inspect.unwrap(BaseTuner.inject_adapter))
    base, folder = trained.base, trained.folder
    out = merge_adapters(base, folder, tmp_path / "merged", dtype="float32", progress=False)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(folder))
    oracle = stock.merge_and_unload().state_dict()
    assert merged.state_dict().keys() == oracle.keys()
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, oracle[key], rtol=0, atol=1e-6, msg=key)
    if not trained.experts:
        torch.testing.assert_close(_logits(merged), _logits(_merged_by_hand(base, folder)), rtol=0, atol=1e-5)


def test_scripts_all_linear_under_the_launcher(trained, monkeypatch, tmp_path):
    """trl's route (`-m hf_fsdp_qlora.run`, the script's own 4-bit from_pretrained and get_peft_model with
    `--lora_target_modules all-linear` and trl's default dropout 0.05): LoRA on the same layers as load_qlora_model,
    saved in the form stock peft reloads. Before: peft moved the dense and shared-expert targets onto the routed
    experts, where dropout 0.05 fails ("lora.ParamWrapper does not work with lora_dropout != 0")."""
    import json

    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

    from hf_fsdp_qlora.experts.lora import quantize_experts_before_peft
    from hf_fsdp_qlora.train.launcher import QUANTIZE_EXPERTS_ENV

    if trained.experts:
        pytest.skip("one adapter per family is enough here")
    monkeypatch.setattr(BaseTuner, "inject_adapter", BaseTuner.inject_adapter)  # the launcher's hooks, restored
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", PreTrainedModel.__dict__["from_pretrained"])
    quantize_experts_before_peft(QUANTIZE_EXPERTS_ENV)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(trained.base, quantization_config=quant, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear"))
    assert _lora_layers(model) == trained.layers
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    ours = json.loads((trained.folder / "adapter_config.json").read_text())
    keys = ("target_modules", "target_parameters", "lora_dropout")
    assert {k: saved[k] for k in keys} == {k: ours[k] for k in keys}
    assert any(p.endswith("shared_experts.gate_proj.weight") for p in saved["target_parameters"])
