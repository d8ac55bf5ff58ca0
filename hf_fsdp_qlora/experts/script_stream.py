"""Streamed experts for unchanged scripts under ``-m hf_fsdp_qlora.run`` (trl's ``sft.py --load_in_4bit --use_peft``).

Such a script loads its model itself: trl's ``SFTTrainer`` calls ``<Architecture>.from_pretrained(path,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...), dtype=..., device_map=...)`` with ``device_map=None``
under a multi-GPU launch (accelerate's ``PartialState`` reads MULTI_GPU there, FSDP config or not) and on the CPU, and
``device_map="auto"`` in a single process on a GPU. bitsandbytes packs only linear layers, so that call materialises
every fused expert weight 16-bit (Qwen3-30B-A3B: ~54 GiB per process) before the launcher's peft hook
(:func:`~hf_fsdp_qlora.experts.lora.quantize_experts_before_peft`) packs them.

So the launcher also wraps ``PreTrainedModel.from_pretrained`` (once per process:
:func:`stream_experts_of_script_loads`). A 4-bit load of a local safetensors checkpoint with fused experts of a
family we quantize leaves the experts unread, exactly as ``load_qlora_model`` does
(:func:`~hf_fsdp_qlora.experts.stream.experts_left_unread`), and before the call returns they stream from the
files into :class:`~hf_fsdp_qlora.experts.quantized.QuantizedExperts` one layer at a time, with the quant type, double
quant and dtype the peft hook would have used (:func:`experts_quantization`).
Each rank streams its own (nothing is shared between ranks on this route).

Where they stream (:func:`~hf_fsdp_qlora.experts.placement.one_device`): a ``device_map`` that puts the whole
model on one device. On a CUDA GPU - ``device_map=None`` (the current GPU), ``{"": d}``, ``"cuda:d"``, ``d`` or
``torch.device("cuda", d)``, and ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"`` when exactly one
CUDA device is visible (device 0) - the experts modules load on the CPU and are packed onto that GPU, the rest loads on
it, as in ``load_qlora_model`` (:mod:`~hf_fsdp_qlora.experts.placement`). A pre-quantized checkpoint (a stock 4-bit
save: packed linear layers, 16-bit experts) does too, with the checkpoint's own quantization: transformers loads with
that one whatever the script passes, so the CPU offload the map needs is allowed in a copy of the config it gets. On
the CPU - no map or a strategy string with no accelerator visible, ``{"": "cpu"}``, ``"cpu"`` - everything loads
there. A map over several devices (a per-module dict, a strategy string with 2+ visible GPUs or with ``max_memory``)
or onto another accelerator loads as before, with one log line saying why.

Everything else goes to transformers untouched: another quantization, a dense model,
``HF_FSDP_QLORA_QUANTIZE_EXPERTS=0``, ``load_qlora_model``'s own loads (:func:`script_loads_untouched`), and an MoE
checkpoint the stream cannot follow (with one log line saying why); the peft hook then packs the 16-bit experts as
before.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from contextlib import contextmanager

import torch

__all__ = ["experts_quantization", "script_loads_untouched", "stream_experts_of_script_loads"]

logger = logging.getLogger(__name__)

_untouched = contextvars.ContextVar("hf_fsdp_qlora_script_loads_untouched", default=False)


def loads_untouched() -> bool:
    """Whether the current load is one of ``load_qlora_model``'s (within :func:`script_loads_untouched`)."""
    return _untouched.get()


@contextmanager
def script_loads_untouched():
    """Within: the launcher's ``from_pretrained`` hook passes every load straight to transformers (the loader's own
    loads: it hides and streams the experts itself, or keeps them 16-bit when asked)."""
    token = _untouched.set(True)
    try:
        yield
    finally:
        _untouched.reset(token)


def stream_experts_of_script_loads(settings: dict) -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` (once; later calls only replace `settings`): while
    ``settings["quantize"]`` (the launcher's HF_FSDP_QLORA_QUANTIZE_EXPERTS), a 4-bit load of an MoE checkpoint
    streams its experts into 4 bits instead of loading them 16-bit."""
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"].__func__
    if hasattr(current, "hf_fsdp_qlora_settings"):
        current.hf_fsdp_qlora_settings = settings
        return

    @functools.wraps(current)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        plan = None
        if from_pretrained.hf_fsdp_qlora_settings["quantize"] and not _untouched.get() and not model_args:
            plan = _plan(cls, pretrained_model_name_or_path, kwargs)
        if plan is None:
            return current(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return _load_streamed(current, cls, pretrained_model_name_or_path, kwargs, *plan)

    from_pretrained.hf_fsdp_qlora_settings = settings
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _plan(cls, source, kwargs: dict):
    """(stream, placement kwargs, the GPU the experts are packed onto or None) for a 4-bit load of an MoE checkpoint
    the stream can follow, onto one device; None for any other load (with a log line saying why, for an MoE load)."""
    from transformers import PretrainedConfig

    from ..model_config import load_config
    from .detect import config_has_fused_experts
    from .placement import one_device, placement_kwargs
    from .stream import expert_stream_or_say_why

    quantization_config = kwargs.get("quantization_config")
    if not getattr(quantization_config, "load_in_4bit", False):
        return None
    trust_remote_code = bool(kwargs.get("trust_remote_code"))
    config = kwargs.get("config")
    if not isinstance(config, PretrainedConfig):
        try:
            config = load_config(source, trust_remote_code)
        except Exception:  # noqa: BLE001 - transformers' own call below says what is wrong with the path
            return None
    if not config_has_fused_experts(config, trust_remote_code):
        return None
    device, why_not = one_device(kwargs.get("device_map"), kwargs.get("max_memory"))
    if device is None:
        logger.info("hf_fsdp_qlora: the experts load in 16 bits before they are packed: %s (the stream follows a "
                    "device_map that puts the model on one device, e.g. {'': 0})", why_not)  # fmt: skip
        return None
    dtype = _model_dtype(kwargs.get("dtype"), config)
    # trl passes device_map=None (no map); the script's map is resolved above and replaced by placement_kwargs'.
    given = {k: v for k, v in kwargs.items() if v is not None and k != "device_map"}
    stream = expert_stream_or_say_why(source, config, dtype, trust_remote_code, given)
    if stream is None:
        return None
    if stream.model_class is not cls:
        logger.info("hf_fsdp_qlora: the experts load in 16 bits before they are packed: the stream follows "
                    "%s's modules, this load builds %s", stream.model_class.__name__, cls.__name__)  # fmt: skip
        return None
    return stream, *placement_kwargs(device, config, quantization_config, dtype, trust_remote_code)


def _model_dtype(dtype, config) -> torch.dtype:
    """The dtype ``from_pretrained`` builds the model in (only the plan's sizes depend on it)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    saved = getattr(config, "dtype", None)  # "auto" or none given: the checkpoint's
    return saved if isinstance(saved, torch.dtype) else torch.float32


def experts_quantization(model: torch.nn.Module) -> dict:
    """How a script's 4-bit model gets its experts packed: its linear layers' quant type and double quant, and the
    one dtype the run's FSDP units will hold (the linear layers' packed bytes are viewed as it later)."""
    import types

    from ..dtypes import training_dtype

    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(quant, dict):
        quant = types.SimpleNamespace(**quant)
    return {
        "quant_type": getattr(quant, "bnb_4bit_quant_type", None) or "nf4",
        "double_quant": bool(getattr(quant, "bnb_4bit_use_double_quant", False)),
        "dtype": training_dtype(model),
    }


def _load_streamed(from_pretrained, cls, source, kwargs: dict, stream, placement: dict, device):
    """transformers' load with the experts left unread, then the experts streamed into 4 bits layer by layer."""
    from .placement import placed_kwargs, release_experts_dispatch
    from .stream import StreamedExperts, experts_left_unread

    logger.info("hf_fsdp_qlora: %s.from_pretrained leaves the experts of %d MoE layers unread (%d checkpoint "
                "tensors); they stream into 4 bits one layer at a time", cls.__name__, len(stream.modules),
                len(stream.entries))  # fmt: skip
    with experts_left_unread(stream) as hide_experts:
        loaded = from_pretrained(cls, source, **{**placed_kwargs(kwargs, placement), **hide_experts})
    model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True: (model, info)
    release_experts_dispatch(model)
    StreamedExperts(stream, device=device, **experts_quantization(model)).quantize(model)
    return loaded
