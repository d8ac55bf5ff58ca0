"""The rules behind :mod:`hf_fsdp_qlora.doctor.checks`, one function per failure, each yielding findings as dicts.

A rule reads a :class:`Context` (the setup, and when known the model's shapes and the memory plan) and yields
``dict(id=, severity=, problem=, setting=, value=)``. The upstream behaviour each rule encodes was reproduced
on real FSDP, and ``tests/test_doctor.py`` re-runs each failing and passing configuration on 2 CPU ranks; the
exact upstream error text is quoted in the problem so a user can match it with what they saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtype_names import BYTES, DTYPE_OF_MIXED_PRECISION, FLOAT_NAMES, MIXED_PRECISION_OF
from .memory import FIT_FRACTION, MemoryPlan, format_size, verdict
from .setup import RunSetup
from .shapes import ModelShape

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
    """8-bit under FSDP; integer 4-bit storage under FSDP1 (error) and FSDP2 (unsharded)."""
    s = ctx.setup
    version = s.fsdp.version
    if version is None or s.full_finetune:
        return
    if s.quantization == "8bit":
        # FSDP1: "Cannot flatten integer dtype tensors"; FSDP2: "'Parameter' object has no attribute 'CB'";
        # accelerate FSDP2: "Creating a Parameter from an instance of type Int8Params requires ...".
        yield _finding(
            "8bit-under-fsdp", "error",
            "An 8-bit (load_in_8bit=True) base model cannot be sharded by FSDP: its int8 weights and their scales "
            "are not floating-point tensors FSDP can flatten or shard (FSDP1: 'Cannot flatten integer dtype "
            "tensors'; FSDP2: \"'Parameter' object has no attribute 'CB'\"). Load the base in 4 bits - "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.bfloat16, "
            "bnb_4bit_quant_storage=torch.bfloat16), which hf_fsdp_qlora.load_qlora_model(path, dtype=torch.bfloat16) "
            "does - or train 8-bit with DDP.",
            "BitsAndBytesConfig", "load_in_4bit=True with bnb_4bit_quant_storage=torch.bfloat16 (not load_in_8bit)",
        )  # fmt: skip
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


def dtype_rules(ctx: Context):
    """Storage vs FSDP param dtype vs compute dtype; fp32 adapters or norms beside a 16-bit base."""
    s = ctx.setup
    version = s.fsdp.version
    if version is None or s.full_finetune or s.quantization == "8bit":
        return
    ours = s.trainer == OURS
    if s.quantization == "4bit" and s.storage not in _INTEGER:
        mp = s.effective_mixed_precision
        param = DTYPE_OF_MIXED_PRECISION.get(mp) if mp != "fp8" else None
        # transformers' update_fsdp_plugin_peft syncs FSDP1's mixed precision to the storage dtype; nothing does
        # under FSDP2, and a plain accelerate loop never does.
        synced = ours or (s.trainer == "transformers" and version == 1)
        if param is not None and param != s.storage:
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
        if s.compute != s.storage:
            yield _finding(
                "storage-vs-compute-dtype", "info" if ours else "warning",
                f"bnb_4bit_compute_dtype ({s.compute}) differs from bnb_4bit_quant_storage ({s.storage}): every "
                "matmul casts its input to the compute dtype and back, and the non-quantized weights follow the "
                "storage dtype." + (" hf_fsdp_qlora sets the compute dtype to the storage dtype." if ours else ""),
                "bnb_4bit_compute_dtype", f"torch.{s.storage}" if s.storage in FLOAT_NAMES else s.storage,
            )  # fmt: skip
    base = s.storage if (s.quantization == "4bit" and s.storage not in _INTEGER) else s.dtype
    for kind, dtype in (("adapters", s.adapter), ("norms", s.norm_dtype)):
        if dtype is None or dtype == base or (kind == "adapters" and s.full_finetune):
            continue
        rule_id = f"fsdp{version}-fp32-{kind}" if dtype == "float32" else f"fsdp{version}-mixed-{kind}"
        cause = (
            "peft's default autocast_adapter_dtype=True upcasts LoRA weights"
            if kind == "adapters"
            else "prepare_model_for_kbit_training upcasts every non-quantized weight (norms, embeddings)"
        )
        setting, value = (
            ("get_peft_model(..., autocast_adapter_dtype", "False)")
            if kind == "adapters"
            else ("prepare_model_for_kbit_training", "not called (freeze the base and enable checkpointing yourself)")
        )
        if ours:
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


def device_map_rule(ctx: Context):
    s = ctx.setup
    if s.device_map not in _SPREADING_MAPS or (s.fsdp.version is None and s.world_size == 1):
        return
    offload = " FSDP offloads by itself: fsdp_offload_params: true." if s.fsdp.offload_params else ""
    yield _finding(
        "device-map-under-fsdp", "error",
        f"device_map={s.device_map!r} spreads or offloads the model over several devices, which accelerate refuses "
        "in a distributed run ('You can't train a model that has been loaded with `device_map='auto'` in any "
        "distributed mode'; 4-bit: 'You can't train a model that has been loaded in 8-bit or 4-bit precision with "
        f"CPU or disk offload').{offload} Load each rank's copy on its own device (or pass no device_map).",
        "from_pretrained(device_map=...)", "None, or {'': local_rank} (one device per rank)",
    )  # fmt: skip


def launcher_rules(ctx: Context):
    """What accelerate launch refuses, and what needs a GPU in a CPU rehearsal."""
    f = ctx.setup.fsdp
    if f.launcher_error:
        yield _finding(
            "cpu-ram-efficient-loading-without-sync", "error",
            f"accelerate launch refuses this config: '{f.launcher_error}'. cpu_ram_efficient_loading loads the "
            "weights on rank 0 only and needs sync_module_states to broadcast them.",
            "fsdp_config.fsdp_sync_module_states", "true",
        )  # fmt: skip
    # FSDP1 only: the plugin looks up a device for sync_module_states (which cpu_ram_efficient_loading forces on);
    # FSDP2 drops sync_module_states and trains on CPU with either setting.
    if f.version == 1 and f.use_cpu and (f.sync_module_states or f.cpu_ram_efficient_loading):
        yield _finding(
            "cpu-rehearsal-needs-gpu", "error",
            "use_cpu: true with FSDP1 sync_module_states or cpu_ram_efficient_loading: accelerate looks for a "
            "GPU-like device and raises 'There are currently no available devices found'.",
            "fsdp_config.fsdp_sync_module_states and fsdp_cpu_ram_efficient_loading", "false",
        )  # fmt: skip
    if f.version is None:
        yield _finding(
            "not-fsdp", "info", "This accelerate config does not use FSDP: every GPU holds the whole model.",
            "distributed_type", "FSDP (e.g. hf-fsdp-qlora config fsdp2_qlora)",
        )  # fmt: skip


def wrap_rules(ctx: Context):
    s, classes = ctx.setup, ctx.module_classes
    f = s.fsdp
    if f.version is None or classes is None:
        return
    if f.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and f.transformer_cls_to_wrap:
        missing = [c for c in f.transformer_cls_to_wrap if c not in classes]
        if missing:
            layers = sorted(c for c in classes if c.endswith(("DecoderLayer", "Block", "Layer")))
            yield _finding(
                "wrap-class-missing", "error",
                f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which this model does not have: "
                f"'Could not find the transformer layer class {missing[0]} in the model'.",
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap", ",".join(layers) or "(remove it)",
            )  # fmt: skip
    elif f.auto_wrap_policy == "NO_WRAP" and not s.peft_wraps:
        if f.version == 2 and f.activation_checkpointing:
            yield _finding(
                "no-auto-wrap", "error",
                "No fsdp_auto_wrap_policy with FSDP2 activation checkpointing: accelerate's fsdp2_apply_ac calls the "
                "missing policy and fails with \"TypeError: 'NoneType' object is not callable\".",
                "fsdp_config.fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
            )  # fmt: skip
        else:
            yield _finding(
                "no-auto-wrap", "warning",
                "No fsdp_auto_wrap_policy: the whole model is one FSDP unit, so every GPU gathers all of it at once.",
                "fsdp_config.fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
            )  # fmt: skip


def checkpointing_rules(ctx: Context):
    s, plan = ctx.setup, ctx.plan
    if s.fsdp.version is not None and s.fsdp.activation_checkpointing and s.gradient_checkpointing:
        if s.trainer == "hf_fsdp_qlora":
            yield _finding(
                "activation-checkpointing-twice", "info",
                "FSDP activation checkpointing and TrainingArguments.gradient_checkpointing (trl's default) are both "
                "on: hf_fsdp_qlora keeps FSDP's and turns the Trainer's (and the model's) off, so each layer is "
                "recomputed once.",
                "TrainingArguments.activation_checkpointing", "False (keep fsdp_activation_checkpointing: true)",
            )  # fmt: skip
            return
        yield _finding(
            "activation-checkpointing-twice", "error",
            "FSDP activation checkpointing and TrainingArguments.activation_checkpointing (formerly "
            "gradient_checkpointing) are both on: transformers raises \"`fsdp_config['activation_checkpointing']` "
            "... and the `activation_checkpointing` training argument can't both be set to True\".",
            "TrainingArguments.activation_checkpointing", "False (keep fsdp_activation_checkpointing: true)",
        )  # fmt: skip
    if plan is None or plan.gpu_memory is None or plan.checkpointing != "none":
        return
    if plan.verdict != "fits" and verdict(plan.total_if(checkpointing=True), plan.gpu_memory) == "fits":
        key, value = ("fsdp_config.fsdp_activation_checkpointing", "true") if s.fsdp.version else (
            "TrainingArguments.activation_checkpointing", "True")  # fmt: skip
        yield _finding(
            "activation-checkpointing-off", "error" if plan.verdict == "does_not_fit" else "warning",
            f"Without activation checkpointing this run needs {format_size(plan.total)} per GPU "
            f"(activations {format_size(plan.activations_without_checkpointing)}) of {format_size(plan.gpu_memory)}; "
            f"with it, {format_size(plan.total_if(checkpointing=True))}.",
            key, value,
        )  # fmt: skip


def memory_rules(ctx: Context):
    s, plan = ctx.setup, ctx.plan
    if plan is None or plan.gpu_memory is None:
        return
    mem = plan.gpu_memory
    if plan.load_peak_per_gpu > mem:
        yield _finding(
            "load-does-not-fit", "error",
            f"Each rank loads and quantizes the whole model on its own GPU before FSDP shards it (transformers has "
            f"no rank-0-only path for bitsandbytes): {format_size(plan.load_peak_per_gpu)} > {format_size(mem)}.",
            "num GPUs / GPU size", "GPUs that hold the quantized model whole, or a smaller model",
        )  # fmt: skip
    v = plan.verdict
    if v == "fits":
        per_sample = (plan.parts["activations"] + plan.parts["logits_loss"]) / max(1, s.batch_size)
        largest = int((FIT_FRACTION * mem - (plan.total - per_sample * s.batch_size)) // max(1.0, per_sample))
        yield _finding(
            "memory-plan", "info",
            f"Estimated {format_size(plan.total)} per GPU of {format_size(mem)} (fits, with "
            f"{format_size(mem - plan.total)} headroom).",
            "per_device_train_batch_size", f"{s.batch_size} (up to about {largest} fits at {s.seq_len} tokens)",
        )  # fmt: skip
        return
    suggestions = []
    if plan.checkpointing == "none" and verdict(plan.total_if(True), mem) == "fits":
        return  # activation-checkpointing-off says it
    if not s.fsdp.offload_params and s.fsdp.version is not None:
        suggestions.append(("fsdp_config.fsdp_offload_params", "true"))
    if s.batch_size > 1:
        suggestions.append(("per_device_train_batch_size", "1 (raise gradient_accumulation_steps instead)"))
    suggestions.append(("max_seq_length", str(max(256, s.seq_len // 2))))
    setting, value = suggestions[0]
    severity = "warning" if v == "tight" else "error"
    yield _finding(
        "memory-does-not-fit" if v == "does_not_fit" else "memory-tight", severity,
        f"Estimated {format_size(plan.total)} per GPU of {format_size(mem)} ({v.replace('_', ' ')}): the largest "
        f"parts are {_largest(plan)}.", setting, value,
    )  # fmt: skip


def _largest(plan: MemoryPlan) -> str:
    parts = sorted(plan.parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{name} {format_size(size)}" for name, size in parts)


def checkpoint_rules(ctx: Context):
    s, plan = ctx.setup, ctx.plan
    if plan is None or not s.save_steps:
        return
    ckpt = plan.checkpoint
    f = s.fsdp
    sharded = f.version is not None and f.state_dict_type.startswith("SHARDED")
    writers = plan.num_gpus if sharded else 1
    seconds = ckpt["total"] / writers / (s.write_speed_mb_s * 1e6)
    timeout = s.timeout_minutes * 60
    if seconds > timeout / 2:
        minutes = math.ceil(4 * seconds / 60)
        yield _finding(
            "checkpoint-timeout", "error" if seconds > timeout else "warning",
            f"Each checkpoint writes about {format_size(ckpt['total'])} "
            f"({'every rank its shard' if sharded else 'rank 0 alone'}, at an assumed {s.write_speed_mb_s:.0f} MB/s): "
            f"about {seconds / 60:.0f} min while the other ranks wait in a collective that times out after "
            f"{s.timeout_minutes:.0f} min.",
            "TrainingArguments.ddp_timeout", f"{minutes * 60} (or fsdp_state_dict_type: SHARDED_STATE_DICT)",
        )  # fmt: skip
    if ckpt["optimizer"] and not s.save_only_model:
        refuse = (" (transformers refuses it with SHARDED_STATE_DICT; hf_fsdp_qlora's trainer allows it)"
                  if sharded and s.trainer != OURS else "")  # fmt: skip
        yield _finding(
            "optimizer-in-checkpoint", "info",
            f"Every checkpoint (each {s.save_steps} steps) holds the optimizer state, about "
            f"{format_size(ckpt['optimizer'])} beside {format_size(ckpt['weights'])} of weights: it is what resuming "
            f"needs, and what fills the disk. Checkpoints without it cannot resume{refuse}.",
            "TrainingArguments.save_only_model", "True (no resume), or save_total_limit=2 to bound the disk",
        )  # fmt: skip


def data_rules(ctx: Context):
    s, plan, shape = ctx.setup, ctx.plan, ctx.shape
    if s.padding == "max_length" and not s.packing:
        yield _finding(
            "padding-to-max-length", "warning",
            f"padding='max_length' pads every sample to {s.seq_len} tokens: every batch costs the memory and compute "
            "of the longest possible one, and short samples waste most of it.",
            "padding", "'longest' (DataCollatorWithPadding) or packing=True",
        )  # fmt: skip
    if shape is not None and shape.max_positions and s.seq_len > shape.max_positions:
        yield _finding(
            "seq-len-above-max-positions", "warning" if shape.rotary else "error",
            f"seq_len={s.seq_len} is longer than the model's max_position_embeddings={shape.max_positions}: "
            + ("RoPE runs past it, but the model never saw such positions and quality drops unless the run extends "
               "the context (rope_scaling)." if shape.rotary
               else "its learned position table has no row for the later tokens, and the first such batch fails."),
            "max_seq_length / seq_len", str(shape.max_positions),
        )  # fmt: skip
    if plan is None or shape is None or plan.gpu_memory is None or not s.eval_batch_size:
        return
    # Evaluation runs without gradients but materialises logits and their fp32 log-softmax for the whole batch.
    eval_logits = s.eval_batch_size * s.seq_len * shape.vocab_size * 10
    train_logits = plan.parts["logits_loss"]
    total = plan.total - train_logits - plan.parts["activations"] + eval_logits
    if s.eval_batch_size > s.batch_size and verdict(total, plan.gpu_memory) != "fits":
        yield _finding(
            "eval-batch-too-large", "error" if total > plan.gpu_memory else "warning",
            f"per_device_eval_batch_size={s.eval_batch_size}: the evaluation logits alone take "
            f"{format_size(eval_logits)} ({shape.vocab_size}-token vocabulary), {format_size(total)} per GPU in all.",
            "TrainingArguments.per_device_eval_batch_size", str(s.batch_size),
        )  # fmt: skip


RULES = (
    launcher_rules,
    quantization_rules,
    dtype_rules,
    requires_grad_rule,
    device_map_rule,
    wrap_rules,
    checkpointing_rules,
    memory_rules,
    checkpoint_rules,
    data_rules,
)

__all__ = ["RULES", "Context"]
