"""What every term of the memory plan reads: the run's dtypes, sharding and counts, derived once from the setup and
the model's shape (:func:`plan_context`), so that each term (:mod:`.terms`) is a few lines of arithmetic.

Each step below derives one group of figures: the loss path and tokens, the dtypes, the quantized bytes, the
trainable parameters and their master dtype, how FSDP shards the base, and the activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dtype_names import dtype_bytes
from ..loss_paths import loss_path, sequences_factor
from ..model_shapes import ModelShape
from .activations import layer_activation_bytes, layer_activations, mlp_width
from .experts_plan import ExpertBytes, expert_bytes
from .setup import RunSetup

__all__ = ["PlanContext", "plan_context", "planned_loss_path", "shard_factor"]

BLOCKSIZE = 64  # bitsandbytes' 4-bit block size
NESTED_BLOCKSIZE = 256


@dataclass
class PlanContext:
    """The figures the terms share (bytes and element counts; see the steps that set them)."""

    setup: RunSetup
    shape: ModelShape
    shard: int  # FSDP's shard factor (1 without sharding)
    quant: str | None  # "4bit", "8bit" or None (also None for a full fine-tune)
    lora: bool
    mixed: bool  # accelerate's mixed precision is on
    path: str  # the loss path (hf_fsdp_qlora.loss_paths)
    tokens: int  # tokens per forward (DPO: chosen and rejected)
    notes: list[str] = field(default_factory=list)
    # dtypes
    base_dtype: str = "bfloat16"  # what our trainer casts every non-quantized parameter to
    act: int = 2  # bytes of the compute dtype
    other_b: int = 2  # bytes of the non-quantized base weights
    # the base's bytes
    experts: ExpertBytes | None = None
    quantized_numel: int = 0  # linear weights held quantized
    other_numel: int = 0  # every other base weight (embeddings, norms, head, 16-bit experts)
    packed: int = 0  # the quantized weights' bytes (4-bit packed or int8)
    qstate: int = 0  # their quantization constants, whole on every rank
    # trainable parameters
    trainable: int = 0
    expert_lora: list = field(default_factory=list)  # the adapted expert weights
    master_b: int = 2  # bytes of the trainable parameters' master dtype
    # sharding of the base
    whole_units_trainable: bool = False  # FSDP1 + a plain accelerate loop: frozen and LoRA in one flat parameter
    quant_shard: int = 1
    upcast: float = 1.0  # accelerate's fp32 upcast of whole FSDP1 units (1: none)
    extra_grads: float = 0.0  # the gradients FSDP1 allocates for those units' frozen bytes
    layer_base: float = 0.0  # one decoder layer's base bytes, as held
    # activations
    checkpointing: str = "none"  # "fsdp", "trainer", "model" or "none"
    per_layer: float = 0.0  # per-token bytes of the largest layer
    transient: float = 0.0  # the backward's transient buffers
    saved_experts: float = 0.0  # one layer's routed experts, dequantized, kept for backward
    mlp_tile: int = 0  # tokens one tiled-MLP tile holds (every row of the batch); 0: the MLP runs untiled
    with_ckpt: float = 0.0
    without_ckpt: float = 0.0


def shard_factor(setup: RunSetup) -> int:
    fsdp = setup.fsdp
    if fsdp.version is None or fsdp.sharding_strategy == "NO_SHARD":
        return 1
    if "HYBRID" in fsdp.sharding_strategy:
        return max(1, setup.world_size // max(1, fsdp.num_machines))
    return setup.world_size


def planned_loss_path(setup: RunSetup, shape: ModelShape) -> tuple[str, str | None]:
    """The loss path the run takes, and why it is not ours: the predicate the trainer asks at run time."""
    if setup.loss_path is not None:
        return setup.loss_path, None
    path, why = loss_path(setup.trainer, setup.trainer_class, config=shape.logit_transforms)
    if path == "own":  # a trainer class with a loss the plan has no row for (trl's GRPOTrainer, ...): its logits whole
        return "stock", f"{why}: planned as the stock loss, the whole logits (--loss-path to plan another)"
    return path, why


def plan_context(shape: ModelShape, setup: RunSetup) -> PlanContext:
    """Every figure the terms share, derived once, step by step."""
    path, why = planned_loss_path(setup, shape)
    ctx = PlanContext(
        setup=setup,
        shape=shape,
        shard=shard_factor(setup),
        quant=None if setup.full_finetune else setup.quantization,
        lora=not setup.full_finetune,
        mixed=setup.effective_mixed_precision != "no",
        path=path,
        # DPO runs chosen and rejected sequences through the model in one forward: twice the tokens.
        tokens=math.ceil(setup.batch_size * setup.seq_len * sequences_factor(path) / max(1, setup.sp_size)),
    )
    if why is not None and path == "stock" and setup.trainer == "hf_fsdp_qlora":
        ctx.notes.append(f"the run keeps transformers' stock loss (full logits): {why}")
    if path == "dpo":
        ctx.notes.append("DPO: chosen and rejected sequences run together, twice batch x seq tokens per forward")
    if setup.sp_size > 1:
        ctx.notes.append(f"sequence parallelism: each GPU holds 1/{setup.sp_size} of every sequence's tokens")
    _dtypes(ctx)
    _base_bytes(ctx)
    _trainable(ctx)
    _base_sharding(ctx)
    _activations(ctx)
    return ctx


def _dtypes(ctx: PlanContext) -> None:
    """Our trainer casts every non-quantized parameter to one dtype (hf_fsdp_qlora.dtypes); stock keeps them."""
    s = ctx.setup
    base_dtype = s.dtype
    if s.trainer == "hf_fsdp_qlora" and ctx.quant == "4bit":
        base_dtype = s.storage if s.storage not in ("uint8", "int8") else s.compute
    ctx.base_dtype = base_dtype
    ctx.act = dtype_bytes(base_dtype if s.trainer == "hf_fsdp_qlora" else s.compute)
    ctx.other_b = dtype_bytes(base_dtype)


def quant_state_bytes(numel: int, double_quant: bool) -> int:
    """bitsandbytes' 4-bit constants of one weight: absmax per 64 weights (uint8 and nested with double quant)."""
    blocks = math.ceil(numel / BLOCKSIZE)
    if not double_quant:
        return blocks * 4 + 64  # fp32 absmax + the 16-entry code
    return blocks + math.ceil(blocks / NESTED_BLOCKSIZE) * 4 + 4 + 64 + 1024  # uint8 absmax, nested, codes


def _base_bytes(ctx: PlanContext) -> None:
    """The quantized weights' bytes and constants (linear layers and experts), and the count of the rest."""
    s, shape, quant = ctx.setup, ctx.shape, ctx.quant
    quantized = [lin for lin in shape.linears if lin.quantized] if quant else []
    ctx.quantized_numel = sum(lin.numel for lin in quantized)
    ctx.experts = expert_bytes(shape, quant == "4bit" and s.quantize_experts, s.double_quant, ctx.tokens)
    ctx.other_numel = shape.total_params - ctx.quantized_numel - ctx.experts.quantized_numel
    if quant == "4bit":
        ctx.packed = sum(math.ceil(lin.numel / 2) for lin in quantized) + ctx.experts.packed
        ctx.qstate = sum(quant_state_bytes(lin.numel, s.double_quant) for lin in quantized)
        ctx.qstate += ctx.experts.quant_state
    elif quant == "8bit":
        # LLM.int8: one byte per weight; the fp32 row scales (SCB, one per output row) counted whole on every rank.
        ctx.packed = ctx.quantized_numel
        ctx.qstate = sum(4 * lin.out_features for lin in quantized)


def _trainable(ctx: PlanContext) -> None:
    """Trainable parameters (LoRA, expert LoRA, DoRA's magnitudes; or every weight) and their master dtype."""
    s, shape = ctx.setup, ctx.shape
    trainable = shape.total_params if s.full_finetune else shape.lora_params(s.lora_r)
    ctx.expert_lora = [] if s.full_finetune else shape.expert_lora_targets(s.lora_target_parameters)
    trainable += shape.expert_lora_params(s.lora_r, s.lora_target_parameters) if ctx.expert_lora else 0
    if s.use_dora and ctx.lora:  # DoRA's magnitude vectors train beside A and B
        trainable += shape.dora_params()
    ctx.trainable = trainable
    # accelerate upcasts trainable parameters to fp32: FSDP2 with mixed precision and no 4-bit weights; FSDP1 with
    # mixed precision, where our trainer casts them back to the dtype they train in (train.consistency,
    # keep_trainable_in_training_dtype: adapter_dtype="bfloat16" keeps bf16 masters, measured in test_precision.py).
    ours = s.trainer == "hf_fsdp_qlora"
    adapter_dtype = _trained_adapter_dtype(ctx) if ours else s.adapter
    master = adapter_dtype if ctx.lora else s.dtype
    if s.fsdp.version == 2 and ctx.mixed and ctx.quant != "4bit":
        master = "float32"
    if s.fsdp.version == 1 and ctx.mixed and not ours:
        master = "float32"
    ctx.master_b = dtype_bytes(master)


def _trained_adapter_dtype(ctx: PlanContext) -> str:
    """Our trainer's adapter dtype (hf_fsdp_qlora.train.precision): float32 master weights, or the base dtype where
    asked (``adapter_dtype="bfloat16"``, ``--adapter-dtype bfloat16``)."""
    s = ctx.setup
    if s.adapter_dtype not in (None, "float32"):
        return ctx.base_dtype
    return "float32"


def _base_sharding(ctx: PlanContext) -> None:
    """How FSDP shards the quantized bytes, one layer's base bytes, and FSDP1's whole trainable units."""
    s, shape, quant, fsdp = ctx.setup, ctx.shape, ctx.quant, ctx.setup.fsdp
    # Plain accelerate + FSDP1 transformer wrap puts frozen base and LoRA in one flat parameter: FSDP1 allocates
    # gradients for all of it and, under mixed precision, accelerate upcasts all of it to fp32.
    ctx.whole_units_trainable = fsdp.version == 1 and s.trainer == "accelerate" and ctx.lora
    sharded = s.storage not in ("uint8", "int8") or fsdp.version == 1 or s.integer_storage_sharded
    ctx.quant_shard = ctx.shard if quant == "4bit" and sharded else 1
    if quant == "8bit" and s.trainer == "hf_fsdp_qlora":
        ctx.quant_shard = ctx.shard  # our 8-bit route holds the int8 bytes as a parameter FSDP shards (stock: refused)
    if fsdp.version is None and quant:
        ctx.quant_shard = 1
    experts = ctx.experts
    ctx.layer_base = (
        shape.per_layer("linear") * (0.5 if quant == "4bit" else 1 if quant else dtype_bytes(ctx.base_dtype))
        + shape.per_layer("other") * ctx.other_b
        + experts.per_layer_numel * (0.5 if experts.quantized_numel else ctx.other_b)
    )
    if ctx.whole_units_trainable:
        in_layers = ctx.packed + (shape.other_in_layers + shape.expert_params - experts.quantized_numel) * ctx.other_b
        in_layers = in_layers if quant else shape.total_params * ctx.other_b
        ctx.extra_grads = in_layers / ctx.shard
        if ctx.mixed:
            ctx.upcast = 4 / dtype_bytes(s.storage if quant == "4bit" else ctx.base_dtype)
            ctx.extra_grads *= ctx.upcast


def _activations(ctx: PlanContext) -> None:
    """Saved activations with and without checkpointing, and which checkpointing the run applies."""
    s, shape, act, tokens = ctx.setup, ctx.shape, ctx.act, ctx.tokens
    per_layer = layer_activation_bytes(shape, s, act, ctx.lora)
    # Expert LoRA: each routed token's rank-r intermediate per adapted expert weight, per MoE layer.
    per_layer += len(ctx.expert_lora) / max(1, len(shape.moe_layers)) * shape.experts_per_token * s.lora_r * act
    per_layer, all_layers = layer_activations(shape, act, per_layer)
    saved_experts = ctx.experts.saved_numel * act
    final = tokens * (4 * shape.hidden_size + 2 * act * shape.hidden_size)
    transient = tokens * (3 * act * mlp_width(shape) + 2 * act * shape.hidden_size)
    per_layer, all_layers, transient = _long_context(ctx, per_layer, all_layers, transient)
    ctx.with_ckpt = (
        tokens * (shape.num_layers * act * shape.hidden_size + per_layer) + final + transient + saved_experts
    )
    ctx.without_ckpt = tokens * all_layers + final + transient + saved_experts * len(shape.moe_layers)
    ctx.per_layer, ctx.transient, ctx.saved_experts = per_layer, transient, saved_experts
    if s.fsdp.activation_checkpointing:
        ctx.checkpointing = "fsdp"
    elif s.gradient_checkpointing:
        ctx.checkpointing = "trainer"
    elif s.model_checkpointing:
        ctx.checkpointing = "model"


def _long_context(ctx: PlanContext, per_layer: float, all_layers: float, transient: float):
    """Tiled MLP and sequence parallelism (``ctx.tokens`` is already this GPU's share of each sequence).

    Tiled: a dense MLP keeps no intermediates for backward (its gate, up, activation and product: 4 values per
    intermediate channel and token) and its transients are one tile's, recomputed. Sequence parallel: the
    all-to-alls' send and receive buffers of one layer's query, key and value (key/value repeated to the heads).
    """
    s, shape, act, tokens = ctx.setup, ctx.shape, ctx.act, ctx.tokens
    ctx.mlp_tile = mlp_tile_tokens(ctx)
    if ctx.mlp_tile:
        saved = 4 * act * shape.intermediate_size
        per_layer -= saved
        all_layers -= shape.num_layers * saved
        transient += ctx.mlp_tile * 7 * act * shape.intermediate_size - tokens * 3 * act * mlp_width(shape)
    if s.sp_size > 1:
        q = shape.num_heads * shape.head_dim
        transient += 2 * act * tokens * 3 * q
    return per_layer, all_layers, transient


def mlp_tile_tokens(ctx: PlanContext) -> int:
    """The tokens in one tile of the tiled MLP (0: untiled), as hf_fsdp_qlora.train.tiled_mlp cuts them.

    Tiles are cut along the sequence dimension of ``[rows, length, hidden]``, every row of the batch in each tile:
    a tile holds ``rows x tiled_mlp_tokens`` tokens, not ``tiled_mlp_tokens``. A row no longer than one tile runs
    the MLP whole (it keeps its intermediates, as untiled). Rows: the batch, twice for DPO (chosen and rejected
    stacked); length: this GPU's share of each sequence under ``sp_size``.
    """
    s, shape = ctx.setup, ctx.shape
    if not s.tiled_mlp_tokens or shape.experts:
        return 0
    length = math.ceil(s.seq_len / max(1, s.sp_size))
    if length <= s.tiled_mlp_tokens:
        return 0
    return s.batch_size * sequences_factor(ctx.path) * s.tiled_mlp_tokens
