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

Host RAM: with a local safetensors checkpoint the experts are not read by ``from_pretrained`` at all; they stream
from the files into 4 bits one layer at a time (:mod:`hf_fsdp_qlora.loading._expert_stream`). Otherwise each process
that loads the checkpoint holds the 16-bit experts on the CPU until they are packed (Qwen3-30B-A3B: ~58 GB).
"""

from __future__ import annotations

import logging

import torch

from .experts import expert_layout

__all__ = [
    "accelerator_device",
    "experts_device_map",
    "experts_on_cpu_kwargs",
    "release_experts_dispatch",
]

logger = logging.getLogger(__name__)


def accelerator_device() -> int | None:
    """The CUDA device bitsandbytes' quantizer loads onto (transformers' ``update_device_map``), None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _meta_model(config, dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def experts_device_map(model, device) -> dict:
    """A device map of `model` (meta is fine) with every experts module on ``"cpu"`` and everything else on `device`.

    No key is an ancestor of an experts module (nor ``""``): accelerate's dispatch hooks a non-offloaded key with
    ``place_submodules=True``, which would move the experts below it onto `device` 16-bit. So the modules on the way
    to the experts are split into their children; tensors held directly by such a module are keyed by name.
    """
    experts = {name for name, module in model.named_modules() if expert_layout(module) is not None}
    on_the_way = {name.rsplit(".", depth)[0] for name in experts for depth in range(1, name.count(".") + 1)}
    on_the_way |= {""} if experts else set()
    device_map = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if name in on_the_way:
            for local, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                device_map[f"{name}.{local}" if name else local] = device
        elif name and parent in on_the_way:
            device_map[name] = "cpu" if name in experts else device
    return device_map


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
    meta = _meta_model(config, dtype, trust_remote_code)
    device_map = experts_device_map(meta, device)
    if not device_map:
        return {}
    quantization_config = copy.deepcopy(quantization_config)
    quantization_config.llm_int8_enable_fp32_cpu_offload = True
    experts = sum(expert_layout(module) is not None for module in meta.modules())
    logger.info("hf_fsdp_qlora: %d experts modules load on the CPU (16-bit), the rest on %s", experts, device)
    return {"device_map": device_map, "quantization_config": quantization_config}


def _is_experts_map(model, device_map) -> bool:
    """The form :func:`experts_device_map` builds: experts modules on ``"cpu"``, everything else on one device."""
    cpu = [name for name, device in device_map.items() if device == "cpu"]
    if not cpu or len({device for device in device_map.values() if device != "cpu"}) > 1:
        return False
    modules = dict(model.named_modules())
    return all(name in modules and expert_layout(modules[name]) is not None for name in cpu)


def release_experts_dispatch(model) -> bool:
    """Undo the accelerate dispatch of a model loaded with :func:`experts_on_cpu_kwargs`; a no-op otherwise.

    Removes every accelerate hook (the offloaded experts' weights come back on the CPU, not meta), the ``model.to``
    warning wrappers and ``hf_device_map``, and resets ``llm_int8_enable_fp32_cpu_offload`` in the model's
    quantization config. Acts only when ``hf_device_map`` is of the form we build (:func:`experts_device_map`):
    experts modules on ``"cpu"``, everything else on one device; a user's own ``device_map`` is left alone.

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
    experts = [name for name, device in device_map.items() if device == "cpu"]
    stranded = [f"{e}.{n}" for e in experts for n, p in model.get_submodule(e).named_parameters() if p.is_meta]
    if stranded:  # a dispatch hook above the experts moved them before they were offloaded: their data is gone
        raise RuntimeError(f"hf_fsdp_qlora: expert weights left on the meta device after releasing the dispatch: "
                           f"{stranded[:3]}. Pass a device_map of your own to load_qlora_model (e.g. device_map="
                           "{'': torch.cuda.current_device()}: the experts then load 16-bit on the GPU) or "
                           "quantize_experts=False.")  # fmt: skip
    return True
