"""`load_qlora_model`: one dtype choice -> a consistent 4-bit (or 8-bit) base + LoRA model, ready for FSDP."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .._bnb_cpu import disable_cpu_repack_in_model
from ..cpu_rehearsal import enable_cpu_fsdp
from ..dtypes import harmonize_dtypes, keep_float32_compute, resolve_dtype, view_packed_storage_as
from ..errors import UnsupportedSetupError
from ..experts.layouts import EXPERT_WEIGHT_NAMES
from ..experts.placement import release_experts_dispatch
from ..experts.quantized import quantize_experts as quantize_expert_weights
from ..prequantized import quantized_bits, refuse_saved_quantized_experts
from ..towers import auto_class_for, concrete_class, keep_present_layer_classes
from ._adapter_steps import attach_adapter, continue_adapter, default_lora_config, freeze_for_kbit_training
from ._checkpoint import (
    check_causal_lm,
    check_checkpointing,
    config_has_fused_experts,
    load_config,
    prequantized_check,
)
from ._towers import refuse_low_ram_class, towers_of
from .family_targets import family_skip_modules, float32_linear_layers
from .int8 import convert_int8_layers, keep_int8_scales, modules_kept_16bit

__all__ = ["load_qlora_model", "default_lora_config"]

logger = logging.getLogger(__name__)

enable_cpu_fsdp()


@dataclass
class _Load:
    """One load as it passes through the steps of :func:`load_qlora_model`: the caller's settings, then what each
    step read, decided or built (each field says which step fills it)."""

    source: Any  # model_name_or_path
    dtype: torch.dtype
    bits: int
    quant_type: str  # _decide_quantization: a pre-quantized checkpoint's own
    double_quant: bool  # _decide_quantization: a pre-quantized checkpoint's own
    quantize_experts: bool
    trust_remote_code: bool
    from_pretrained_kwargs: dict  # _place_experts adds where the experts load
    config: Any = None  # _read_config
    prequantized: Any = None  # _read_checkpoint_quantization: the checkpoint's own 4-bit quantization, or None
    quantization_config: Any = None  # _decide_quantization, _place_experts: what from_pretrained quantizes with
    experts_device: Any = None  # _place_experts: the accelerator the experts are packed onto, one at a time
    placed: tuple = ()  # _place_experts: the from_pretrained kwargs that place the load on one device (ours or yours)
    streamed: Any = None  # _plan_expert_stream: the experts read from the files into 4 bits layer by layer, or None
    adapter: Any = None  # a saved adapter to continue from (_continue_adapter), or None: a new one (_attach_adapter)
    is_trainable: bool = True  # _continue_adapter: the loaded adapter trains (False: inference)
    skip_modules: tuple = ()  # layers kept 16-bit besides transformers' own (output head ...); the quantization record's
    model: Any = None  # _build_base; the PeftModel from _attach_adapter / _continue_adapter on
    adapter_dtype: Any = torch.float32  # the trainable tensors' dtype (the last step)
    model_class: Any = None  # _read_config: the (auto) class from_pretrained is called on
    lora_on_towers: bool = False  # attach_adapter: LoRA on a multimodal model's towers too (hf_fsdp_qlora.towers)


def load_qlora_model(
    model_name_or_path,
    *,
    dtype=torch.bfloat16,
    lora_config=None,
    quant_type: str = "nf4",
    double_quant: bool = True,
    gradient_checkpointing: bool | None = None,
    trust_remote_code: bool = False,
    low_cpu_ram: bool = False,
    quantize_experts: bool = True,
    bits: int = 4,
    adapter=None,
    is_trainable: bool = True,
    skip_modules=None,
    adapter_dtype=torch.float32,
    model_class=None,
    lora_on_towers: bool = False,
    **from_pretrained_kwargs,
):
    """Load a causal LM in 4 bits (or 8) and add LoRA adapters, with one dtype driving everything.

    ``bnb_4bit_quant_storage`` = ``bnb_4bit_compute_dtype`` = model dtype = `dtype`, and the trainable adapter
    tensors in `adapter_dtype` (float32 master weights, as stock peft), so every FSDP unit (FSDP1 FlatParameter or
    the trainable parameters of an FSDP2 group) holds one floating dtype and FSDP's
    mixed-precision param dtype can equal the storage dtype without touching the packed bytes. Norms
    stay in `dtype` (no fp32 upcast) and gradient checkpointing uses ``use_reentrant=False``.

    Args:
        model_name_or_path: a directory written by ``save_pretrained`` or a Hub model id.
        dtype: ``torch.bfloat16`` (default; A100/H100/L4), ``torch.float16`` (V100/T4) or ``torch.float32``.
        lora_config: a ``peft.LoraConfig``; default :func:`default_lora_config` (r=16 on all linear layers).
        quant_type: ``"nf4"`` (default) or ``"fp4"``.
        double_quant: quantize the quantization constants too (saves ~0.4 bit/parameter).
            A pre-quantized 4-bit checkpoint (saved after 4-bit loading, e.g. the shared ``*-bnb-4bit`` repos)
            keeps its own quant type and double quant; its packed bytes are viewed as `dtype`, never re-quantized.
            A pre-quantized MoE checkpoint's experts (16-bit: bitsandbytes packs only linear layers) are quantized
            with the checkpoint's quant type and double quant too.
        gradient_checkpointing: enable activation checkpointing in the model (turn it off when the
            accelerate config enables ``fsdp_activation_checkpointing`` instead). None (default): on where the model's
            class supports it, off (logged) in the few families whose transformers class does not (XLNet, OpenAI GPT,
            GPT-NeoX-Japanese); True on such a family is refused by name before any weight is read.
        trust_remote_code: passed to transformers.
        low_cpu_ram: under a multi-process launch, only rank 0 reads and quantizes the checkpoint; the other
            ranks receive its tensors and quant states (:mod:`hf_fsdp_qlora.loading.low_ram`). Collective: call on
            every rank. A single process loads normally.
        quantize_experts: quantize the fused 3-D expert weights of a mixture-of-experts model to 4 bits too
            (:mod:`hf_fsdp_qlora.experts.quantized`; bitsandbytes alone leaves them 16-bit). False keeps them 16-bit.
            They stream from a local safetensors checkpoint into 4 bits one layer at a time
            (:mod:`hf_fsdp_qlora.experts.stream`): host RAM per process holds at most one layer's 16-bit
            experts beside the 4-bit model, with or without `low_cpu_ram` (a checkpoint the stream cannot follow loads
            them all 16-bit first, with a log line). On a GPU the experts modules stay on the CPU and are packed
            onto the GPU (:mod:`hf_fsdp_qlora.experts.placement`; a pre-quantized checkpoint's too): the GPU never
            holds them 16-bit. The same with a `device_map` that puts the whole model on one device (``{"": d}``,
            ``"cuda:d"``, ``d``, ``"cpu"``, ``"auto"`` with one visible GPU); a map over several devices or module
            by module is left to transformers, and the experts load 16-bit first (with a log line).
        bits: 4 (default: NF4/FP4 QLoRA) or 8: bitsandbytes' row-wise int8 (``load_in_8bit``), each int8 layer held
            as :class:`~hf_fsdp_qlora.loading.int8.Int8Linear` so FSDP shards it (``quant_type``/``double_quant`` are
            4-bit settings and are not used). A checkpoint saved after 8-bit loading loads with ``bits=8``.
        adapter: a saved peft adapter (a folder written by ``save_pretrained`` or a Trainer checkpoint) to continue
            from instead of a new one: loaded with ``PeftModel.from_pretrained`` onto the quantized base, its expert
            LoRA onto the 4-bit experts (docs/moe.md). `lora_config` must then be None (the adapter's own applies).
        is_trainable: with `adapter`: its weights train (default; a second stage), or False for inference.
        skip_modules: names of linear layers to keep 16-bit (e.g. ``["down_proj"]``; transformers' rule: a suffix at a
            dot, or a regex), added to the layers transformers keeps 16-bit itself (the output head, tied weights).
            Not for a pre-quantized checkpoint (its own list applies). Merge with ``merge-adapters --skip-modules``.
        adapter_dtype: the dtype the trainable tensors (LoRA A/B, DoRA magnitudes) are kept and stepped in:
            ``torch.float32`` (default: small updates are not rounded away) or `dtype` (pure 16-bit adapters, half
            the adapter memory; see docs/dtypes.md).
        model_class: the class whose ``from_pretrained`` loads the model: default ``AutoModelForCausalLM`` where
            transformers maps the family there (Gemma 3/4 to their image-text class; Qwen3.5, Mllama, Llama 4 to their
            text-only classes), else ``AutoModelForImageTextToText``. Pass ``AutoModelForImageTextToText`` (or the
            class itself) to train Qwen3.5, Mllama or Llama 4 on images. A multimodal model's vision/audio towers and
            projectors stay in `dtype`, unquantized and frozen (docs/multimodal.md).
        lora_on_towers: ``"all-linear"`` (or a list of layer names) adapts the towers' linear layers too; default
            False: the language model only.
        **from_pretrained_kwargs: passed to ``from_pretrained`` (e.g. ``attn_implementation``).

    Returns:
        A ``peft.PeftModel`` ready for :class:`~hf_fsdp_qlora.FSDPQLoRATrainer`.

    Raises:
        FileNotFoundError: the path does not exist or holds no config.json.
        UnsupportedSetupError: not a causal LM; LoRA targets match nothing; ``load_in_8bit=`` passed (use ``bits=8``);
            a pre-quantized checkpoint that is not bitsandbytes, 8-bit under ``bits=4`` (or 4-bit under ``bits=8``),
            or whose packed bytes cannot be viewed as `dtype` (raised before any weight is read); an MoE family
            whose experts we cannot quantize (pass ``quantize_experts=False`` to keep them 16-bit knowingly); a
            checkpoint saved from a model with our 4-bit experts (their quantization constants are not saved).
    """
    load = _Load(
        source=model_name_or_path,
        dtype=resolve_dtype(dtype),
        bits=bits,
        quant_type=quant_type,
        double_quant=double_quant,
        quantize_experts=quantize_experts,
        trust_remote_code=trust_remote_code,
        from_pretrained_kwargs=dict(from_pretrained_kwargs),
        adapter=adapter,
        is_trainable=is_trainable,
        skip_modules=tuple(skip_modules or ()),
        adapter_dtype=resolve_dtype(adapter_dtype),
        model_class=model_class,
        lora_on_towers=lora_on_towers,
    )
    _check_arguments(load, lora_config)
    _read_config(load)
    refuse_low_ram_class(load.model_class, low_cpu_ram)
    check_checkpointing(load.config, gradient_checkpointing)
    _read_checkpoint_quantization(load)
    _refuse_8bit_experts(load)
    _decide_quantization(load)
    _place_experts(load)
    _plan_expert_stream(load)
    _build_base(load, low_cpu_ram)
    _view_packed_storage(load)
    keep_present_layer_classes(load.model)  # FSDP's transformer wrap refuses a listed class the model lacks
    _quantize_experts(load)
    disable_cpu_repack_in_model(load.model)
    freeze_for_kbit_training(load.model, gradient_checkpointing)
    attach_adapter(load, lora_config)
    continue_adapter(load)
    _convert_int8(load)
    _record_quantization(load)  # after every quantizing step; load.model is the PeftModel
    # One floating dtype among the frozen tensors (norms, heads) and one among the trainable ones (the adapters);
    # those transformers keeps in float32 are upcast for their module's forward, as the class computes them.
    keep_float32_compute(load.model, load.dtype)
    harmonize_dtypes(load.model, load.dtype, trainable_dtype=load.adapter_dtype)
    return load.model


# ---------------------------------------------------------------- the steps, in the order load_qlora_model runs them


def _check_arguments(load: _Load, lora_config) -> None:
    """Refuse settings the loader does not take, before anything is read."""
    if load.adapter is not None and lora_config is not None:
        raise UnsupportedSetupError(
            f"load_qlora_model got both adapter={load.adapter!r} and a lora_config: the saved adapter's own "
            "adapter_config.json decides its LoRA. Pass lora_config=None to continue from the adapter, or adapter=None "
            "to start a new one."
        )
    if load.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type={load.quant_type!r} is not supported: use 'nf4' (default) or 'fp4'.")
    if load.bits not in (4, 8):
        raise ValueError(
            f"bits={load.bits!r} is not supported: use 4 (NF4/FP4, the default) or 8 (bitsandbytes int8)."
        )
    if load.adapter_dtype not in (torch.float32, load.dtype):
        raise ValueError(
            f"adapter_dtype={load.adapter_dtype} is not supported with dtype={load.dtype}: use torch.float32 "
            f"(default: float32 master weights) or {load.dtype} (16-bit adapters)."
        )
    for key in ("load_in_8bit", "load_in_4bit", "quantization_config", "torch_dtype", "dtype"):
        if key in load.from_pretrained_kwargs:
            raise UnsupportedSetupError(
                f"load_qlora_model sets {key!r} itself from `bits` and `dtype`. Remove {key}=... and pass bits=4 "
                "(NF4, default) or bits=8 (int8), and dtype=torch.bfloat16 (or float16/float32) instead."
            )


def _read_config(load: _Load) -> None:
    """The checkpoint's config.json, refused unless it is a causal LM."""
    load.config = load_config(load.source, load.trust_remote_code)
    check_causal_lm(load.config)
    load.model_class = load.model_class or auto_class_for(load.config)


def _read_checkpoint_quantization(load: _Load) -> None:
    """The checkpoint's own quantization (if any), refused before any weight is read if the run cannot use it."""
    load.prequantized = prequantized_check(load.config, load.dtype, load.bits)
    refuse_saved_quantized_experts(load.source, set(EXPERT_WEIGHT_NAMES))


def _refuse_8bit_experts(load: _Load) -> None:
    """8-bit loading leaves fused MoE experts 16-bit: refused unless the caller opts out of quantizing them."""
    if load.bits == 8 and load.quantize_experts and config_has_fused_experts(load.config, load.trust_remote_code):
        raise UnsupportedSetupError(
            "bits=8 on a mixture-of-experts model: its fused expert weights are quantized in 4 bits only "
            "(hf_fsdp_qlora.experts.quantized) and bitsandbytes' 8-bit loading leaves them 16-bit. Pass "
            "quantize_experts=False to train with 16-bit experts knowingly, or bits=4."
        )


def _decide_quantization(load: _Load) -> None:
    """bitsandbytes' config for from_pretrained: storage dtype = compute dtype = `dtype` (one dtype per FSDP unit)."""
    from transformers import BitsAndBytesConfig

    if load.skip_modules and (load.prequantized is not None or quantized_bits(load.config) is not None):
        raise UnsupportedSetupError(
            f"skip_modules={list(load.skip_modules)} on a pre-quantized checkpoint: its layers were quantized when it "
            "was saved (its own llm_int8_skip_modules apply). Remove skip_modules, or load the 16-bit base with it."
        )
    if load.prequantized is not None:
        # transformers loads a pre-quantized checkpoint with its own quantization_config whatever is passed (and
        # warns; an explicit None would drop it): pass none, and make its storage dtype the run's dtype after loading.
        load.quantization_config = None
        # A stock 4-bit MoE checkpoint: its 16-bit experts take the checkpoint's own quantization.
        load.quant_type, load.double_quant = load.prequantized.quant_type, load.prequantized.double_quant
        logger.info(
            "hf_fsdp_qlora: pre-quantized checkpoint (%s, double quant %s, %s storage): its quantization is used "
            "(quant_type/double_quant ignored); packed bytes are viewed as %s, not re-quantized",
            load.prequantized.quant_type, load.prequantized.double_quant, load.prequantized.storage, load.dtype,
        )  # fmt: skip
    elif load.bits == 8:
        # A checkpoint saved after 8-bit loading brings its own quantization_config (and int8 weights + SCB).
        load.quantization_config = (
            None if quantized_bits(load.config) == 8 else BitsAndBytesConfig(load_in_8bit=True, **_skips(load))
        )
    else:
        load.quantization_config = BitsAndBytesConfig(
            **_skips(load),
            load_in_4bit=True,
            bnb_4bit_quant_type=load.quant_type,
            bnb_4bit_use_double_quant=load.double_quant,
            bnb_4bit_compute_dtype=load.dtype,
            bnb_4bit_quant_storage=load.dtype,
        )


def _skips(load: _Load) -> dict:
    """``llm_int8_skip_modules`` (used by 4-bit and 8-bit loading alike) for the caller's `skip_modules` and the
    family's own (layers its forward reads as a weight, or computes in float32: family_targets.py; a multimodal
    model's towers and projectors: hf_fsdp_qlora.towers), or nothing."""
    meta, towers = towers_of(load.config, load.model_class, load.dtype, load.trust_remote_code)
    own = (*family_skip_modules(load.config), *towers)  # towers: 16-bit, hf_fsdp_qlora.towers
    own += tuple(float32_linear_layers(meta, load.dtype))  # the class computes them in float32
    skip = (*load.skip_modules, *(m for m in own if m not in load.skip_modules))
    if not skip:
        return {}
    kept = modules_kept_16bit(load.config, skip, load.dtype, load.trust_remote_code, model=meta)
    return {"llm_int8_skip_modules": kept}


def _place_experts(load: _Load) -> None:
    """On a GPU the 16-bit experts load on the CPU and are packed one expert at a time onto the GPU (experts/placement.py),
    with no `device_map` or one of the caller's that puts the whole model on one device; the CPU keeps its load."""
    kwargs = load.from_pretrained_kwargs
    if not load.quantize_experts:
        return
    from transformers import PretrainedConfig

    from ..experts.placement import accelerator_device, experts_on_cpu_kwargs, one_device, placed_kwargs

    if "device_map" in kwargs:
        device, _ = one_device(kwargs["device_map"], kwargs.get("max_memory"))
        if device is None:  # several devices: from_pretrained places the experts (the stream plan says so)
            return
        load.placed = ("device_map",)  # one device: streamed as without a map
        load.experts_device = None if device == "cpu" else device
    else:
        load.experts_device = accelerator_device()
    if load.experts_device is None:
        return
    # A config of the caller's is what transformers loads with (a pre-quantized checkpoint's quantization included):
    # the placement's copy, which allows the experts on the CPU, is made of it.
    config = kwargs["config"] if isinstance(kwargs.get("config"), PretrainedConfig) else load.config
    placement = experts_on_cpu_kwargs(
        config, load.quantization_config, load.dtype, load.trust_remote_code, load.experts_device
    )
    if not placement:  # no fused experts: the caller's map, or none (bitsandbytes' own: the whole model on the GPU)
        return
    load.quantization_config = placement.pop("quantization_config", load.quantization_config)
    load.from_pretrained_kwargs = placed_kwargs(kwargs, placement)
    load.placed = tuple(placement)


def _plan_expert_stream(load: _Load) -> None:
    """Where the experts lie in a local safetensors checkpoint: they then go from the files into 4 bits one layer at
    a time (experts/stream.py), never all in 16 bits; otherwise (and with a log line saying why) as before."""
    if not load.quantize_experts or load.bits != 4:
        return
    from ..experts.stream import StreamedExperts, expert_stream_or_say_why

    user_kwargs = {k: v for k, v in load.from_pretrained_kwargs.items() if k not in load.placed}
    stream = expert_stream_or_say_why(load.source, load.config, load.dtype, load.trust_remote_code, user_kwargs)
    if stream is not None and stream.model_class is not concrete_class(load.model_class, load.config):
        logger.info("hf_fsdp_qlora: the experts load in 16 bits before they are packed: the stream follows %s's "
                    "modules, this load builds %s's", stream.model_class.__name__, load.model_class.__name__)  # fmt: skip
        stream = None
    if stream is not None:
        load.streamed = StreamedExperts(stream, load.quant_type, load.double_quant, load.dtype, load.experts_device)


def _build_base(load: _Load, low_cpu_ram: bool) -> None:
    """The quantized base model: from_pretrained, or read by rank 0 only and sent to the other ranks."""
    from ..experts.script_stream import script_loads_untouched
    from ..experts.stream import experts_left_unread

    # script_loads_untouched: the launcher's from_pretrained hook leaves this load (and its choices) to us.
    with experts_left_unread(load.streamed and load.streamed.stream) as hide_experts, script_loads_untouched():
        kwargs = {**load.from_pretrained_kwargs, **hide_experts}
        if low_cpu_ram:
            from .low_ram import load_base_low_ram

            load.model = load_base_low_ram(
                load.source,
                quantization_config=load.quantization_config,
                dtype=load.dtype,
                trust_remote_code=load.trust_remote_code,
                whole_experts=load.quantize_experts,
                prepare=keep_int8_scales if load.bits == 8 else None,  # the int8 row scales travel as buffers
                streamed=load.streamed,
                **kwargs,
            )
            return
        quant = {} if load.quantization_config is None else {"quantization_config": load.quantization_config}
        load.model = load.model_class.from_pretrained(
            load.source, **quant, dtype=load.dtype, trust_remote_code=load.trust_remote_code, **kwargs
        )
    release_experts_dispatch(load.model)


def _view_packed_storage(load: _Load) -> None:
    if load.prequantized is not None:
        # bitsandbytes reads packed weights back as bytes: a view changes no bit and gives FSDP one floating dtype.
        view_packed_storage_as(load.model, load.dtype)


def _quantize_experts(load: _Load) -> None:
    """Fused 3-D MoE expert weights in 4 bits too (bitsandbytes packs only linear layers)."""
    if load.streamed is not None:  # what low_cpu_ram's rank 0 has not packed already (a single process)
        load.streamed.quantize(load.model)
    elif load.quantize_experts and load.bits == 4:
        quantize_expert_weights(
            load.model,
            quant_type=load.quant_type,
            double_quant=load.double_quant,
            dtype=load.dtype,
            device=load.experts_device,
        )


def _convert_int8(load: _Load) -> None:
    if load.bits == 8:  # after peft, which wraps bitsandbytes' Linear8bitLt: its LoRA layers keep their own forward
        convert_int8_layers(load.model, load.dtype)


def _record_quantization(load: _Load) -> None:
    """What was quantized, kept on the model and written beside every adapter saved from it, for the merge."""
    from ..quant_record import attach_record, collect_record

    skip = getattr(load.quantization_config, "llm_int8_skip_modules", None)
    record = collect_record(
        load.model, bits=load.bits, quant_type=load.quant_type, double_quant=load.double_quant, skip_modules=skip
    )
    attach_record(load.model, record)
