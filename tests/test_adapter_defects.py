"""Issue 35, defects 4-7: expert adapters loaded back, the experts' dtype casts, the int8 skip list, the target error.

Single process, tiny models built locally (tests/tiny_models.py): a Qwen3-MoE (fused 3-D experts) and Llamas. Each
test asserts first what failed before its fix (the failure is in the test's docstring).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from tiny_models import build_tiny_model, sgd_step, tiny_config

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.errors import UnsupportedSetupError
from hf_fsdp_qlora.experts.quantized import QuantizedExperts

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
IDS = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _lora(**kw):
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj"], **kw})


@pytest.fixture(scope="module")
def moe(shared_models):
    return build_tiny_model(shared_models / "qwen3_moe", "qwen3_moe")


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _expert_lora(model):
    return {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_" in n}


# ---------------------------------------------------------------- 4: an expert adapter loaded back onto 4-bit experts


@pytest.fixture(scope="module")
def trained_expert_adapter(moe, tmp_path_factory):
    """An adapter on q_proj and the 4-bit experts, random (init_lora_weights=False) and one SGD step further; saved.
    Returns (its folder, the trained model's logits, the logits without the adapter)."""
    config = _lora(target_parameters=EXPERT_TARGETS, init_lora_weights=False)
    torch.manual_seed(0)
    model = load_qlora_model(str(moe), lora_config=config, dtype=torch.float32, gradient_checkpointing=False)
    assert len(_expert_lora(model)) == 8  # 2 layers x 2 weights x (lora_A, lora_B)
    sgd_step(model, IDS)
    folder = tmp_path_factory.mktemp("expert_adapter")
    model.save_pretrained(folder)
    logits = _logits(model)
    with model.disable_adapter():
        plain = _logits(model)
    assert (logits - plain).abs().max() > 1e-2  # the adapter (its expert part included) moves the logits
    return folder, logits, plain


def test_peft_load_adapter_onto_4bit_experts(moe, trained_expert_adapter):
    """Before: peft warned "target_parameters ... no parameter was matched" and ran without the expert weights
    (logits 0.25-0.36 away from the trained model's)."""
    folder, logits, _ = trained_expert_adapter
    model = load_qlora_model(str(moe), lora_config=_lora(), dtype=torch.float32, gradient_checkpointing=False)
    model.load_adapter(str(folder), adapter_name="trained")
    model.set_adapter("trained")
    assert sum(".trained." in n for n in _expert_lora(model)) == 8
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=1e-6)


def test_peft_from_pretrained_after_quantize_experts(moe, trained_expert_adapter):
    """Before: the same silent loss through ``PeftModel.from_pretrained`` on a model quantized by hand."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp_qlora.experts.quantized import quantize_experts

    folder, logits, _ = trained_expert_adapter
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(str(moe), quantization_config=quant, dtype=torch.float32)
    assert quantize_experts(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder)
    assert len(_expert_lora(model)) == 8
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=1e-6)


def test_load_qlora_model_continues_from_an_adapter(moe, trained_expert_adapter):
    """Before: ``load_qlora_model`` took no adapter (``adapter=`` went to from_pretrained and failed)."""
    from peft import PeftModel

    folder, logits, _ = trained_expert_adapter
    model = load_qlora_model(str(moe), adapter=folder, dtype=torch.float32, gradient_checkpointing=False)
    assert isinstance(model, PeftModel)
    assert all(
        isinstance(m, QuantizedExperts) for n, m in model.named_modules() if n.endswith("base_layer.base_layer")
    )
    experts = _expert_lora(model)
    assert len(experts) == 8 and all(p.requires_grad for p in experts.values())
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=1e-6)
    # A second stage trains it: every expert LoRA tensor gets a gradient.
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.values())
    # Inference, and the bf16 run's one dtype.
    frozen = load_qlora_model(str(moe), adapter=folder, is_trainable=False, gradient_checkpointing=False)
    assert not any(p.requires_grad for p in frozen.parameters())
    assert {p.dtype for p in _expert_lora(frozen).values()} == {torch.bfloat16}
    with pytest.raises(UnsupportedSetupError, match="both adapter=.* and a lora_config"):
        load_qlora_model(str(moe), adapter=folder, lora_config=_lora())


def test_a_float32_adapter_continues_unrounded_in_a_bf16_run(moe, trained_expert_adapter):
    """What our trainer saves (float32 LoRA) trains on in a bf16 run with its saved values. Before: peft built the
    LoRA layers in bf16 first (autocast_adapter_dtype=False) and every value was rounded to bf16 before the trainer
    upcast them again (lora_A off by up to 2**-9 relative)."""
    from safetensors.torch import load_file

    folder, _, _ = trained_expert_adapter
    saved = load_file(f"{folder}/adapter_model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in saved.values())  # rounding would show
    model = load_qlora_model(str(moe), adapter=folder, dtype=torch.bfloat16, gradient_checkpointing=False)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == len(saved) and {p.dtype for p in lora.values()} == {torch.float32}
    by_key = {n.replace(".default", ""): p for n, p in lora.items()}
    assert [k for k, t in saved.items() if not torch.equal(by_key[k], t)] == []


def test_unmatched_expert_targets_of_a_saved_adapter_are_an_error(moe, trained_expert_adapter, tmp_path):
    """An adapter whose target_parameters match no weight of the 4-bit model is refused, not dropped with a warning."""
    import json
    import shutil

    folder = tmp_path / "renamed"
    shutil.copytree(trained_expert_adapter[0], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.w1"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedSetupError, match="'mlp.experts.w1' matches no parameter"):
        load_qlora_model(str(moe), adapter=folder, gradient_checkpointing=False)


# ---------------------------------------------------------------- 5: the launcher's experts hook, common bnb settings


@pytest.mark.parametrize(
    ("model_dtype", "compute", "experts_dtype"),
    [(torch.bfloat16, None, torch.float32), (torch.float32, torch.bfloat16, torch.bfloat16)],
    ids=["bf16-model-default-compute", "fp32-model-bf16-compute"],
)
def test_launcher_hook_casts_as_linear4bit(moe, model_dtype, compute, experts_dtype):
    """Before: ``expected m1 and m2 to have the same dtype`` in the first forward (the experts never cast)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp_qlora.experts.lora import _quantize_experts_of_4bit_model

    quant = BitsAndBytesConfig(load_in_4bit=True, **({"bnb_4bit_compute_dtype": compute} if compute else {}))
    base = AutoModelForCausalLM.from_pretrained(str(moe), quantization_config=quant, dtype=model_dtype)
    _quantize_experts_of_4bit_model(base, "HF_FSDP_QLORA_QUANTIZE_EXPERTS")
    experts = [m for m in base.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == 2 and {e.dtype for e in experts} == {experts_dtype}
    # One experts module: input and output in the model's dtype, computed in the experts' dtype (as Linear4bit).
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(model_dtype)
    index = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [1, 6]])
    weights = torch.full((6, 2), 0.5, dtype=model_dtype)
    with torch.no_grad():
        out = experts[0](hidden, index, weights)
        computed = experts[0](hidden.to(experts_dtype), index, weights)
    assert out.dtype == model_dtype and computed.dtype == experts_dtype
    torch.testing.assert_close(out, computed.to(model_dtype), rtol=0, atol=0)
    # The whole model, with LoRA on the experts: a forward and a backward.
    model = get_peft_model(base, _lora(target_parameters=EXPERT_TARGETS, init_lora_weights=False))
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in _expert_lora(model).values()]
    assert len(grads) == 8 and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ---------------------------------------------------------------- 6: the int8 skip list


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """A tiny Llama whose down_proj has in_features=129: its int8 rows fit no 2-byte dtype."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("odd_llama")
    config = tiny_config("llama")
    config.intermediate_size = 129
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16).save_pretrained(path)
    return path


def _modules(model, suffix):
    return [m for n, m in model.named_modules() if n.endswith(suffix)]


def test_int8_skip_modules_keep_transformers_defaults(odd_llama):
    """Before: the error named ``BitsAndBytesConfig(llm_int8_skip_modules=...)``, which load_qlora_model refuses;
    ``skip_modules=`` did not exist."""
    from hf_fsdp_qlora.loading.int8 import Int8Linear

    config = _lora(target_modules=["q_proj", "down_proj"])
    with pytest.raises(UnsupportedSetupError, match=r"in_features=129.*load_qlora_model\(path, bits=8, skip_modules="):
        load_qlora_model(odd_llama, bits=8, lora_config=config, gradient_checkpointing=False)
    model = load_qlora_model(
        odd_llama, bits=8, lora_config=config, skip_modules=["down_proj"], gradient_checkpointing=False
    )
    assert all(type(m) is torch.nn.Linear for m in _modules(model, "down_proj.base_layer"))
    assert all(type(m) is Int8Linear for m in _modules(model, "q_proj.base_layer"))
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # transformers' own skip kept
    assert torch.isfinite(model(input_ids=IDS).logits).all()


def test_merge_int8_honours_skip_modules(odd_llama, tmp_path):
    """Before: ``merge --dequantize int8`` round-tripped every linear layer (no ``--skip-modules``)."""
    from safetensors.torch import load_file

    from hf_fsdp_qlora.cli.main import main as cli_main
    from hf_fsdp_qlora.merge import merge_adapters

    config = _lora(target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    model = load_qlora_model(
        odd_llama, bits=8, lora_config=config, skip_modules=["down_proj"], gradient_checkpointing=False
    )
    model.save_pretrained(tmp_path / "adapter")
    adapter = tmp_path / "adapter"
    from hf_fsdp_qlora.quant_record import RECORD_NAME

    # Our saved adapter carries the quantization record: `--dequantize int8` alone follows it (down_proj kept).
    merge_adapters(odd_llama, adapter, tmp_path / "recorded", dequantize="int8", progress=False)
    (adapter / RECORD_NAME).unlink()  # as a stock peft adapter: no record, transformers' rule + --skip-modules
    merge_adapters(odd_llama, adapter, tmp_path / "plain", progress=False)
    merge_adapters(odd_llama, adapter, tmp_path / "int8", dequantize="int8", progress=False)
    argv = ["merge", "--base", str(odd_llama), "--adapter", str(adapter), "--output", str(tmp_path / "skip")]
    assert cli_main([*argv, "--dequantize", "int8", "--skip-modules", "down_proj", "--no-progress"]) == 0
    found = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("plain", "int8", "skip", "recorded"))
    plain, int8, skip, recorded = found
    assert recorded.keys() == skip.keys() and all(torch.equal(recorded[k], skip[k]) for k in skip)
    base = load_file(str(odd_llama / "model.safetensors"))
    down = [k for k in skip if k.endswith("down_proj.weight")]
    assert len(down) == 2 and all(torch.equal(skip[k], plain[k]) and not torch.equal(skip[k], int8[k]) for k in down)
    for key in [k for k in skip if k.endswith(("q_proj.weight", "k_proj.weight"))]:
        assert torch.equal(skip[key], int8[key]) and not torch.equal(skip[key], plain[key]), key
    assert torch.equal(skip["lm_head.weight"], base["lm_head.weight"])
    with pytest.raises(Exception, match="only applies with `dequantize`"):
        merge_adapters(odd_llama, adapter, tmp_path / "bad", skip_modules=["down_proj"], progress=False)


# ---------------------------------------------------------------- 7: the target error


def test_experts_in_target_modules_names_target_parameters(moe):
    """Before: "match no layer of this model", listing peft's ``base_layer`` and ``default`` as layers."""
    with pytest.raises(UnsupportedSetupError) as err:
        load_qlora_model(str(moe), lora_config=_lora(target_modules=["q_proj", "experts"]))
    text = str(err.value)
    assert "target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']" in text, text
    assert "--lora_target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj" in text
    assert "'base_layer'" not in text and "'default'" not in text and "'q_proj'" in text


def test_no_layer_error_lists_real_layers(shared_models):
    """Before: a target peft cannot adapt beside one it can (q_proj wrapped first) listed ``base_layer``/``default``."""
    llama = build_tiny_model(shared_models / "llama", "llama")
    with pytest.raises(UnsupportedSetupError, match="match no layer") as err:
        load_qlora_model(str(llama), lora_config=_lora(target_modules=["q_proj", "input_layernorm"]))
    text = str(err.value)
    assert "'base_layer'" not in text and "'default'" not in text, text
    for name in ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"):
        assert f"'{name}'" in text, (name, text)
