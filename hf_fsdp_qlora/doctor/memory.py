"""The per-GPU memory plan of a run, from the model's shapes and the run's settings (no weights read).

The plan is a table of terms (:mod:`.terms`), each a small function of the figures :mod:`.plan_context` derives
once from the setup and the shape; :func:`plan_memory` sums them. A new capability adds a term, not a branch here.
Terms (parts), per GPU (bytes), in the order they are reported:

* ``base_quantized``: packed 4-bit weights (half a byte per weight; the storage dtype only changes how many
  elements hold them; MoE experts too, see :mod:`.experts_plan`) or int8 weights (one byte per weight), sharded
  1/N by FSDP. Integer 4-bit storage under FSDP2 stays unsharded (accelerate excludes it from sharding); 8-bit
  weights are sharded on our route (``load_qlora_model(path, bits=8)``), not on the stock one (refused).
* ``base_quant_state``: bitsandbytes' quantization constants (absmax per 64 weights, the second-level constants
  with double quant, the code tables; for 8 bits the fp32 row scales). They are module attributes or buffers, not
  parameters: every GPU holds all of them.
* ``base_other``: embeddings, norms, biases, the output head (full fine-tune: every weight), sharded 1/N.
* ``adapter``, ``gradients``, ``optimizer``: trainable parameters, their gradients and AdamW's two states,
  sharded 1/N, in the master dtype (fp32 where accelerate upcasts: FSDP2 with mixed precision and no 4-bit
  weights; FSDP1 with mixed precision, for every unit that holds a trainable parameter).
* ``fsdp_gathered``: the unsharded copies FSDP keeps while computing: the root unit (everything outside the
  decoder layers, kept gathered through forward and backward), two decoder layers (current + prefetched), and
  the unsharded gradient of the largest trainable unit before reduce-scatter.
* ``activations``: saved activations for ``batch x seq`` tokens (Llama-style decoder layer: RMSNorm, attention,
  gated MLP, LoRA inputs and dropout masks), with checkpointing (each layer's input plus one recomputed layer)
  or without (every layer), plus backward transients.
  With ``activation_offloading`` the tensors saved outside checkpointed regions (each layer's input, or every
  saved tensor without checkpointing) wait in host RAM (``host["activations_offloaded"]``); the GPU keeps one
  layer's saved tensors as backward brings them back (or recomputes them), and the transients.
* ``logits_loss``: the logits and the loss's fp32 working memory, as the run's loss path holds them
  (:mod:`hf_fsdp_qlora.loss_paths`, which also decides the path: the trainer, its class and the model's config, as
  the trainer decides it at run time): ``stock`` the whole ``batch x seq x vocab`` logits, their fp32 copy and
  log-softmax/gradient; ``ours`` one ``loss_chunk_size`` chunk of them plus the labelled hidden states and their
  gradient, and for a full fine-tune the fp32 ``[vocab x hidden]`` head gradient held from forward to backward;
  ``sft``/``dpo`` one tile of trl's fused LM head (DPO also doubles the tokens of the activations).
* ``dequant_workspace``: the largest quantized weight (or one expert's) dequantized for one matmul. The routed
  experts' dequantized weights autograd keeps for backward count in ``activations``.
* ``runtime_overhead``: CUDA context, cuBLAS workspace, NCCL buffers (a fixed 1 GiB).

With ``fsdp_offload_params`` the sharded parameters, gradients and optimizer states live in host RAM
(``host``); the GPU keeps the gathered units, activations and the quantization constants.

The verdict compares the total with ``gpu_memory``: ``fits`` up to 90% (the caching allocator's fragmentation
needs the rest), ``tight`` up to 100%, ``does_not_fit`` above, ``unknown`` without ``gpu_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dtype_names import dtype_bytes
from ..model_shapes import ModelShape
from .plan_context import PlanContext, plan_context, planned_loss_path
from .setup import RunSetup
from .terms import RUNTIME_OVERHEAD, TERMS, Term

__all__ = ["GIB", "MemoryPlan", "dtype_bytes", "format_size", "parse_gpu_memory", "plan_memory", "planned_loss_path"]

GIB = 1024**3
FIT_FRACTION = 0.90
PART_NAMES = tuple(row.name for row in TERMS)


def parse_gpu_memory(text) -> int:
    """``"80GB"``, ``"80GiB"``, ``"81920MiB"``, ``"24"`` (GiB) -> bytes.

    GPU memory is sold in binary units whatever the label says (an "80GB" A100 has 81920 MiB), so GB and GiB
    both mean 2**30 bytes here.
    """
    value = str(text).strip().upper().replace(" ", "")
    units = {
        "TIB": 1024**4,
        "TB": 1024**4,
        "GIB": GIB,
        "GB": GIB,
        "G": GIB,
        "MIB": 1024**2,
        "MB": 1024**2,
        "M": 1024**2,
    }
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * factor)
    return int(float(value) * GIB)


def format_size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


@dataclass
class MemoryPlan:
    """Per-GPU bytes by part, host bytes per process, and the verdict. See the module docstring."""

    num_gpus: int
    gpu_memory: int | None
    parts: dict[str, int]
    host: dict[str, int]
    checkpointing: str  # "fsdp", "trainer", "model" or "none"
    activations_with_checkpointing: int
    activations_without_checkpointing: int
    load_peak_per_gpu: int
    checkpoint: dict[str, int]
    # per-rank local shards of persistent state, for comparison with a measured run
    shard: dict[str, int]
    notes: list[str] = field(default_factory=list)
    loss_path: str = "ours"  # the loss path planned (hf_fsdp_qlora.loss_paths)
    # total / active (per token) / expert parameters, and for MoE the experts' bytes and the per-GPU total as held
    # and with 16-bit experts (what a stock load_in_4bit holds); for a multimodal model its towers' (16-bit, frozen)
    parameters: dict = field(default_factory=dict)
    # the table's terms in report order: name, bytes per GPU, host bytes per process, reason (see .terms)
    terms: list[dict] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def total_if(self, checkpointing: bool | None = None) -> int:
        """The total with the activations of the other checkpointing choice."""
        if checkpointing is None:
            return self.total
        if self.host.get("activations_offloaded"):
            return self.total  # offloaded: the GPU keeps one layer's worth either way
        acts = self.activations_with_checkpointing if checkpointing else self.activations_without_checkpointing
        return self.total - self.parts["activations"] + acts

    @property
    def verdict(self) -> str:
        return verdict(self.total, self.gpu_memory)

    def to_dict(self) -> dict:
        return {
            "unit": "bytes",
            "num_gpus": self.num_gpus,
            "gpu_memory": self.gpu_memory,
            "per_gpu": {**self.parts, "total": self.total},
            "host_per_process": self.host,
            "activations": {
                "checkpointing": self.checkpointing,
                "with_checkpointing": self.activations_with_checkpointing,
                "without_checkpointing": self.activations_without_checkpointing,
            },
            "offload": {"enabled": bool(self.host.get("offloaded")), "moved_to_host": self.host.get("offloaded", 0)},
            "load_peak_per_gpu": self.load_peak_per_gpu,
            "checkpoint": self.checkpoint,
            "local_shard": self.shard,
            "parameters": self.parameters,
            "verdict": self.verdict,
            "headroom": None if self.gpu_memory is None else self.gpu_memory - self.total,
            "notes": self.notes,
            "terms": self.terms,
        }


def verdict(total: int, gpu_memory: int | None) -> str:
    if gpu_memory is None:
        return "unknown"
    if total <= FIT_FRACTION * gpu_memory:
        return "fits"
    return "tight" if total <= gpu_memory else "does_not_fit"


def plan_memory(shape: ModelShape, setup: RunSetup) -> MemoryPlan:
    """The per-GPU memory plan of `setup` for a model of `shape`: the sum of the table's terms (:mod:`.terms`)."""
    ctx = plan_context(shape, setup)
    terms = [row.term(ctx) for row in TERMS]
    notes = ctx.notes + [note for term in terms for note in term.notes]
    parts = {term.name: term.bytes for term in terms}
    local = {
        "params_quantized": parts["base_quantized"],
        "quant_state": parts["base_quant_state"],
        "params_other": parts["base_other"] if ctx.lora else 0,
        "params_trainable": parts["adapter"] if ctx.lora else parts["base_other"],
        "gradients": parts["gradients"],
        "optimizer": parts["optimizer"],
    }
    host = _host(ctx, terms)
    load_peak, loading = _loading(ctx)
    if loading is not None:
        host["loading"] = loading
    return MemoryPlan(
        parameters=_parameters(ctx),
        num_gpus=setup.world_size,
        gpu_memory=setup.gpu_memory,
        parts={term.name: int(term.bytes) for term in terms},
        host=host,
        checkpointing=ctx.checkpointing,
        activations_with_checkpointing=int(ctx.with_ckpt),
        activations_without_checkpointing=int(ctx.without_ckpt),
        load_peak_per_gpu=int(load_peak),
        checkpoint=_checkpoint(ctx, parts["optimizer"]),
        shard={k: int(v) for k, v in local.items()},
        notes=notes,
        loss_path=ctx.path,
        terms=[term.to_dict() for term in terms],
    )


def _host(ctx: PlanContext, terms: list[Term]) -> dict[str, int]:
    """Host RAM per process: offloaded activations, and with ``fsdp_offload_params`` the offloadable terms, which
    then take no GPU memory (in place: the terms' bytes move to their host bytes)."""
    host = {"activations_offloaded": int(terms[PART_NAMES.index("activations")].host_bytes)}
    if not ctx.setup.activation_offloading:
        host = {}
    fsdp = ctx.setup.fsdp
    if fsdp.offload_params and fsdp.version is not None:
        moved = [term for term, row in zip(terms, TERMS) if row.offloadable]
        host["offloaded"] = int(sum(term.bytes for term in moved))
        for term in moved:
            term.host_bytes, term.bytes = term.bytes, 0
            term.reason += "; offloaded (fsdp_offload_params)"
    return host


def _loading(ctx: PlanContext) -> tuple[float, int | None]:
    """The GPU peak while loading, and the host RAM per process it takes (None: none planned)."""
    s, shape, experts = ctx.setup, ctx.shape, ctx.experts
    if not ctx.quant:
        full_model = shape.total_params * dtype_bytes(s.dtype)
        return 0, int(full_model)  # a 16-bit model loads on the CPU; FSDP moves one shard at a time
    full_model = ctx.packed + ctx.qstate + ctx.other_numel * ctx.other_b
    # transformers 5.x has no rank-0-only loading path for bitsandbytes: every rank loads and quantizes the
    # whole model on its own GPU before FSDP shards it, one 16-bit weight at a time.
    largest = max([lin.numel for lin in shape.linears] + [experts.workspace_numel])
    load_peak = full_model + largest * dtype_bytes(s.dtype) + RUNTIME_OVERHEAD
    if experts.quantized_numel and s.trainer == "hf_fsdp_qlora":
        # load_qlora_model streams the experts from the checkpoint into 4 bits one layer at a time
        # (experts/stream.py): the GPU adds one layer's packed experts while they are stacked. Host RAM per
        # process, with or without low_cpu_ram: at most the 4-bit model (where it stays on the host: a CPU run, or
        # before it moves to the GPU), one layer's 16-bit experts and their packed bytes being stacked, and the
        # process's own runtime (Python, torch, CUDA host state).
        host = full_model + experts.per_layer_numel * dtype_bytes(s.dtype) + experts.layer_packed + RUNTIME_OVERHEAD
        return load_peak + experts.layer_packed, int(host)
    if experts.quantized_numel:  # a stock load: the experts arrive 16-bit on the GPU, packed after the load
        load_peak += experts.quantized_numel * dtype_bytes(s.dtype) - experts.packed - experts.quant_state
    return load_peak, None


def _checkpoint(ctx: PlanContext, optimizer: float) -> dict[str, int]:
    """Bytes each checkpoint writes, all ranks together: the trained weights and (unless save_only_model) the
    optimizer state."""
    weights = ctx.trainable * ctx.master_b if not ctx.setup.full_finetune else ctx.shape.total_params * ctx.master_b
    ckpt = {"weights": int(weights), "optimizer": 0 if ctx.setup.save_only_model else int(optimizer * ctx.shard)}
    ckpt["total"] = ckpt["weights"] + ckpt["optimizer"]
    return ckpt


def _parameters(ctx: PlanContext) -> dict:
    """Total / active / expert parameters; for MoE the experts' bytes as held and in 16 bits, and the per-GPU total
    with the experts a stock load_in_4bit leaves 16-bit."""
    shape, s, experts = ctx.shape, ctx.setup, ctx.experts
    params = {"total": shape.total_params, "active": shape.active_params, "experts": shape.expert_params}
    if shape.towers:  # a multimodal model's towers and projectors: counted in the total, held 16-bit and frozen
        params["towers"] = shape.tower_params
        params["towers_bytes"] = shape.tower_params * dtype_bytes(s.dtype)
    if shape.experts:
        params["experts_bytes"] = experts.packed + experts.quant_state + (
            shape.expert_params - experts.quantized_numel) * dtype_bytes(s.dtype)  # fmt: skip
        params["experts_bytes_16bit"] = shape.expert_params * dtype_bytes(s.dtype)
        if experts.quantized_numel:
            params["total_with_16bit_experts"] = plan_memory(shape, s.replace(quantize_experts=False)).total
    return params
