"""The doctor's rules about the launch, not the model's dtypes: device maps, the launcher and accelerate config,
FSDP wrapping, activation checkpointing, memory, checkpoint saves and data. Each yields findings as dicts; see
:mod:`hf_fsdp_qlora.doctor._rules` for the shape of a rule.
"""

from __future__ import annotations

import math

from ..sp_rules import router_aux_problem, sequence_parallel_problem
from ._rules import _SPREADING_MAPS, OURS, Context, _finding
from .advice import can_checkpoint, combined, ranked_levers
from .memory import FIT_FRACTION, MemoryPlan, format_size, verdict


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
    if ctx.shape is not None and not ctx.shape.checkpointing and (s.gradient_checkpointing or s.model_checkpointing):
        setting = "TrainingArguments.activation_checkpointing" if s.gradient_checkpointing else (
            "load_qlora_model(gradient_checkpointing=...)")  # fmt: skip
        yield _finding(
            "checkpointing-unsupported", "error",
            f"{ctx.shape.model_type!r}: its transformers class does not support activation checkpointing, and "
            "enabling it raises \"... does not support activation checkpointing\".",
            setting, "False (load_qlora_model's default leaves it off for this family)",
        )  # fmt: skip
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
    if plan is None or plan.gpu_memory is None or plan.checkpointing != "none" or not can_checkpoint(s, ctx.shape):
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
        experts = ""
        if ctx.shape is not None and ctx.shape.experts and s.quantization == "4bit" and s.quantize_experts:
            sixteen = plan.parameters.get("experts_bytes_16bit", 0)
            experts = (f" The fused experts arrive in 16 bits ({format_size(sixteen)}) and are quantized only after "
                       "the load; load_qlora_model (our trainers) loads them on the CPU and packs them onto the GPU "
                       "expert by expert.") if s.trainer != "hf_fsdp_qlora" else ""  # fmt: skip
        yield _finding(
            "load-does-not-fit", "error",
            f"Each rank loads and quantizes the whole model on its own GPU before FSDP shards it (transformers has "
            f"no rank-0-only path for bitsandbytes): {format_size(plan.load_peak_per_gpu)} > {format_size(mem)}."
            + experts,
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
    if plan.checkpointing == "none" and can_checkpoint(s, ctx.shape) and verdict(plan.total_if(True), mem) == "fits":
        return  # activation-checkpointing-off says it
    yield _does_not_fit(ctx)


def _does_not_fit(ctx: Context) -> dict:
    """The plan's largest parts, and the run's levers ranked by the bytes each saves (.advice), the first as the
    setting to change (a tight plan: the longest length that fits, where one does)."""
    plan, mem, v = ctx.plan, ctx.plan.gpu_memory, ctx.plan.verdict
    levers = ranked_levers(ctx.setup, ctx.shape, plan) if ctx.shape is not None else []
    # The four that save most, and the longest length that fits wherever it ranks (the smallest change that fits).
    levers = levers[:4] + [lever for lever in levers[4:] if lever.setting == "max_length"]
    problem = (f"Estimated {format_size(plan.total)} per GPU of {format_size(mem)} ({v.replace('_', ' ')}): the "
               f"largest parts are {_largest(plan)}.")  # fmt: skip
    if levers:
        problem += " By bytes saved: " + "; ".join(lever.text(plan.total, mem) for lever in levers) + "."
        if verdict(levers[0].total, mem) != "fits":
            count, total = combined(ctx.setup, ctx.shape, levers, mem)
            problem += (f" None fits alone; the first {count} together: {format_size(total)} per GPU "
                        f"({verdict(total, mem).replace('_', ' ')}).")  # fmt: skip
        # A tight plan is nearly there: the length that fits is the change to make (a shorter sequence, nothing else).
        length = [lever for lever in levers if lever.setting == "max_length" and verdict(lever.total, mem) == "fits"]
        chosen = length[0] if v == "tight" and length else levers[0]
        setting, value = chosen.setting, chosen.advice
    else:
        setting, value = "num GPUs / GPU size", "more or larger GPUs"
    return _finding(
        "memory-does-not-fit" if v == "does_not_fit" else "memory-tight", "warning" if v == "tight" else "error",
        problem, setting, value,
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


def sequence_parallel_rule(ctx: Context):
    """What the trainers refuse under sp_size > 1 before the first step (hf_fsdp_qlora.sp_rules), said before launch."""
    s, shape = ctx.setup, ctx.shape
    if s.sp_size <= 1 or shape is None:
        return
    found = sequence_parallel_problem(
        s.sp_size, s.world_size, shape.num_heads, s.attn_implementation, shape.local_attention, shape.sliding_window
    ) or router_aux_problem(repr(shape.model_type), shape.output_router_logits, shape.router_aux)
    if found is not None:
        yield _finding(
            "sequence-parallel-refused", "error",
            f"sp_size={s.sp_size}{found.problem} The trainer refuses this before the first step.",
            "FSDPQLoRATrainingArguments.sp_size (doctor --sp-size)", found.fix,
        )  # fmt: skip
