"""Loading a mixture-of-experts model onto a GPU without its 16-bit experts ever landing there whole.

bitsandbytes' 4-bit quantizer loads the whole model onto the rank's GPU (``device_map={"": current GPU}``), and it
only packs ``nn.Linear``: the fused 3-D experts (about 95% of an MoE model's weights) arrive 16-bit on the GPU and
:func:`~hf_fsdp_qlora.loading.experts.quantize_experts` packs them only afterwards. For Qwen3-30B-A3B that is ~58 GB
of 16-bit experts on each GPU before the first one is packed.

So on an accelerator, :func:`experts_on_cpu_kwargs` gives ``from_pretrained`` a device map that puts every experts
module on ``"cpu"`` and the rest on the GPU bitsandbytes would use (``llm_int8_enable_fp32_cpu_offload`` is what
transformers' bitsandbytes quantizer requires for a ``"cpu"`` entry; the experts hold no ``nn.Linear``, so it changes
what gets quantized by nothing). Such a map makes transformers dispatch the model with accelerate hooks: the CPU
modules' weights move to the meta device behind an offload hook, ``model.to`` is wrapped with a warning, and
``hf_device_map`` names two devices, which Trainer and accelerate read as model parallelism.
:func:`release_experts_dispatch` undoes exactly that (accelerate's own ``remove_hook_from_module`` puts the offloaded
weights back on the CPU) before :func:`quantize_experts` packs the experts expert by expert onto the GPU.

Host RAM: each process that loads the checkpoint holds the 16-bit experts on the CPU until they are packed
(Qwen3-30B-A3B: ~58 GB). With ``low_cpu_ram=True`` rank 0 reads the checkpoint and the other ranks receive the same
16-bit experts on their CPU (every rank quantizes its own experts), so each rank still holds them once.
"""

from __future__ import annotations

import logging

import torch

from .experts import expert_layout

__all__ = ["accelerator_device", "experts_module_names", "experts_on_cpu_kwargs", "release_experts_dispatch"]

logger = logging.getLogger(__name__)


def accelerator_device() -> int | None:
    """The CUDA device bitsandbytes' quantizer loads onto (transformers' ``update_device_map``), None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def experts_module_names(config, dtype, trust_remote_code: bool = False) -> list[str]:
    """The names of the experts modules :func:`quantize_experts` swaps, from a meta-device build of `config`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return [name for name, module in model.named_modules() if expert_layout(module) is not None]


def experts_on_cpu_kwargs(config, quantization_config, dtype, trust_remote_code=False, device=None) -> dict:
    """``from_pretrained`` kwargs that load every experts module on the CPU and the rest on `device`.

    Args:
        config: the model's config.
        quantization_config: the run's ``BitsAndBytesConfig`` (a copy with ``llm_int8_enable_fp32_cpu_offload``
            set is returned; the caller's is not changed).
        dtype: the model dtype.
        trust_remote_code: passed to transformers for the meta build.
        device: the GPU the rest goes to (default: :func:`accelerator_device`).

    Returns:
        ``{"device_map": ..., "quantization_config": ...}``, or ``{}`` when there is no GPU or no fused experts.
    """
    import copy

    device = accelerator_device() if device is None else device
    if device is None or quantization_config is None:
        return {}
    names = experts_module_names(config, dtype, trust_remote_code)
    if not names:
        return {}
    quantization_config = copy.deepcopy(quantization_config)
    quantization_config.llm_int8_enable_fp32_cpu_offload = True
    device_map = {"": device, **dict.fromkeys(names, "cpu")}
    logger.info("hf_fsdp_qlora: %d experts modules load on the CPU (16-bit), the rest on %s", len(names), device)
    return {"device_map": device_map, "quantization_config": quantization_config}


def _is_experts_map(model, device_map) -> bool:
    """The form :func:`experts_on_cpu_kwargs` builds: ``""`` on one device, every other key an experts module on CPU."""
    named = {name: device for name, device in device_map.items() if name}
    if "" not in device_map or not named or set(named.values()) != {"cpu"}:
        return False
    return all(expert_layout(model.get_submodule(name)) is not None for name in named)


def release_experts_dispatch(model) -> bool:
    """Undo the accelerate dispatch of a model loaded with :func:`experts_on_cpu_kwargs`; a no-op otherwise.

    Removes every accelerate hook (the offloaded experts' weights come back on the CPU, not meta), the ``model.to``
    warning wrappers and ``hf_device_map``, and resets ``llm_int8_enable_fp32_cpu_offload`` in the model's
    quantization config. Acts only when ``hf_device_map`` is of the form we build: experts modules on ``"cpu"``,
    everything else (``""``) on one device; a user's own ``device_map`` is left alone.

    Returns:
        True when it released a dispatch.
    """
    from accelerate.hooks import remove_hook_from_module

    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or not _is_experts_map(model, device_map):
        return False
    remove_hook_from_module(model, recurse=True)
    del model.hf_device_map
    for module in model.modules():
        # remove_hook_from_module leaves the class's forward bound on the instance (module.forward = _old_forward);
        # QuantizedExperts copies the experts' instance attributes, and would run the 16-bit forward through it.
        bound = module.__dict__.get("forward")
        if getattr(bound, "__func__", None) is type(module).forward and getattr(bound, "__self__", None) is module:
            del module.__dict__["forward"]
    for quant in (getattr(model.config, "quantization_config", None), getattr(model, "hf_quantizer", None)):
        quant = getattr(quant, "quantization_config", quant)
        if hasattr(quant, "llm_int8_enable_fp32_cpu_offload"):
            quant.llm_int8_enable_fp32_cpu_offload = False
    stranded = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if stranded:
        raise RuntimeError(f"hf_fsdp_qlora: parameters left on the meta device after releasing the dispatch: "
                           f"{stranded[:3]}")  # fmt: skip
    return True
