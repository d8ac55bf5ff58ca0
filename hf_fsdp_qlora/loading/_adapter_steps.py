"""The loader's adapter steps: freeze the base for k-bit training, attach new LoRA adapters, or continue from a saved
adapter (each a step of :func:`~hf_fsdp_qlora.loading.qlora.load_qlora_model`, reading and writing its ``load``)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import UnsupportedSetupError
from ..experts.lora import (
    check_target_modules,
    check_target_parameters,
    linear_layer_names,
    lora_config_for_mamba,
    peft_adapts_4bit_experts,
    peft_sees_expert_weights,
)
from ..experts.stock_reload import keep_adapter_keys, save_stock_form, stock_form
from ..experts.targets import keep_linear_targets, lora_config_for_experts
from ..towers import lora_config_for_towers
from ._checkpoint import check_checkpointing, supports_checkpointing
from .family_targets import lora_config_for_family

__all__ = [
    "attach_adapter",
    "continue_adapter",
    "default_lora_config",
    "enable_input_grads",
    "freeze_for_kbit_training",
]

logger = logging.getLogger("hf_fsdp_qlora.loading.qlora")  # the loader's log lines, under one name


def freeze_for_kbit_training(model, gradient_checkpointing: bool | None) -> None:
    # peft's prepare_model_for_kbit_training does this too, but it also upcasts every non-quantized
    # parameter (norms, embeddings) to fp32, which puts fp32 beside bf16 inside one FSDP1 unit.
    for param in model.parameters():
        param.requires_grad_(False)
    if gradient_checkpointing is None:  # not asked for: on where the class supports it
        gradient_checkpointing = supports_checkpointing(model)
        if not gradient_checkpointing:
            logger.info(
                "hf_fsdp_qlora: %s does not support activation checkpointing in transformers: loaded without it",
                type(model).__name__,
            )
    check_checkpointing(model.config, gradient_checkpointing, type(model))
    if gradient_checkpointing:
        # use_reentrant=False: the reentrant variant needs inputs that require grad and breaks with FSDP.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # One hook: transformers 5's gradient_checkpointing_enable registers it already, and a second registration
        # drops the first one's handle, so disable_input_require_grads (train/accelerator_setup.py) could not remove it.
        model.disable_input_require_grads()
        enable_input_grads(model)


def _input_requires_grad(module, args, output):
    """transformers' hook makes the frozen embedding's output a leaf that requires grad, which the model may not
    change in place (BLT and GIT add to it: "a leaf Variable that requires grad is being used in an in-place
    operation"). Adding a zero scalar that requires grad gives the same values as a tensor autograd tracks (no
    leaf: in-place ops are allowed), in place of the output rather than beside it (a clone would keep both alive
    until backward), and its gradient is one number, not one as large as the output."""
    import torch

    if not isinstance(output, torch.Tensor) or output.requires_grad or not output.is_floating_point():
        return None  # a trainable embedding's output needs nothing
    return output + torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)


def enable_input_grads(model) -> None:
    """``enable_input_require_grads`` with :func:`_input_requires_grad` as the hook, on the same modules (each
    input embedding once) and with the handles where ``disable_input_require_grads`` removes them."""
    from transformers import PreTrainedModel

    hooks, seen = [], set()
    for module in model.modules():
        if not (isinstance(module, PreTrainedModel) and hasattr(module, "get_input_embeddings")):
            continue
        try:
            embeddings = module.get_input_embeddings()
        except NotImplementedError:
            continue
        if embeddings is None or not hasattr(embeddings, "register_forward_hook") or id(embeddings) in seen:
            continue
        seen.add(id(embeddings))
        hooks.append(embeddings.register_forward_hook(_input_requires_grad))
    model._require_grads_hooks = hooks
    if hooks:
        model._require_grads_hook = hooks[0]  # the name transformers < 5 kept


# Public as hf_fsdp_qlora.loading.qlora.default_lora_config (load_qlora_model's default); defined here, below the
# loader, so that this step needs nothing from the module that calls it.
def default_lora_config(**overrides):
    """The LoRA config used when none is given: r=16, alpha=32, dropout 0.05, every linear layer."""
    from peft import LoraConfig

    kwargs = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def attach_adapter(load, lora_config) -> None:
    """peft's LoRA on the frozen base (and on 4-bit experts, through our wrappers: experts/lora.py)."""
    if load.adapter is not None:
        return  # _continue_adapter loads it
    if lora_config is None:
        lora_config = default_lora_config()
    lora_config = lora_config_for_experts(load.model, lora_config)  # "all-linear": the linear layers, in MoE too
    lora_config = lora_config_for_family(load.model, lora_config)  # not the layers its forward never runs
    lora_config = lora_config_for_mamba(load.model, lora_config)
    lora_config = lora_config_for_towers(load.model, lora_config, load.lora_on_towers)  # the language model only
    check_target_parameters(load.model, lora_config)
    form = stock_form(load.model, lora_config)  # the names of the base, before peft wraps its layers
    peft_adapts_4bit_experts()  # peft's later loaders (load_adapter) read what we save
    with peft_sees_expert_weights(load.model), keep_linear_targets(lora_config):
        load.model = _apply_lora(load.model, lora_config)
    save_stock_form(load.model.peft_config[load.model.active_adapter], form)


def _apply_lora(model, lora_config):
    from peft import get_peft_model

    check_target_modules(model, lora_config)
    # Before peft: afterwards its own layers (base_layer, lora_A, ...) are modules of the model too.
    linear = linear_layer_names(model)
    try:
        # autocast_adapter_dtype=False: peft would otherwise upcast the adapters to fp32.
        return get_peft_model(model, lora_config, autocast_adapter_dtype=False)
    except ValueError as err:
        if "not found in the base model" not in str(err) and "Target module" not in str(err):
            raise
        raise UnsupportedSetupError(
            f"LoRA target_modules={lora_config.target_modules!r} match no layer of this model that LoRA can adapt. "
            f"Set LoraConfig(target_modules=...) to some of its linear layers: {linear}, or 'all-linear'."
        ) from err


def continue_adapter(load) -> None:
    """A saved adapter through peft's own loader, its expert LoRA onto the 4-bit experts (experts/lora.py)."""
    if load.adapter is None:
        return
    from types import SimpleNamespace

    from peft import PeftModel

    from ..quant_record import RECORD_NAME

    # An adapter we saved names the linear layers as our loader chose them: peft must not remap them onto the
    # routed experts as if they were written for transformers 4 (keep_linear_targets, as when they were attached).
    ours = SimpleNamespace(hf_fsdp_qlora_linear_targets=(Path(load.adapter) / RECORD_NAME).is_file())
    peft_adapts_4bit_experts()  # target_parameters naming linear weights (stock_reload.py) go onto the layers
    # keep_adapter_keys: keys already in the model's names are not renamed as if from the original checkpoint.
    # A float32 adapter that trains on (what our trainer saves) is read into float32 LoRA layers, as the trainer
    # keeps them: built in the run's dtype first, its values would be rounded to bf16 before training resumed.
    # Otherwise the adapters keep the run's one dtype (harmonize_dtypes casts the rest).
    upcast = load.is_trainable and _saved_in_float32(Path(load.adapter))
    with peft_sees_expert_weights(load.model), keep_linear_targets(ours), keep_adapter_keys():
        load.model = PeftModel.from_pretrained(
            load.model, str(load.adapter), is_trainable=load.is_trainable, autocast_adapter_dtype=upcast
        )
    logger.info("hf_fsdp_qlora: continuing from the adapter %s (trainable: %s)", load.adapter, load.is_trainable)


def _saved_in_float32(folder: Path) -> bool:
    """Whether every floating-point tensor of the saved adapter (``adapter_model.safetensors``) is float32."""
    from ..safetensors_io import read_header

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        return False  # a .bin adapter: read as before, in the run's dtype
    entries, _ = read_header(path)
    floats = [e.dtype for e in entries.values() if e.dtype in ("F32", "BF16", "F16", "F64")]
    return bool(floats) and all(d == "F32" for d in floats)
