"""The adapter-only vLLM sync's pieces that need no vLLM (hf_fsdp_qlora/train/vllm_sync.py); the whole GRPO run with
a colocated engine is tests/serving/test_grpo_vllm.py (the serving environment).

- the tensors a sync sends are peft's own adapter file, key for key and value for value;
- the base the engine is given is, weight for weight, what the 4-bit policy computes with (its dequantized NF4);
- what the sync cannot serve is refused before any step, naming the setting.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import build_tiny_model

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm_sync") / "llama", "llama", dtype=torch.float32)


def _peft(model_dir, quantized: bool, dtype=torch.float32, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, quantization_config=quant if quantized else None
    )
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **lora)
    return get_peft_model(base, config)


def test_adapter_tensors_are_peft_s_own_adapter_file(model_dir):
    from peft import get_peft_model_state_dict

    from hf_fsdp_qlora.train.vllm_sync import adapter_tensors

    model = _peft(model_dir, quantized=True)
    ours = dict(adapter_tensors(model))
    theirs = get_peft_model_state_dict(model)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 2 * len(TARGETS)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key


@pytest.mark.parametrize("load_dtype", [torch.float32, torch.bfloat16])
def test_engine_base_is_the_dequantized_4bit_base_the_policy_computes_with(model_dir, load_dtype):
    """Whatever dtype training loaded the checkpoint in (the 4-bit block maxima depend on it); the engine runs in
    the compute dtype (fp32)."""
    from bitsandbytes.functional import dequantize_4bit

    from hf_fsdp_qlora.quant_record import keep_live_record
    from hf_fsdp_qlora.train.vllm_sync import vllm_base_weights

    model = _peft(model_dir, quantized=True, dtype=load_dtype)
    record = keep_live_record(model)
    served = dict(vllm_base_weights(model_dir, record, torch.device("cpu"), torch.float32, load_dtype))
    base = model.get_base_model()
    checked = set()
    for name, module in base.named_modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit":
            key = ".".join(p for p in name.split(".") if p != "base_layer") + ".weight"
            assert torch.equal(served[key], dequantize_4bit(weight.data, weight.quant_state).float()), key
            checked.add(key)  # (a LoRA layer and its base_layer show the same weight)
    assert checked == set(record.linear) and checked
    norm = "model.norm.weight"  # not quantized: as stored
    assert torch.equal(served[norm], base.get_parameter(norm).detach().float())


def _trainer(model, **args):
    settings = {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False, "vllm_tensor_parallel_size": 1,
        **args,
    }  # fmt: skip
    fsdp_version = settings.pop("fsdp_version", None)
    plugin = SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version else None
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    return SimpleNamespace(args=SimpleNamespace(**settings), model=model, accelerator=accelerator)


@pytest.mark.parametrize(
    "args, lora, says",
    [
        ({"vllm_mode": "server"}, {}, 'Use vllm_mode="colocate"'),
        ({"fsdp_version": 1}, {}, "Use fsdp_version: 2"),
        ({"vllm_enable_sleep_mode": True}, {}, "vllm_enable_sleep_mode=True"),
        ({"vllm_tensor_parallel_size": 2}, {}, "vllm_tensor_parallel_size=2"),
        ({}, {"use_dora": True}, "Use use_dora=False"),
        ({}, {"modules_to_save": ["lm_head"]}, "no modules_to_save"),
    ],
)
def test_what_the_sync_cannot_serve_is_refused_naming_the_setting(model_dir, args, lora, says):
    from hf_fsdp_qlora.errors import UnsupportedSetupError
    from hf_fsdp_qlora.train.vllm_sync import prepare_adapter_sync

    model = _peft(model_dir, quantized=False, **lora)
    with pytest.raises(UnsupportedSetupError, match="adapter-only sync") as raised:
        prepare_adapter_sync(_trainer(model, **args))
    assert says in str(raised.value)


def test_marks_only_peft_models_that_generate_with_vllm(model_dir):
    from hf_fsdp_qlora.train.vllm_sync import _MARK, prepare_adapter_sync

    model = _peft(model_dir, quantized=False)
    assert prepare_adapter_sync(_trainer(model, use_vllm=False)) is False
    assert not getattr(model, _MARK, False)
    assert prepare_adapter_sync(_trainer(model, fsdp_version=2)) is True
    assert getattr(model, _MARK)
    assert prepare_adapter_sync(_trainer(model.get_base_model())) is False  # a full fine-tune: trl's own sync


def test_stock_trl_vllm_sync_merges_and_sends_every_weight():
    """Canary (_compat/trl.py, trl_vllm_adapter_sync): trl's colocated sync merges the adapter and walks every
    parameter, its engine has no LoRA, and its trainers look the class up as a module global. When this fails, trl
    changed (adapter-only sync, PR 6007): drop or adapt hf_fsdp_qlora/train/vllm_sync.py."""
    import inspect

    import trl.trainer.grpo_trainer as grpo
    import trl.trainer.rloo_trainer as rloo
    from trl.generation.vllm_generation import VLLMGeneration

    for trainer_module in (grpo, rloo):  # (ours, once a trainer of this process was marked: a subclass of trl's)
        assert issubclass(trainer_module.VLLMGeneration, VLLMGeneration), trainer_module.__name__
    assert "merge_adapter()" in inspect.getsource(VLLMGeneration._iter_named_params)
    init = inspect.getsource(VLLMGeneration._init_vllm)
    assert "enable_lora" not in init and 'quantization = "bitsandbytes"' in init
    assert "_iter_named_params()" in inspect.getsource(VLLMGeneration.sync_weights)
    assert "self.llm.generate(" in inspect.getsource(VLLMGeneration.generate)  # our engine adds the LoRARequest
