"""The memory plan as a table of terms: each term one function of the plan's context (:mod:`.plan_context`) that
returns its bytes per GPU (and in host RAM where it has some) with a one-line reason.

A new capability adds a row to :data:`TERMS` (and, where it needs one, a figure to the context), not a branch to
:func:`~hf_fsdp_qlora.doctor.memory.plan_memory`. ``offloadable`` rows move to host RAM with
``fsdp_offload_params`` (the sharded parameters, gradients and optimizer states).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..dtype_names import dtype_bytes
from ..loss_paths import logits_bytes
from .plan_context import PlanContext

__all__ = ["RUNTIME_OVERHEAD", "TERMS", "Row", "Term"]

RUNTIME_OVERHEAD = 2**30  # 1 GiB


@dataclass
class Term:
    """One term of the plan: bytes per GPU, bytes in host RAM per process, and why."""

    name: str
    bytes: float
    reason: str
    host_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": int(self.bytes), "host_bytes": int(self.host_bytes),
                "reason": self.reason}  # fmt: skip


def _sharded(divisor: int) -> str:
    return f"sharded 1/{divisor}" if divisor > 1 else "unsharded"


def base_quantized(ctx: PlanContext) -> Term:
    kind = {"4bit": "packed 4-bit weights, half a byte", "8bit": "int8 weights, one byte"}.get(ctx.quant)
    reason = f"{kind} per weight, {_sharded(ctx.quant_shard)}" if kind else "no quantized weights"
    term = Term("base_quantized", ctx.packed / ctx.quant_shard * ctx.upcast, reason)
    if ctx.whole_units_trainable and ctx.mixed:
        term.reason += "; accelerate upcasts FSDP1 units holding a trainable parameter to fp32"
        term.notes.append(
            "accelerate upcasts every FSDP1 unit holding a trainable parameter to fp32, 4-bit bytes included"
        )
    return term


def base_quant_state(ctx: PlanContext) -> Term:
    what = {"4bit": "absmax, nested absmax and code tables", "8bit": "fp32 row scales"}.get(ctx.quant)
    if what is None:
        return Term("base_quant_state", 0, "no quantization constants")
    return Term("base_quant_state", ctx.qstate, f"bitsandbytes' {what}: buffers, whole on every GPU")


def base_other(ctx: PlanContext) -> Term:
    if ctx.setup.full_finetune:
        return Term("base_other", ctx.trainable * ctx.master_b / ctx.shard,
                    f"every weight (full fine-tune), {ctx.master_b} bytes each, {_sharded(ctx.shard)}")  # fmt: skip
    return Term("base_other", ctx.other_numel * ctx.other_b / ctx.shard,
                f"embeddings, norms, biases, head and 16-bit weights in {ctx.base_dtype}, "
                f"{_sharded(ctx.shard)}")  # fmt: skip


def adapter(ctx: PlanContext) -> Term:
    if not ctx.lora:
        return Term("adapter", 0, "no adapter (full fine-tune)")
    return Term("adapter", ctx.trainable * ctx.master_b / ctx.shard,
                f"{ctx.trainable:,} trainable parameters, {ctx.master_b} bytes each, {_sharded(ctx.shard)}")  # fmt: skip


def gradients(ctx: PlanContext) -> Term:
    grads = ctx.trainable * ctx.master_b / ctx.shard + ctx.extra_grads
    reason = f"the trainable parameters' gradients, {_sharded(ctx.shard)}"
    if ctx.extra_grads:
        reason += ", and FSDP1's for the frozen bytes of units holding a trainable parameter"
    if ctx.setup.fsdp.version is None:
        grads *= 2  # DDP's gradient buckets hold a second copy
        reason += " (twice: DDP's gradient buckets)"
    return Term("gradients", grads, reason)


def optimizer(ctx: PlanContext) -> Term:
    s = ctx.setup
    per_param = {"adamw": 2 * ctx.master_b, "adamw_8bit": 2, "sgd": 0}.get(s.optimizer, 2 * ctx.master_b)
    states = per_param * ctx.trainable / ctx.shard
    if s.optimizer != "sgd":  # AdamW's fp32 `step` counter, one per trainable tensor on every rank
        per_adapted = 3 if s.use_dora else 2  # A, B (and DoRA's magnitude)
        adapted = per_adapted * sum(lin.lora for lin in ctx.shape.linears) + 2 * len(ctx.expert_lora)
        states += 4 * (adapted if ctx.lora else ctx.shape.num_tensors)
    if s.optimizer == "sgd":
        return Term("optimizer", states, "sgd: no optimizer state")
    return Term("optimizer", states, f"{s.optimizer}: {per_param} bytes per trainable parameter, "
                                     f"{_sharded(ctx.shard)}, and a step counter per tensor")  # fmt: skip


def fsdp_gathered(ctx: PlanContext) -> Term:
    s, shape, fsdp = ctx.setup, ctx.shape, ctx.setup.fsdp
    if fsdp.version is None:
        return Term("fsdp_gathered", 0, "no FSDP: nothing is gathered")
    # FSDP's mixed-precision param dtype casts what it gathers, except around quantized weights (kept as stored).
    gather_b = dtype_bytes(fsdp.param_dtype) if fsdp.param_dtype and not ctx.quant else ctx.other_b
    root = shape.other_outside * gather_b + sum(lin.numel * gather_b for lin in shape.linears if lin.layer is None)
    layer = ctx.layer_base if ctx.quant else (shape.per_layer("linear") + shape.per_layer("other")
                                              + shape.per_layer("experts")) * gather_b  # fmt: skip
    notes = []
    if (fsdp.auto_wrap_policy == "NO_WRAP" and not s.peft_wraps) or fsdp.sharding_strategy == "SHARD_GRAD_OP":
        gathered = ctx.packed + ctx.other_numel * gather_b if ctx.quant else shape.total_params * gather_b
        reason = "the whole model, gathered at once"
        notes.append("the whole model is gathered at once (NO_WRAP or SHARD_GRAD_OP / reshard_after_forward=False)")
    else:
        gathered = root + 2 * layer
        reason = "the root unit and two decoder layers (current + prefetched), unsharded"
    if s.full_finetune:
        gathered += max(root, layer)  # the unsharded gradient of the largest unit, before reduce-scatter
        reason += ", and the largest unit's unsharded gradient"
    elif ctx.whole_units_trainable:
        gathered += layer
        reason += ", and one layer's unsharded gradient"
    return Term("fsdp_gathered", gathered, reason, notes=notes)


def activations(ctx: PlanContext) -> Term:
    s = ctx.setup
    acts = ctx.with_ckpt if ctx.checkpointing != "none" else ctx.without_ckpt
    reason = f"saved for backward, {ctx.tokens:,} tokens, checkpointing={ctx.checkpointing}"
    if s.sp_size > 1:
        reason += f", sp_size={s.sp_size} (this GPU's share of each sequence)"
    if s.tiled_mlp_tokens:
        reason += f", tiled MLP ({s.tiled_mlp_tokens} tokens per tile)"
    if not s.activation_offloading:
        return Term("activations", acts, reason)
    # What stays: the layer being back-propagated (brought back, or recomputed under checkpointing) and the
    # transients; the final norm / LM-head inputs move too. The logits stay: they are the forward's output.
    on_gpu = ctx.tokens * ctx.per_layer + ctx.transient + ctx.saved_experts
    offloaded = max(0.0, acts - on_gpu)
    return Term("activations", acts - offloaded, reason + "; the rest wait in host RAM (activation_offloading)",
                host_bytes=offloaded)  # fmt: skip


def logits_loss(ctx: PlanContext) -> Term:
    shape, s = ctx.shape, ctx.setup
    # A full fine-tune trains the plain nn.Linear head: our loss holds its fp32 gradient from forward to backward.
    size = logits_bytes(ctx.path, ctx.tokens, shape.vocab_size, ctx.act, shape.hidden_size, s.loss_chunk_size,
                        head_trained=s.full_finetune)  # fmt: skip
    return Term("logits_loss", size, f"the logits and the loss's fp32 working memory (loss path: {ctx.path})")


def dequant_workspace(ctx: PlanContext) -> Term:
    shape, s = ctx.shape, ctx.setup
    numel = max((lin.numel for lin in shape.linears if lin.quantized), default=0) if ctx.quant else 0
    workspace = max(numel * ctx.act, ctx.experts.workspace_numel * ctx.act) + ctx.experts.grouped_extra
    term = Term("dequant_workspace", workspace, "the largest quantized weight (or one expert's), dequantized")
    if ctx.experts.grouped_numel:
        # The grouped workspace (one weight of a layer's routed experts at once) is what autograd keeps for the
        # backward: counted once, in the activations' saved experts; here only what its dequantization reads beside.
        term.reason += (f"; grouped experts: {ctx.experts.grouped_numel * ctx.act / 2**30:.2f} GiB of routed experts "
                        "at once, within the activations' saved experts")  # fmt: skip
    if s.use_dora and ctx.lora:
        term.bytes = max(workspace, shape.dora_workspace() * ctx.act)
        term.reason += "; DoRA dequantizes each adapted weight for its norm"
        term.notes.append("DoRA: each adapted Linear's weight is dequantized for its norm in every forward")
    return term


def runtime_overhead(ctx: PlanContext) -> Term:
    return Term("runtime_overhead", RUNTIME_OVERHEAD, "CUDA context, cuBLAS workspace, NCCL buffers (fixed 1 GiB)")


@dataclass(frozen=True)
class Row:
    """One row of the table: a term, and whether ``fsdp_offload_params`` moves it to host RAM."""

    name: str
    term: Callable[[PlanContext], Term]
    offloadable: bool = False


# In report order.
TERMS = (
    Row("base_quantized", base_quantized, offloadable=True),
    Row("base_quant_state", base_quant_state),
    Row("base_other", base_other, offloadable=True),
    Row("adapter", adapter, offloadable=True),
    Row("gradients", gradients, offloadable=True),
    Row("optimizer", optimizer, offloadable=True),
    Row("fsdp_gathered", fsdp_gathered),
    Row("activations", activations),
    Row("logits_loss", logits_loss),
    Row("dequant_workspace", dequant_workspace),
    Row("runtime_overhead", runtime_overhead),
)
