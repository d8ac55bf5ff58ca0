"""Streamed experts for unchanged scripts under ``-m hf_fsdp_qlora.run`` (trl's ``sft.py --load_in_4bit --use_peft``).

Such a script loads its model itself: trl's ``SFTTrainer`` calls ``<Architecture>.from_pretrained(path,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...), dtype=..., device_map=None, ...)``. bitsandbytes packs
only linear layers, so that call materialises every fused expert weight 16-bit (Qwen3-30B-A3B: ~54 GiB per process)
before the launcher's peft hook (:func:`~hf_fsdp_qlora.loading.expert_lora.quantize_experts_before_peft`) packs them.

So the launcher also wraps ``PreTrainedModel.from_pretrained`` (once per process:
:func:`stream_experts_of_script_loads`). A 4-bit load of a local safetensors checkpoint with fused experts of a
family we quantize leaves the experts unread, exactly as ``load_qlora_model`` does
(:func:`~hf_fsdp_qlora.loading._expert_stream.experts_left_unread`), and before the call returns they stream from the
files into :class:`~hf_fsdp_qlora.loading.experts.QuantizedExperts` one layer at a time, with the quant type, double
quant and dtype the peft hook would have used (:func:`~hf_fsdp_qlora.loading.expert_lora.experts_quantization`).
Each rank streams its own (nothing is shared between ranks on this route). On a GPU, with no ``device_map`` of the
script's, the experts modules stay on the CPU and are packed onto the GPU, as in ``load_qlora_model``
(:mod:`~hf_fsdp_qlora.loading._experts_map`).

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

__all__ = ["script_loads_untouched", "stream_experts_of_script_loads"]

logger = logging.getLogger(__name__)

_untouched = contextvars.ContextVar("hf_fsdp_qlora_script_loads_untouched", default=False)


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
    """(stream, the model dtype, placement kwargs, the GPU the experts are packed onto) for a 4-bit load of an MoE
    checkpoint the stream can follow; None for any other load (the stream plan logs why where it cannot follow)."""
    from transformers import PretrainedConfig

    from ._checkpoint import config_has_fused_experts, load_config
    from ._expert_stream import expert_stream_or_say_why
    from ._experts_map import accelerator_device, experts_on_cpu_kwargs

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
    dtype = _model_dtype(kwargs.get("dtype"), config)
    given = {k: v for k, v in kwargs.items() if v is not None}  # trl passes device_map=None: no map
    stream = expert_stream_or_say_why(source, config, dtype, trust_remote_code, given)
    if stream is None:
        return None
    if stream.model_class is not cls:
        logger.info("hf_fsdp_qlora: the experts load in 16 bits before they are packed: the stream follows "
                    "%s's modules, this load builds %s", stream.model_class.__name__, cls.__name__)  # fmt: skip
        return None
    device = accelerator_device()  # no device_map of the script's here: the plan refuses one
    placement = experts_on_cpu_kwargs(config, quantization_config, dtype, trust_remote_code, device)
    return stream, placement, device if placement else None


def _model_dtype(dtype, config) -> torch.dtype:
    """The dtype ``from_pretrained`` builds the model in (only the plan's sizes depend on it)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    saved = getattr(config, "dtype", None)  # "auto" or none given: the checkpoint's
    return saved if isinstance(saved, torch.dtype) else torch.float32


def _load_streamed(from_pretrained, cls, source, kwargs: dict, stream, placement: dict, device):
    """transformers' load with the experts left unread, then the experts streamed into 4 bits layer by layer."""
    from ._expert_stream import StreamedExperts, experts_left_unread
    from ._experts_map import release_experts_dispatch
    from .expert_lora import experts_quantization

    logger.info("hf_fsdp_qlora: %s.from_pretrained leaves the experts of %d MoE layers unread (%d checkpoint "
                "tensors); they stream into 4 bits one layer at a time", cls.__name__, len(stream.modules),
                len(stream.entries))  # fmt: skip
    with experts_left_unread(stream) as hide_experts:
        loaded = from_pretrained(cls, source, **{**kwargs, **placement, **hide_experts})
    model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True: (model, info)
    release_experts_dispatch(model)
    StreamedExperts(stream, device=device, **experts_quantization(model)).quantize(model)
    return loaded
