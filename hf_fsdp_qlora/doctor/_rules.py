"""The rules behind :mod:`hf_fsdp_qlora.doctor.checks`, one function per failure, each yielding findings as dicts.

This module holds the rule shape and the rules about the model's dtypes and quantization;
:mod:`hf_fsdp_qlora.doctor._launch_rules` holds the rules about the launch. ``checks.RULES`` orders them.

A rule reads a :class:`Context` (the setup, and when known the model's shapes and the memory plan) and yields
``dict(id=, severity=, problem=, setting=, value=)``. The upstream behaviour each rule encodes was reproduced
on real FSDP, and ``tests/test_doctor.py`` re-runs each failing and passing configuration on 2 CPU ranks; the
exact upstream error text is quoted in the problem so a user can match it with what they saw.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtype_names import BYTES, DTYPE_OF_MIXED_PRECISION, FLOAT_NAMES, MIXED_PRECISION_OF
from ..model_shapes import ModelShape
from .memory import MemoryPlan
from .setup import RunSetup

OURS = "hf_fsdp_qlora"
_INTEGER = ("uint8", "int8")
_SPREADING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential", "multi-device")


@dataclass
class Context:
    setup: RunSetup
    shape: ModelShape | None
    plan: MemoryPlan | None
    module_classes: set[str] | None


def _finding(id, severity, problem, setting, value):
    return {"id": id, "severity": severity, "problem": problem, "setting": setting, "value": value}


def _float_dtype(setup: RunSetup) -> str:
    """The floating dtype to recommend: the compute dtype, or bfloat16."""
    return setup.compute if setup.compute not in _INTEGER else "bfloat16"


def quantization_rules(ctx: Context):
    """8-bit under FSDP (planned, or refused); integer 4-bit storage under FSDP1 (error) and FSDP2 (unsharded)."""
    s = ctx.setup
    version = s.fsdp.version
    if version is None or s.full_finetune:
        return
    if s.quantization == "8bit":
        yield from _eight_bit(ctx)
    if s.quantization != "4bit" or s.storage not in _INTEGER:
        return
    dtype = f"torch.{_float_dtype(s)}"
    if s.integer_storage_sharded:
        yield _finding(
            f"fsdp{version}-integer-storage", "info",
            f"The 4-bit weights are stored as {s.storage}; hf_fsdp_qlora views the packed bytes as {_float_dtype(s)} "
            f"(no value changes) so that FSDP{version} {'can flatten' if version == 1 else 'shards'} them.",
            "bnb_4bit_quant_storage", f"{dtype} (the compute dtype)",
        )  # fmt: skip
    elif version == 1:
        yield _finding(
            "fsdp1-integer-storage", "error",
            f"The 4-bit weights are stored as {s.storage} (bitsandbytes' default), which FSDP1 cannot flatten "
            f"('Cannot flatten integer dtype tensors'). Store them in the compute dtype: BitsAndBytesConfig(..., "
            f"bnb_4bit_compute_dtype={dtype}, bnb_4bit_quant_storage={dtype}), as "
            f"hf_fsdp_qlora.load_qlora_model(path, dtype={dtype}) does, or train with hf_fsdp_qlora's trainer, "
            "which views the packed bytes as the compute dtype.",
            "bnb_4bit_quant_storage", f"{dtype} (the compute dtype)",
        )  # fmt: skip
    else:
        yield _finding(
            "fsdp2-integer-storage", "warning",
            f"The 4-bit weights are stored as {s.storage}: accelerate's FSDP2 excludes them from sharding ('Found N "
            "non-floating frozen Params4bit. Excluding from FSDP2 sharding'), so every GPU holds the whole "
            "quantized model. Store them in the compute dtype to shard them.",
            "bnb_4bit_quant_storage", f"{dtype} (the compute dtype)",
        )  # fmt: skip


_STOCK_8BIT = (
    "A stock 8-bit (load_in_8bit=True) base cannot be sharded by FSDP: bitsandbytes' Int8Params are int8 tensors "
    "with their row scales as an attribute, which FSDP can neither flatten nor shard (FSDP1: 'Cannot flatten "
    "integer dtype tensors'; FSDP2: \"'Parameter' object has no attribute 'CB'\")."
)


def _eight_bit(ctx: Context):
    """8 bits under FSDP: planned on our route, refused where the base is bitsandbytes' own Int8Params."""
    s = ctx.setup
    if s.trainer != OURS or s.int8_unsupported:
        why = f" Here: {s.int8_unsupported}" if s.int8_unsupported else ""
        # The 4-bit route stays named: it needs no 8-bit loader.
        yield _finding(
            "8bit-under-fsdp", "error",
            f"{_STOCK_8BIT}{why} Load the base with hf_fsdp_qlora.load_qlora_model(path, bits=8) (or train trl's "
            "--load_in_8bit through `python -m hf_fsdp_qlora.run`), which holds the int8 weights as bytes FSDP "
            "shards, and train with hf_fsdp_qlora's trainers; or load in 4 bits (load_in_4bit=True with "
            "bnb_4bit_quant_storage=torch.bfloat16, what load_qlora_model(path) does).",
            "load_qlora_model", "bits=8 with hf_fsdp_qlora's trainers (or load_in_4bit=True)",
        )  # fmt: skip
    else:
        yield _finding(
            "8bit-under-fsdp", "info",
            "LoRA on an 8-bit (LLM.int8) base through hf_fsdp_qlora: load_qlora_model(path, bits=8) holds each "
            "linear layer's int8 weights as bytes FSDP shards (1 byte per weight, 1/N per GPU) beside their fp32 "
            "row scales (4 bytes per output row); the memory plan counts them so.",
            "load_qlora_model", "bits=8",
        )  # fmt: skip
    if ctx.shape is not None and ctx.shape.experts:
        families = ", ".join(sorted({e.family for e in ctx.shape.experts}))
        yield _finding(
            "8bit-moe-experts", "error",
            f"8 bits on a mixture-of-experts model ({families}): bitsandbytes' 8-bit loading replaces nn.Linear "
            f"only and hf_fsdp_qlora's experts are 4-bit (NF4) only, so the fused experts - "
            f"{ctx.shape.expert_params / max(1, ctx.shape.total_params):.0%} of the weights - would stay 16-bit "
            "or make a mixed 4/8-bit model, which hf_fsdp_qlora does not build. Load it in 4 bits: experts and "
            "linear layers NF4.",
            "quantization", "load_in_4bit (load_qlora_model(path), bits=4)",
        )  # fmt: skip


def _expert_weight_names(shape: ModelShape) -> str:
    return ", ".join(f"{e.name}.{n}" for e in shape.experts[:1] for n in e.weights) or "none"


def experts_rule(ctx: Context):
    """LoRA on experts (peft's target_parameters) that peft refuses; fused experts load_qlora_model cannot quantize
    (it refuses them rather than leave them 16-bit silently)."""
    s, shape = ctx.setup, ctx.shape
    if shape is None or s.full_finetune:
        return
    if s.lora_target_parameters and not shape.expert_lora_targets(s.lora_target_parameters):
        yield _finding(
            "expert-lora-no-match", "warning",
            f"peft warns 'target_parameters={s.lora_target_parameters} were set but no parameter was matched.' "
            f"and trains without LoRA on the experts. The model's expert weights: {_expert_weight_names(shape)} (a "
            "target matches a parameter's full name or its ending).",
            "target_parameters", "e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj",
        )  # fmt: skip
    elif s.lora_target_parameters and s.lora_dropout > 0:
        yield _finding(
            "expert-lora-dropout", "error",
            "peft refuses dropout on parameter targets: 'lora.ParamWrapper does not work with lora_dropout != 0.'",
            "lora_dropout", "0 (trl: --lora_dropout 0)",
        )  # fmt: skip
    if s.quantization != "4bit" or not s.quantize_experts:
        return
    unknown = sorted({e.family for e in shape.experts if not e.quantizable})
    if unknown:
        from ..experts.layouts import EXPERT_REFUSALS

        why = "".join(f" {EXPERT_REFUSALS[f]}." for f in unknown if f in EXPERT_REFUSALS)
        yield _finding(
            "experts-not-quantizable", "error",
            f"{', '.join(unknown)} holds the experts of a mixture-of-experts model in a layout hf_fsdp_qlora "
            "cannot quantize to 4 bits yet: load_qlora_model raises UnsupportedSetupError for it rather than leave "
            f"the experts 16-bit silently. The plan counts them 16-bit.{why}",
            "load_qlora_model", "quantize_experts=False (doctor: --no-quantize-experts), the experts 16-bit knowingly",
        )  # fmt: skip


def dtype_rules(ctx: Context):
    """Storage vs FSDP param dtype vs compute dtype; fp32 adapters or norms beside a 16-bit base."""
    s = ctx.setup
    if s.fsdp.version is None or s.full_finetune or s.quantization == "8bit":
        return
    if s.quantization == "4bit" and s.storage not in _INTEGER:
        yield from _storage_vs_param_dtype(s)
        yield from _storage_vs_compute_dtype(s)
    yield from _odd_dtype_beside_base(s)


def _storage_vs_param_dtype(s: RunSetup):
    """FSDP's mixed-precision param dtype against the 4-bit storage dtype: synced (info), refused, or corrupting."""
    version, ours = s.fsdp.version, s.trainer == OURS
    mp = s.effective_mixed_precision
    param = DTYPE_OF_MIXED_PRECISION.get(mp) if mp != "fp8" else None
    if param is None or param == s.storage:
        return
    # transformers' update_fsdp_plugin_peft syncs FSDP1's mixed precision to the storage dtype; nothing does
    # under FSDP2, and a plain accelerate loop never does.
    synced = ours or (s.trainer == "transformers" and version == 1)
    if synced and BYTES.get(param) == BYTES.get(s.storage) == 2:
        # FSDP's param dtype can be fixed, but accelerate still autocasts every op to the other 16-bit type
        # (and runs a gradient scaler for fp16) over the stored weights: refuse rather than say "handled".
        yield _finding(
            "mixed-precision-vs-storage", "error",
            f"mixed_precision={mp} over weights stored as {s.storage}: FSDP's param dtype is kept at "
            f"{s.storage}, but accelerate still runs {param} autocast"
            + (" and a gradient scaler" if mp == "fp16" else "")
            + f" over {s.storage} weights, so every matmul rounds to {param} "
            + ("(bfloat16 values beyond float16's range overflow to inf)." if mp == "fp16" else "."),
            "mixed_precision", f"{MIXED_PRECISION_OF.get(s.storage, 'no')} (TrainingArguments "
            f"{'bf16=True, fp16=False' if s.storage == 'bfloat16' else 'fp16=True, bf16=False'}), or load "
            f"the model with dtype=torch.{param}",
        )  # fmt: skip
    elif synced:
        who = "hf_fsdp_qlora" if ours else "transformers (FSDP1 only)"
        yield _finding(
            "storage-vs-param-dtype", "info",
            f"mixed_precision={mp} would make FSDP cast the 4-bit weights (stored as {s.storage}) to {param}; "
            f"{who} sets FSDP's param_dtype to {s.storage} instead.",
            "mixed_precision", MIXED_PRECISION_OF.get(s.storage, "no"),
        )  # fmt: skip
    else:
        same_size = BYTES.get(param) == BYTES.get(s.storage)
        effect = (
            "every base weight is silently corrupted (training runs, on garbage)"
            if same_size
            else "bitsandbytes then fails on the resized buffer (\"shape '[...]' is invalid for input of size ...\")"
        )
        yield _finding(
            "storage-vs-param-dtype", "error",
            f"FSDP{version}'s mixed precision param_dtype ({param}, from mixed_precision={mp}) differs from "
            f"the 4-bit storage dtype ({s.storage}): FSDP casts the packed 4-bit bytes as if they were "
            f"numbers, and {effect}.",
            "mixed_precision", f"{MIXED_PRECISION_OF.get(s.storage, 'no')} (or bnb_4bit_quant_storage=torch.{param}; "
            "hf_fsdp_qlora's trainer keeps them equal)",
        )  # fmt: skip


def _storage_vs_compute_dtype(s: RunSetup):
    if s.compute == s.storage:
        return
    ours = s.trainer == OURS
    yield _finding(
        "storage-vs-compute-dtype", "info" if ours else "warning",
        f"bnb_4bit_compute_dtype ({s.compute}) differs from bnb_4bit_quant_storage ({s.storage}): every "
        "matmul casts its input to the compute dtype and back, and the non-quantized weights follow the "
        "storage dtype." + (" hf_fsdp_qlora sets the compute dtype to the storage dtype." if ours else ""),
        "bnb_4bit_compute_dtype", f"torch.{s.storage}" if s.storage in FLOAT_NAMES else s.storage,
    )  # fmt: skip


def _odd_dtype_cause(kind: str, dtype: str, base: str) -> tuple[str, str, str]:
    """Why adapters or norms hold another dtype than the base, and the setting that removes the difference.

    peft's ``autocast_adapter_dtype=True`` only ever upcasts 16-bit adapters to float32; 16-bit adapters beside
    another base come from a cast after ``get_peft_model``: trl's trainers (SFTTrainer, DPOTrainer, ...) cast a
    quantized model's trainable parameters to bfloat16 in ``__init__`` whatever ``--dtype`` says. Its fix is a flag
    trl's scripts take unchanged, ``--dtype`` (trl's ModelConfig.dtype: the base in the adapters' dtype).
    """
    if kind != "adapters":
        return ("prepare_model_for_kbit_training upcasts every non-quantized weight (norms, embeddings)",
                "prepare_model_for_kbit_training", "not called (freeze the base and enable checkpointing yourself)")  # fmt: skip
    if dtype == "float32":
        return ("peft's default autocast_adapter_dtype=True upcasts LoRA weights",
                "get_peft_model(..., autocast_adapter_dtype", "False)")  # fmt: skip
    return ((f"not peft's doing, which only upcasts to float32: loaded in {dtype}, or cast after get_peft_model, as "
             "trl's SFTTrainer (and its other trainers) casts a quantized model's adapters to bfloat16 in __init__ "
             "whatever --dtype says"),
            "--dtype (trl's ModelConfig.dtype; the base's dtype)",
            f"{dtype} (the base in the adapters' dtype; trl's sft.py and dpo.py take it unchanged)")  # fmt: skip


def _odd_dtype_beside_base(s: RunSetup):
    """Adapters or norms in another dtype than the base: cast by our trainer, refused by FSDP1 on the stock stack."""
    version, ours = s.fsdp.version, s.trainer == OURS
    base = s.storage if (s.quantization == "4bit" and s.storage not in _INTEGER) else s.dtype
    for kind, dtype in (("adapters", s.adapter), ("norms", s.norm_dtype)):
        if dtype is None or dtype == base or (kind == "adapters" and s.full_finetune):
            continue
        rule_id = f"fsdp{version}-fp32-{kind}" if dtype == "float32" else f"fsdp{version}-mixed-{kind}"
        cause, setting, value = _odd_dtype_cause(kind, dtype, base)
        if ours and kind == "adapters" and dtype != "float32":
            yield _finding(
                rule_id, "info",
                f"Adapters in {dtype} beside a {base} base ({cause}); hf_fsdp_qlora trains them as float32 master "
                "weights (adapter_dtype) before wrapping, from their 16-bit-rounded start.",
                setting, f"{base} as given: nothing to change; bfloat16 for a bf16 base beside them",
            )  # fmt: skip
        elif ours and kind == "adapters" and dtype == "float32":
            yield _finding(
                rule_id, "info",
                f"Adapters in float32 beside a {base} base: hf_fsdp_qlora keeps them float32 (master weights, stepped in "
                f"float32) in FSDP units of their own dtype and computes in {base}.",
                "adapter_dtype", "float32 (default), or bfloat16 for pure 16-bit adapters",
            )  # fmt: skip
        elif ours:
            yield _finding(
                rule_id, "info",
                f"{kind.capitalize()} in {dtype} beside a {base} base ({cause}); hf_fsdp_qlora casts them to {base} "
                "before wrapping.", setting, value,
            )  # fmt: skip
        elif version == 1:
            text = (
                "Through Trainer: 'expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16'"
                if kind == "adapters" and s.trainer == "transformers"
                else "'Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32'"
            )
            yield _finding(
                rule_id, "error",
                f"{kind.capitalize()} in {dtype} beside a {base} base ({cause}) in one FSDP1 unit: {text}.",
                setting, value,
            )  # fmt: skip


def requires_grad_rule(ctx: Context):
    """FSDP1 with use_orig_params=False and frozen base + trainable adapters in one unit."""
    s = ctx.setup
    if s.fsdp.version != 1 or s.full_finetune or s.fsdp.use_orig_params:
        return
    if s.trainer == OURS:
        yield _finding(
            "fsdp1-use-orig-params", "info",
            "use_orig_params=false with frozen base weights and trainable LoRA weights in the same layers; "
            "hf_fsdp_qlora sets use_orig_params=True before wrapping.",
            "fsdp_config.fsdp_use_orig_params", "true",
        )  # fmt: skip
    elif s.trainer == "accelerate":
        yield _finding(
            "fsdp1-use-orig-params", "error",
            "FSDP1 with use_orig_params=false flattens each decoder layer into one tensor that must be all frozen "
            "or all trainable; LoRA puts both in a layer: 'Must flatten tensors with uniform requires_grad when "
            "use_orig_params=False'.",
            "fsdp_config.fsdp_use_orig_params", "true",
        )  # fmt: skip
    # transformers.Trainer replaces the wrap policy with peft's fsdp_auto_wrap_policy, which gives every LoRA
    # layer its own unit: requires_grad is uniform per unit and use_orig_params=false works.


__all__ = ["Context", "dtype_rules", "quantization_rules", "requires_grad_rule"]
