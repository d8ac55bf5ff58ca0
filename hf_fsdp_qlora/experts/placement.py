"""Loading a mixture-of-experts model onto a GPU without its 16-bit experts ever landing there whole.

bitsandbytes' 4-bit quantizer loads the whole model onto the rank's GPU (``device_map={"": current GPU}``), and it
only packs ``nn.Linear``: the fused 3-D experts (about 95% of an MoE model's weights) arrive 16-bit on the GPU and
:func:`~hf_fsdp_qlora.experts.quantized.quantize_experts` packs them only afterwards. For Qwen3-30B-A3B that is ~58 GB
of 16-bit experts on each GPU before the first one is packed.

So on an accelerator, :func:`experts_on_cpu_kwargs` gives ``from_pretrained`` a device map that puts every experts
module on ``"cpu"`` and the rest on the GPU bitsandbytes would use (``llm_int8_enable_fp32_cpu_offload`` is what
transformers' bitsandbytes quantizer requires for a ``"cpu"`` entry; the experts hold no ``nn.Linear``, so it changes
what gets quantized by nothing). The flag goes in a copy of the quantization config transformers loads with: the
run's, or for a pre-quantized checkpoint (a stock 4-bit save) the checkpoint's own, inside a copy of its config
(:func:`placed_kwargs` merges it with the caller's kwargs). The GPU is the one bitsandbytes would pick without a map,
or the one device a caller's ``device_map`` names (:func:`one_device`; :func:`placement_kwargs`), in
``load_qlora_model`` and in trl's route (:mod:`~hf_fsdp_qlora.experts.script_stream`). Such a map makes
transformers dispatch the model with accelerate hooks: the CPU modules' weights move to the meta device behind an
offload hook, ``model.to`` is wrapped with a warning, and ``hf_device_map`` names two devices, which Trainer and
accelerate read as model parallelism.
:func:`release_experts_dispatch` undoes exactly that (accelerate's own ``remove_hook_from_module`` puts the offloaded
weights back on the CPU) before :func:`quantize_experts` packs the experts expert by expert onto the GPU.

Host RAM: with a local safetensors checkpoint the experts are not read by ``from_pretrained`` at all; they stream
from the files into 4 bits one layer at a time (:mod:`hf_fsdp_qlora.experts.stream`). Otherwise each process
that loads the checkpoint holds the 16-bit experts on the CPU until they are packed (Qwen3-30B-A3B: ~58 GB).
"""

from __future__ import annotations

import logging
import os

import torch

from .quantized import expert_layout

__all__ = [
    "accelerator_device",
    "experts_device_map",
    "experts_on_cpu_kwargs",
    "one_device",
    "placed_kwargs",
    "placement_kwargs",
    "release_experts_dispatch",
]

logger = logging.getLogger(__name__)

_OFFLOAD = "llm_int8_enable_fp32_cpu_offload"


def accelerator_device() -> int | None:
    """The CUDA device bitsandbytes' quantizer loads onto (transformers' ``update_device_map``), None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _meta_model(config, dtype, trust_remote_code: bool):
    from ..towers import auto_class_for, meta_model  # the class the loader builds (a text model saved alone: its own)

    return meta_model(config, auto_class_for(config), dtype, trust_remote_code)


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

    transformers' bitsandbytes quantizer accepts a ``"cpu"`` entry beside a GPU only with
    ``llm_int8_enable_fp32_cpu_offload``, read from the quantization config it loads with: the passed one, or for a
    pre-quantized checkpoint (a stock 4-bit save) always the checkpoint's own, taken from the config object
    ``from_pretrained`` gets (a passed ``BitsAndBytesConfig`` is ignored). So the flag is set in a copy of whichever
    applies; :func:`release_experts_dispatch` clears it after the load.

    Args:
        config: the model's config (with a ``quantization_config``: a pre-quantized checkpoint).
        quantization_config: the run's ``BitsAndBytesConfig``, or None for a pre-quantized checkpoint.
        dtype: the model dtype.
        trust_remote_code: passed to transformers for the meta build.
        device: the GPU the rest goes to (default: :func:`accelerator_device`).

    Returns:
        ``{"device_map": ..., "quantization_config": copy}``, or ``{"device_map": ..., "config": copy}`` for a
        pre-quantized checkpoint (merge into the caller's kwargs with :func:`placed_kwargs`), or ``{}`` when there is
        no GPU, no quantization or no fused experts.
    """
    import copy

    device = accelerator_device() if device is None else device
    saved = getattr(config, "quantization_config", None)
    if device is None or (quantization_config is None and saved is None):
        return {}
    meta = _meta_model(config, dtype, trust_remote_code)
    device_map = experts_device_map(meta, device)
    if not device_map:
        return {}
    if saved is not None:
        placement = {"device_map": device_map, "config": _config_allowing_offload(config)}
    else:
        quantization_config = copy.deepcopy(quantization_config)
        setattr(quantization_config, _OFFLOAD, True)
        placement = {"device_map": device_map, "quantization_config": quantization_config}
    experts = sum(expert_layout(module) is not None for module in meta.modules())
    logger.info("hf_fsdp_qlora: %d experts modules load on the CPU (16-bit), the rest on %s", experts, device)
    return placement


def _config_allowing_offload(config):
    """A copy of a pre-quantized checkpoint's `config` whose ``quantization_config`` (a dict as read from
    config.json, or a ``BitsAndBytesConfig``) allows modules on the CPU beside the GPU."""
    import copy

    config = copy.deepcopy(config)
    saved = config.quantization_config
    if isinstance(saved, dict):
        config.quantization_config = {**saved, _OFFLOAD: True}
    else:
        setattr(saved, _OFFLOAD, True)
    return config


# from_pretrained arguments the config also has as fields, that transformers never sets on the config.
_LOADING_ARGUMENTS = ("dtype", "torch_dtype", "quantization_config", "device_map", "attn_implementation")


def placed_kwargs(kwargs: dict, placement: dict) -> dict:
    """`kwargs` for ``from_pretrained`` with `placement` (:func:`experts_on_cpu_kwargs`) in them.

    Where the placement brings its own config, the kwargs naming one of the config's fields (``use_cache=False``)
    are set on it (a copy), as transformers does when it reads the config itself: given a config object, it passes
    them to the model's ``__init__`` instead, which takes none.
    """
    config = placement.get("config")
    if config is None:
        return {**kwargs, **placement}
    fields = set(config.to_dict()) - set(_LOADING_ARGUMENTS)
    for key in fields & set(kwargs):
        setattr(config, key, kwargs[key])
    return {**{k: v for k, v in kwargs.items() if k not in fields}, **placement}


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


SPREADING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate places the model by memory


def one_device(device_map, max_memory=None) -> tuple[str | int | None, str]:
    """The one device a ``from_pretrained(device_map=...)`` (a script's, or ``load_qlora_model``'s caller's) puts the
    whole model on: ``"cpu"`` or a CUDA index, and ``""``; or None and why not (several devices, a per-module map,
    another accelerator).

    None (no map) is what bitsandbytes' quantizer picks: the current CUDA device, else the CPU (on MPS too; XPU,
    NPU and HPU are another accelerator). ``{"": d}``, a device string, index or ``torch.device`` is `d`.
    ``"auto"`` and the other strategies place by memory over every visible device: one device only where a single
    CUDA device (or none, and no other accelerator) is visible.
    """
    if device_map is None:
        return _visible_device(None)
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            return None, f"device_map places modules one by one ({len(device_map)} entries)"
        device_map = device_map[""]
    elif isinstance(device_map, str) and device_map in SPREADING_MAPS:
        if max_memory is not None:
            return None, f"device_map={device_map!r} with max_memory places the model by memory"
        return _visible_device(device_map)
    return _named_device(device_map)


def _visible_device(strategy: str | None) -> tuple[str | int | None, str]:
    """Where no map (`strategy` None: the current CUDA device) or a placement strategy (the only visible CUDA
    device) puts the model: the CPU where no accelerator is visible."""
    if torch.cuda.is_available():
        if strategy is None:
            return torch.cuda.current_device(), ""
        count = torch.cuda.device_count()
        if count == 1:
            return 0, ""
        return None, f"device_map={strategy!r} spreads the model over the {count} visible GPUs"
    other = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    # A strategy places on any accelerator; bitsandbytes' quantizer loads a map-less model onto these (MPS: the CPU).
    if other is not None and (strategy is not None or other in ("xpu", "npu", "hpu")):
        return None, f"device_map={strategy!r} places the model on {other}: the experts stream onto the CPU or CUDA"
    return "cpu", ""


def _named_device(device) -> tuple[str | int | None, str]:
    """The device a ``device_map`` of one device names (an int is a CUDA index, as transformers reads it)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return (device, "") if device >= 0 else (None, f"device_map={device} is not a device")
    if device == "cuda":  # transformers reads a bare "cuda" as the process's LOCAL_RANK
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return None, f"device_map={device!r} is not a device"
    if device.type == "cpu":
        return "cpu", ""
    if device.type == "cuda":
        return (torch.cuda.current_device() if device.index is None else device.index), ""
    return None, f"device_map puts the model on {device}: the experts stream onto the CPU or CUDA"


def placement_kwargs(device, config, quantization_config, dtype, trust_remote_code: bool) -> tuple[dict, int | None]:
    """(the ``from_pretrained`` kwargs that place the load on `device`, the CUDA device the experts are packed onto
    or None): on CUDA the experts modules load on the CPU and the rest on `device` (:mod:`._experts_map`), as for
    ``load_qlora_model``; on the CPU everything."""
    if device == "cpu":
        return {"device_map": {"": "cpu"}}, None
    placement = experts_on_cpu_kwargs(config, quantization_config, dtype, trust_remote_code, device)
    return placement or {"device_map": {"": device}}, device
