"""`load_qlora_model`: one dtype choice -> a consistent 4-bit (or 8-bit) base + LoRA model, ready for FSDP."""

from __future__ import annotations

import logging
import os

import torch

from .._bnb_cpu import disable_cpu_repack_in_model
from ..causal_lm import causal_lm_problem
from ..cpu_rehearsal import enable_cpu_fsdp
from ..dtypes import harmonize_dtypes, resolve_dtype, view_packed_storage_as
from ..errors import UnsupportedSetupError
from ..prequantized import (
    checkpoint_quantization,
    quantized_bits,
    refuse_saved_quantized_experts,
    refuse_unviewable_storage,
)
from ._experts_map import release_experts_dispatch
from .expert_lora import check_target_parameters, peft_sees_expert_weights
from .experts import EXPERT_LAYOUTS, has_fused_experts, lora_config_for_experts
from .experts import quantize_experts as quantize_expert_weights
from .int8 import convert_int8_layers, keep_int8_scales

__all__ = ["load_qlora_model", "default_lora_config"]

logger = logging.getLogger(__name__)

enable_cpu_fsdp()


def default_lora_config(**overrides):
    """The LoRA config used when none is given: r=16, alpha=32, dropout 0.05, every linear layer."""
    from peft import LoraConfig

    kwargs = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def _load_config(model_name_or_path, trust_remote_code: bool):
    from transformers import AutoConfig

    path = os.fspath(model_name_or_path)
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
    if looks_local:
        local = os.path.expanduser(path)
        if not os.path.isdir(local):
            raise FileNotFoundError(
                f"Model path {path!r} does not exist. Pass the directory written by save_pretrained (it holds "
                "config.json and *.safetensors) or a model id on the Hugging Face Hub."
            )
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(
                f"{path!r} has no config.json, so it is not a saved transformers model. Pass the directory "
                "written by model.save_pretrained(...)."
            )
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise FileNotFoundError(f"Could not read a model config from {path!r}: {err}") from err


def _check_causal_lm(config) -> None:
    kind = causal_lm_problem(config)
    if kind is not None:
        raise UnsupportedSetupError(
            f"The model at this path is {kind}, which has no causal-LM head, so load_qlora_model cannot fine-tune "
            "it for text generation. Pass a causal language model (e.g. a Llama, Qwen2 or Mistral checkpoint)."
        )


def _prequantized_check(config, dtype: torch.dtype, bits: int):
    """The checkpoint's own 4-bit quantization, refused before any weight is read if the run cannot use it."""
    saved_bits = quantized_bits(config)
    if bits == 8:
        if saved_bits == 4:
            raise UnsupportedSetupError(
                "bits=8 was asked for, but this checkpoint is pre-quantized in 4 bits (its config.json has "
                "quantization_config.load_in_4bit=true): its 4-bit weights cannot be turned back into 8 bits. Pass "
                "bits=4 to train it as it is, or load the original 16-bit checkpoint with bits=8."
            )
        checkpoint_quantization(config, allow_8bit=True)  # other methods are refused; a saved 8-bit base loads
        return None
    quant = checkpoint_quantization(config)
    if quant is not None and quant.storage != str(dtype).removeprefix("torch."):
        from ..errors import SetupInputError
        from ..model_shapes import model_shape  # the config's shapes, built on the meta device

        try:
            weights = {lin.name: lin.numel for lin in model_shape(config).linears if lin.quantized}
        except SetupInputError:  # no meta build from this config (remote code): from_pretrained will tell
            return quant
        refuse_unviewable_storage(quant, str(dtype), weights)
    return quant


def _freeze_for_kbit_training(model, gradient_checkpointing: bool) -> None:
    # peft's prepare_model_for_kbit_training does this too, but it also upcasts every non-quantized
    # parameter (norms, embeddings) to fp32, which puts fp32 beside bf16 inside one FSDP1 unit.
    for param in model.parameters():
        param.requires_grad_(False)
    if gradient_checkpointing:
        # use_reentrant=False: the reentrant variant needs inputs that require grad and breaks with FSDP.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()


def _apply_lora(model, lora_config):
    from peft import get_peft_model

    try:
        # autocast_adapter_dtype=False: peft would otherwise upcast the adapters to fp32.
        return get_peft_model(model, lora_config, autocast_adapter_dtype=False)
    except ValueError as err:
        if "not found in the base model" not in str(err) and "Target module" not in str(err):
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if "Linear" in type(m).__name__})
        raise UnsupportedSetupError(
            f"LoRA target_modules={lora_config.target_modules!r} match no layer of this model. Set "
            f"LoraConfig(target_modules=...) to some of its linear layers: {linear}, or 'all-linear'."
        ) from err


def load_qlora_model(
    model_name_or_path,
    *,
    dtype=torch.bfloat16,
    lora_config=None,
    quant_type: str = "nf4",
    double_quant: bool = True,
    gradient_checkpointing: bool = True,
    trust_remote_code: bool = False,
    low_cpu_ram: bool = False,
    quantize_experts: bool = True,
    bits: int = 4,
    **from_pretrained_kwargs,
):
    """Load a causal LM in 4 bits (or 8) and add LoRA adapters, with one dtype driving everything.

    ``bnb_4bit_quant_storage`` = ``bnb_4bit_compute_dtype`` = model dtype = adapter dtype = `dtype`, so
    every FSDP unit (FSDP1 FlatParameter or FSDP2 group) holds one floating dtype and FSDP's
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
            accelerate config enables ``fsdp_activation_checkpointing`` instead).
        trust_remote_code: passed to transformers.
        low_cpu_ram: under a multi-process launch, only rank 0 reads and quantizes the checkpoint; the other
            ranks receive its tensors and quant states (:mod:`hf_fsdp_qlora.loading.low_ram`). Collective: call on
            every rank. A single process loads normally.
        quantize_experts: quantize the fused 3-D expert weights of a mixture-of-experts model to 4 bits too
            (:mod:`hf_fsdp_qlora.loading.experts`; bitsandbytes alone leaves them 16-bit). False keeps them 16-bit.
            On a GPU (and without a `device_map` of yours) the 16-bit experts load on the CPU and are packed onto the
            GPU one expert weight at a time (:mod:`hf_fsdp_qlora.loading._experts_map`): the GPU never holds them
            16-bit; host RAM holds them until packed.
        bits: 4 (default: NF4/FP4 QLoRA) or 8: bitsandbytes' row-wise int8 (``load_in_8bit``), each int8 layer held
            as :class:`~hf_fsdp_qlora.loading.int8.Int8Linear` so FSDP shards it (``quant_type``/``double_quant`` are
            4-bit settings and are not used). A checkpoint saved after 8-bit loading loads with ``bits=8``.
        **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).

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
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = resolve_dtype(dtype)
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type={quant_type!r} is not supported: use 'nf4' (default) or 'fp4'.")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r} is not supported: use 4 (NF4/FP4, the default) or 8 (bitsandbytes int8).")
    for key in ("load_in_8bit", "load_in_4bit", "quantization_config", "torch_dtype", "dtype"):
        if key in from_pretrained_kwargs:
            raise UnsupportedSetupError(
                f"load_qlora_model sets {key!r} itself from `bits` and `dtype`. Remove {key}=... and pass bits=4 "
                "(NF4, default) or bits=8 (int8), and dtype=torch.bfloat16 (or float16/float32) instead."
            )
    config = _load_config(model_name_or_path, trust_remote_code)
    _check_causal_lm(config)

    prequantized = _prequantized_check(config, dtype, bits)
    refuse_saved_quantized_experts(model_name_or_path, {w for lay in EXPERT_LAYOUTS.values() for w in lay.weights})
    if bits == 8 and quantize_experts and _has_fused_experts(config, trust_remote_code):
        raise UnsupportedSetupError(
            "bits=8 on a mixture-of-experts model: its fused expert weights are quantized in 4 bits only "
            "(hf_fsdp_qlora.loading.experts) and bitsandbytes' 8-bit loading leaves them 16-bit. Pass "
            "quantize_experts=False to train with 16-bit experts knowingly, or bits=4."
        )
    quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )
    if bits == 8:
        # A checkpoint saved after 8-bit loading brings its own quantization_config (and int8 weights + SCB).
        quantization_config = None if quantized_bits(config) == 8 else BitsAndBytesConfig(load_in_8bit=True)
    if prequantized is not None:
        # transformers loads a pre-quantized checkpoint with its own quantization_config whatever is passed (and
        # warns; an explicit None would drop it): pass none, and make its storage dtype the run's dtype after loading.
        quantization_config = None
        logger.info(
            "hf_fsdp_qlora: pre-quantized checkpoint (%s, double quant %s, %s storage): its quantization is used "
            "(quant_type/double_quant ignored); packed bytes are viewed as %s, not re-quantized",
            prequantized.quant_type, prequantized.double_quant, prequantized.storage, dtype,
        )  # fmt: skip
    experts_device = None
    if quantize_experts and "device_map" not in from_pretrained_kwargs:
        # On a GPU the 16-bit experts load on the CPU and are packed one expert at a time onto the GPU (_experts_map).
        from ._experts_map import accelerator_device, experts_on_cpu_kwargs

        experts_device = accelerator_device()
        placement = experts_on_cpu_kwargs(config, quantization_config, dtype, trust_remote_code, experts_device)
        quantization_config = placement.pop("quantization_config", quantization_config)
        from_pretrained_kwargs = {**from_pretrained_kwargs, **placement}
    if low_cpu_ram:
        from .low_ram import load_base_low_ram

        model = load_base_low_ram(
            model_name_or_path,
            quantization_config=quantization_config,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            whole_experts=quantize_experts,
            prepare=keep_int8_scales if bits == 8 else None,  # the int8 row scales travel as buffers
            **from_pretrained_kwargs,
        )
    else:
        quant = {} if quantization_config is None else {"quantization_config": quantization_config}
        model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path,
            **quant,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **from_pretrained_kwargs,
        )
        release_experts_dispatch(model)
    if prequantized is not None:
        # bitsandbytes reads packed weights back as bytes: a view changes no bit and gives FSDP one floating dtype.
        view_packed_storage_as(model, dtype)
    if quantize_experts and bits == 4:
        if prequantized is not None:
            # A stock 4-bit MoE checkpoint: its 16-bit experts take the checkpoint's own quantization.
            quant_type, double_quant = prequantized.quant_type, prequantized.double_quant
        quantize_expert_weights(
            model, quant_type=quant_type, double_quant=double_quant, dtype=dtype, device=experts_device
        )
    disable_cpu_repack_in_model(model)
    _freeze_for_kbit_training(model, gradient_checkpointing)
    lora_config = lora_config if lora_config is not None else default_lora_config()
    if quantize_experts:
        lora_config = lora_config_for_experts(model, lora_config)
    check_target_parameters(model, lora_config)
    with peft_sees_expert_weights(model):  # LoRA on 4-bit experts: peft builds its own wrappers (expert_lora.py)
        model = _apply_lora(model, lora_config)
    if bits == 8:  # after peft, which wraps bitsandbytes' Linear8bitLt: its LoRA layers keep their own forward
        convert_int8_layers(model, dtype)
    harmonize_dtypes(model, dtype)
    return model


def _has_fused_experts(config, trust_remote_code: bool) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        from accelerate import init_empty_weights

        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - no meta build from this config: nothing to decide here
        return False
    return has_fused_experts(skeleton)
