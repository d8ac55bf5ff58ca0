"""The per-GPU memory plan of a run, from the model's shapes and the run's settings (no weights read).

Parts, per GPU (bytes), in the order they are reported:

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

import math
from dataclasses import dataclass, field

from ..dtype_names import dtype_bytes
from ..loss_paths import logits_bytes, loss_path, sequences_factor
from ..model_shapes import ModelShape
from .activations import layer_activation_bytes, layer_activations, mlp_width
from .experts_plan import expert_bytes
from .setup import RunSetup

__all__ = ["GIB", "MemoryPlan", "dtype_bytes", "format_size", "parse_gpu_memory", "plan_memory", "planned_loss_path"]

GIB = 1024**3
RUNTIME_OVERHEAD = 1 * GIB
FIT_FRACTION = 0.90
BLOCKSIZE = 64  # bitsandbytes' 4-bit block size
NESTED_BLOCKSIZE = 256
PART_NAMES = (
    "base_quantized",
    "base_quant_state",
    "base_other",
    "adapter",
    "gradients",
    "optimizer",
    "fsdp_gathered",
    "activations",
    "logits_loss",
    "dequant_workspace",
    "runtime_overhead",
)
_OFFLOADED = ("base_quantized", "base_other", "adapter", "gradients", "optimizer")


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
    # and with 16-bit experts (what a stock load_in_4bit holds)
    parameters: dict = field(default_factory=dict)

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
        }


def verdict(total: int, gpu_memory: int | None) -> str:
    if gpu_memory is None:
        return "unknown"
    if total <= FIT_FRACTION * gpu_memory:
        return "fits"
    return "tight" if total <= gpu_memory else "does_not_fit"


def _quant_state_bytes(numel: int, double_quant: bool) -> int:
    blocks = math.ceil(numel / BLOCKSIZE)
    if not double_quant:
        return blocks * 4 + 64  # fp32 absmax + the 16-entry code
    return blocks + math.ceil(blocks / NESTED_BLOCKSIZE) * 4 + 4 + 64 + 1024  # uint8 absmax, nested, codes


def _shard_factor(setup: RunSetup) -> int:
    fsdp = setup.fsdp
    n = setup.world_size
    if fsdp.version is None or fsdp.sharding_strategy == "NO_SHARD":
        return 1
    if "HYBRID" in fsdp.sharding_strategy:
        return max(1, n // max(1, fsdp.num_machines))
    return n


def plan_memory(shape: ModelShape, setup: RunSetup) -> MemoryPlan:
    """The per-GPU memory plan of `setup` for a model of `shape` (see the module docstring)."""
    fsdp = setup.fsdp
    n = setup.world_size
    shard = _shard_factor(setup)
    quant = None if setup.full_finetune else setup.quantization
    lora = not setup.full_finetune
    mixed = setup.effective_mixed_precision != "no"
    path, why = planned_loss_path(setup, shape)
    # DPO runs chosen and rejected sequences through the model in one forward: twice the tokens.
    tokens = setup.batch_size * setup.seq_len * sequences_factor(path)
    notes: list[str] = []
    if why is not None and path == "stock" and setup.trainer == "hf_fsdp_qlora":
        notes.append(f"the run keeps transformers' stock loss (full logits): {why}")
    if path == "dpo":
        notes.append("DPO: chosen and rejected sequences run together, twice batch x seq tokens per forward")

    storage_floating = setup.storage not in ("uint8", "int8")
    # The one dtype our trainer casts every non-quantized parameter to (see hf_fsdp_qlora.dtypes).
    base_dtype = setup.dtype
    if setup.trainer == "hf_fsdp_qlora" and quant == "4bit":
        base_dtype = setup.storage if storage_floating else setup.compute
    compute = base_dtype if setup.trainer == "hf_fsdp_qlora" else setup.compute
    act = dtype_bytes(compute)
    adapter_dtype = base_dtype if setup.trainer == "hf_fsdp_qlora" else setup.adapter

    quantized_numel = sum(lin.numel for lin in shape.linears if lin.quantized) if quant else 0
    experts = expert_bytes(shape, quant == "4bit" and setup.quantize_experts, setup.double_quant, tokens)
    other_numel = shape.total_params - quantized_numel - experts.quantized_numel
    if quant == "4bit":
        packed = sum(math.ceil(lin.numel / 2) for lin in shape.linears if lin.quantized) + experts.packed
        qstate = sum(_quant_state_bytes(lin.numel, setup.double_quant) for lin in shape.linears if lin.quantized)
        qstate += experts.quant_state
    elif quant == "8bit":
        # LLM.int8: one byte per weight; the fp32 row scales (SCB, one per output row) counted whole on every rank.
        packed = quantized_numel
        qstate = sum(4 * lin.out_features for lin in shape.linears if lin.quantized)
    else:
        packed = qstate = 0
    trainable = shape.total_params if setup.full_finetune else shape.lora_params(setup.lora_r)
    expert_lora = [] if setup.full_finetune else shape.expert_lora_targets(setup.lora_target_parameters)
    trainable += shape.expert_lora_params(setup.lora_r, setup.lora_target_parameters) if expert_lora else 0
    if setup.use_dora and lora:  # DoRA's magnitude vectors train beside A and B
        trainable += shape.dora_params()

    # Master dtype of the trainable parameters (accelerate's upcasts; see the module docstring).
    master = adapter_dtype if lora else setup.dtype
    if fsdp.version == 2 and mixed and quant != "4bit":
        master = "float32"
    if fsdp.version == 1 and mixed:
        master = "float32"
    master_b = dtype_bytes(master)

    # Plain accelerate + FSDP1 transformer wrap puts frozen base and LoRA in one flat parameter: FSDP1 allocates
    # gradients for all of it and, under mixed precision, accelerate upcasts all of it to fp32.
    whole_units_trainable = fsdp.version == 1 and setup.trainer == "accelerate" and lora
    sharded = storage_floating or fsdp.version == 1 or setup.integer_storage_sharded
    quant_shard = shard if quant == "4bit" and sharded else 1
    if quant == "8bit" and setup.trainer == "hf_fsdp_qlora":
        quant_shard = shard  # our 8-bit route holds the int8 bytes as a parameter FSDP shards (stock: refused)
    if fsdp.version is None and quant:
        quant_shard = 1
    base_quantized = packed / quant_shard
    other_b = dtype_bytes(base_dtype)
    base_other = (other_numel * other_b if lora else 0) / shard
    layer_base = (
        shape.per_layer("linear") * (0.5 if quant == "4bit" else 1 if quant else dtype_bytes(base_dtype))
        + shape.per_layer("other") * other_b
        + experts.per_layer_numel * (0.5 if experts.quantized_numel else other_b)
    )
    extra_grads = 0.0
    if whole_units_trainable:
        in_layers = packed + (shape.other_in_layers + shape.expert_params - experts.quantized_numel) * other_b
        in_layers = in_layers if quant else shape.total_params * other_b
        extra_grads = in_layers / shard
        if mixed:
            upcast = 4 / dtype_bytes(setup.storage if quant == "4bit" else base_dtype)
            base_quantized *= upcast
            extra_grads *= upcast
            notes.append(
                "accelerate upcasts every FSDP1 unit holding a trainable parameter to fp32, 4-bit bytes included"
            )
    adapter = (trainable * master_b / shard) if lora else 0
    if setup.full_finetune:
        base_other = trainable * master_b / shard
    gradients = trainable * master_b / shard + extra_grads
    optimizer = (
        {"adamw": 2 * master_b, "adamw_8bit": 2, "sgd": 0}.get(setup.optimizer, 2 * master_b) * trainable / shard
    )
    if setup.optimizer != "sgd":  # AdamW's fp32 `step` counter, one per trainable tensor on every rank
        per_adapted = 3 if setup.use_dora else 2  # A, B (and DoRA's magnitude)
        adapted = per_adapted * sum(lin.lora for lin in shape.linears) + 2 * len(expert_lora)
        optimizer += 4 * (adapted if lora else shape.num_tensors)
    if fsdp.version is None:
        gradients *= 2  # DDP's gradient buckets hold a second copy

    # FSDP's unsharded working copies.
    gathered = 0.0
    if fsdp.version is not None:
        gather_b = dtype_bytes(fsdp.param_dtype) if fsdp.param_dtype and not quant else other_b
        root = shape.other_outside * gather_b + sum(lin.numel * gather_b for lin in shape.linears if lin.layer is None)
        layer = layer_base if quant else (shape.per_layer("linear") + shape.per_layer("other")
                                          + shape.per_layer("experts")) * gather_b  # fmt: skip
        no_wrap = fsdp.auto_wrap_policy == "NO_WRAP" and not setup.peft_wraps
        if no_wrap or fsdp.sharding_strategy == "SHARD_GRAD_OP":
            gathered = packed + other_numel * gather_b if quant else shape.total_params * gather_b
            notes.append(
                "the whole model is gathered at once (NO_WRAP or SHARD_GRAD_OP / reshard_after_forward=False)"
            )
        else:
            gathered = root + 2 * layer
        if setup.full_finetune:
            gathered += max(root, layer)  # the unsharded gradient of the largest unit, before reduce-scatter
        elif whole_units_trainable:
            gathered += layer

    per_layer = layer_activation_bytes(shape, setup, act, lora)
    # Expert LoRA: each routed token's rank-r intermediate per adapted expert weight, per MoE layer.
    per_layer += len(expert_lora) / max(1, len(shape.moe_layers)) * shape.experts_per_token * setup.lora_r * act
    per_layer, all_layers = layer_activations(shape, act, per_layer)
    saved_experts = experts.saved_numel * act  # one layer's routed experts, dequantized, kept for backward
    final = tokens * (4 * shape.hidden_size + 2 * act * shape.hidden_size)
    transient = tokens * (3 * act * mlp_width(shape) + 2 * act * shape.hidden_size)
    with_ckpt = tokens * (shape.num_layers * act * shape.hidden_size + per_layer) + final + transient + saved_experts
    without_ckpt = tokens * all_layers + final + transient + saved_experts * len(shape.moe_layers)
    if fsdp.activation_checkpointing:
        checkpointing = "fsdp"
    elif setup.gradient_checkpointing:
        checkpointing = "trainer"
    elif setup.model_checkpointing:
        checkpointing = "model"
    else:
        checkpointing = "none"
    activations = with_ckpt if checkpointing != "none" else without_ckpt
    offloaded_activations = 0.0
    if setup.activation_offloading:
        # What stays: the layer being back-propagated (brought back, or recomputed under checkpointing) and the
        # transients; the final norm / LM-head inputs move too. The logits stay: they are the forward's output.
        on_gpu = tokens * per_layer + transient + saved_experts
        offloaded_activations = max(0.0, activations - on_gpu)
        activations -= offloaded_activations
    # A full fine-tune trains the plain nn.Linear head: our loss holds its fp32 gradient from forward to backward.
    logits = logits_bytes(path, tokens, shape.vocab_size, act, shape.hidden_size, setup.loss_chunk_size,
                          head_trained=setup.full_finetune)  # fmt: skip
    workspace = max((lin.numel for lin in shape.linears if lin.quantized), default=0) * act if quant else 0
    workspace = max(workspace, experts.workspace_numel * act)
    if setup.use_dora and lora:
        workspace = max(workspace, shape.dora_workspace() * act)
        notes.append("DoRA: each adapted Linear's weight is dequantized for its norm in every forward")

    parts = {
        "base_quantized": base_quantized,
        "base_quant_state": qstate,
        "base_other": base_other,
        "adapter": adapter,
        "gradients": gradients,
        "optimizer": optimizer,
        "fsdp_gathered": gathered,
        "activations": activations,
        "logits_loss": logits,
        "dequant_workspace": workspace,
        "runtime_overhead": RUNTIME_OVERHEAD,
    }
    local = {
        "params_quantized": base_quantized,
        "quant_state": qstate,
        "params_other": base_other if lora else 0,
        "params_trainable": adapter if lora else base_other,
        "gradients": gradients,
        "optimizer": optimizer,
    }
    host = {"activations_offloaded": int(offloaded_activations)} if setup.activation_offloading else {}
    if fsdp.offload_params and fsdp.version is not None:
        moved = sum(parts[name] for name in _OFFLOADED)
        for name in _OFFLOADED:
            parts[name] = 0
        host["offloaded"] = int(moved)
    full_model = packed + qstate + other_numel * other_b if quant else shape.total_params * dtype_bytes(setup.dtype)
    if quant:
        # transformers 5.x has no rank-0-only loading path for bitsandbytes: every rank loads and quantizes the
        # whole model on its own GPU before FSDP shards it, one 16-bit weight at a time.
        largest = max([lin.numel for lin in shape.linears] + [experts.workspace_numel])
        load_peak = full_model + largest * dtype_bytes(setup.dtype) + RUNTIME_OVERHEAD
        if experts.quantized_numel and setup.trainer == "hf_fsdp_qlora":
            # load_qlora_model loads the 16-bit experts on the CPU and packs them expert by expert onto the GPU
            # (loading/_experts_map.py): the GPU adds one layer's packed experts while they are stacked; host RAM
            # holds the 16-bit experts not packed yet, all of them at first, on every rank.
            load_peak += experts.layer_packed
            host["loading"] = int(experts.quantized_numel * dtype_bytes(setup.dtype))
        elif experts.quantized_numel:  # a stock load: the experts arrive 16-bit on the GPU, packed after the load
            load_peak += experts.quantized_numel * dtype_bytes(setup.dtype) - experts.packed - experts.quant_state
    else:
        load_peak = 0  # a 16-bit model loads on the CPU; FSDP moves one shard at a time
        host["loading"] = int(full_model)
    weights = trainable * master_b if not setup.full_finetune else shape.total_params * master_b
    ckpt = {"weights": int(weights), "optimizer": 0 if setup.save_only_model else int(optimizer * shard)}
    ckpt["total"] = ckpt["weights"] + ckpt["optimizer"]
    params = {"total": shape.total_params, "active": shape.active_params, "experts": shape.expert_params}
    if shape.experts:
        params["experts_bytes"] = experts.packed + experts.quant_state + (
            shape.expert_params - experts.quantized_numel) * dtype_bytes(setup.dtype)  # fmt: skip
        params["experts_bytes_16bit"] = shape.expert_params * dtype_bytes(setup.dtype)
        if experts.quantized_numel:  # what the same run needs with the experts a stock load_in_4bit leaves 16-bit
            params["total_with_16bit_experts"] = plan_memory(shape, setup.replace(quantize_experts=False)).total
    return MemoryPlan(
        parameters=params,
        num_gpus=n,
        gpu_memory=setup.gpu_memory,
        parts={k: int(v) for k, v in parts.items()},
        host=host,
        checkpointing=checkpointing,
        activations_with_checkpointing=int(with_ckpt),
        activations_without_checkpointing=int(without_ckpt),
        load_peak_per_gpu=int(load_peak),
        checkpoint=ckpt,
        shard={k: int(v) for k, v in local.items()},
        notes=notes,
        loss_path=path,
    )


def planned_loss_path(setup: RunSetup, shape: ModelShape) -> tuple[str, str | None]:
    """The loss path the run takes, and why it is not ours: the predicate the trainer asks at run time."""
    if setup.loss_path is not None:
        return setup.loss_path, None
    return loss_path(setup.trainer, setup.trainer_class, config=shape.logit_transforms)
