"""What to change when the memory plan does not fit: each lever the run has, ranked by the bytes it saves.

Every lever is a small function of the setup and the plan that returns the setting to change, its value and the
setup with it changed (or None where the run has no such lever). The bytes each saves are the plan's own: the plan
of the changed setup (:func:`~hf_fsdp_qlora.doctor.memory.plan_memory`) against the run's, so the advice follows
the plan's largest terms (activations and logits: checkpointing, activation offloading, the chunked loss, a smaller
micro-batch or a shorter sequence; weights, gradients and optimizer states: 4-bit experts, parameter offload,
more GPUs) and no figure is guessed. A new lever adds a function to :data:`LEVERS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..model_shapes import ModelShape
from .longest import longest_sequence
from .memory import MemoryPlan, format_size, plan_memory, verdict
from .plan_context import planned_loss_path
from .setup import RunSetup

__all__ = ["LEVERS", "Lever", "can_checkpoint", "combined", "ranked_levers"]

# A lever saving less than this share of the plan's total is not worth a line of advice.
MIN_SHARE = 0.01
MIN_SEQ_LEN = 256
MIN_LOSS_CHUNK = 128


@dataclass(frozen=True)
class Lever:
    """One change of setting, the run with it, and (once planned) the per-GPU total it gives."""

    setting: str
    value: str
    setup: RunSetup
    note: str = ""  # said once, where the lever is the finding's setting to change
    total: int = 0
    host: int = 0  # host RAM per process it adds (offloaded activations or parameters)

    @property
    def advice(self) -> str:
        return f"{self.value} ({self.note})" if self.note else self.value

    def text(self, before: int, gpu_memory: int) -> str:
        fits = verdict(self.total, gpu_memory).replace("_", " ")
        host = f", {format_size(self.host)} more host RAM" if self.host > 0 else ""
        return (f"{self.setting} -> {self.value} saves {format_size(before - self.total)} "
                f"({format_size(self.total)} per GPU: {fits}{host})")  # fmt: skip


def can_checkpoint(s: RunSetup, shape: ModelShape | None) -> bool:
    """Whether the run can turn activation checkpointing on: FSDP's wraps each layer in torch's checkpoint wrapper
    whatever the family (JetMoE's layers give bit-equal gradients under it); the Trainer's and the model's need the
    family's ``supports_gradient_checkpointing`` (JetMoE: False, enabling it raises)."""
    return s.fsdp.version is not None or shape is None or shape.checkpointing


def checkpointing(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    if plan.checkpointing != "none" or not can_checkpoint(s, shape):
        return None
    if s.fsdp.version is not None:
        fsdp = dataclasses.replace(s.fsdp, activation_checkpointing=True)
        return Lever("fsdp_config.fsdp_activation_checkpointing", "true", s.replace(fsdp=fsdp))
    return Lever("TrainingArguments.activation_checkpointing", "True", s.replace(gradient_checkpointing=True))


def activation_offloading(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    """Our trainers' argument, or trl's own (SFTConfig / DPOConfig have one); a stock Trainer has none."""
    if s.activation_offloading:
        return None
    if s.trainer_class:
        owner = "DPOConfig" if "DPO" in s.trainer_class else "SFTConfig" if "SFT" in s.trainer_class else None
    else:
        owner = "FSDPQLoRATrainingArguments" if s.trainer == "hf_fsdp_qlora" else None
    if owner is None:
        return None
    return Lever(f"{owner}.activation_offloading", "True", s.replace(activation_offloading=True))


def chunked_loss(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    """The stock loss's whole logits, where our chunked loss can take the run (not a model that transforms its
    logits, not a trainer with a loss of its own)."""
    if (
        plan.loss_path != "stock"
        or s.trainer_class
        or planned_loss_path(s.replace(trainer="hf_fsdp_qlora", loss_path=None), shape)[0] != "ours"
    ):
        return None  # fmt: skip
    changed = s.replace(trainer="hf_fsdp_qlora", loss_path="ours")
    if s.trainer == "hf_fsdp_qlora":
        return Lever("FSDPQLoRATrainingArguments.chunked_loss", "True", changed)
    return Lever("trainer", "FSDPQLoRATrainer", changed, "or FSDPQLoRACallback on yours: the chunked loss")


def loss_chunk(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    if plan.loss_path != "ours" or s.loss_chunk_size <= MIN_LOSS_CHUNK:
        return None
    chunk = max(MIN_LOSS_CHUNK, s.loss_chunk_size // 4)
    return Lever("FSDPQLoRATrainingArguments.loss_chunk_size", str(chunk), s.replace(loss_chunk_size=chunk))


def micro_batch(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    if s.batch_size <= 1:
        return None
    return Lever("per_device_train_batch_size", "1", s.replace(batch_size=1),
                 "raise gradient_accumulation_steps to keep the global batch")  # fmt: skip


def sequence(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    """The longest length whose plan fits (``doctor --longest``'s search), at most the model's positions; where none
    of at least MIN_SEQ_LEN fits, half the length (a lever to combine with others)."""
    if s.seq_len <= MIN_SEQ_LEN:
        return None
    seq, note = 0, "trl's SFTConfig.max_length, or your tokenizer's truncation"
    if s.gpu_memory:
        seq = longest_sequence(shape, s, upper=s.seq_len)
        if shape.max_positions and shape.max_positions > 0:
            seq = min(seq, shape.max_positions)
    if seq >= MIN_SEQ_LEN:
        note = f"the longest that fits; {note}"
    else:
        seq = max(MIN_SEQ_LEN, s.seq_len // 2)
    return Lever("max_length", str(seq), s.replace(seq_len=seq), note)


def experts_4bit(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    """A 4-bit run whose fused MoE experts stay 16-bit (a stock load_in_4bit, or quantize_experts=False)."""
    if not shape.experts or s.quantization != "4bit" or s.quantize_experts:
        return None
    return Lever("load_qlora_model", "quantize_experts=True", s.replace(quantize_experts=True),
                 "the default; under python -m hf_fsdp_qlora.run, HF_FSDP_QLORA_QUANTIZE_EXPERTS unset")  # fmt: skip


def parameter_offload(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    if s.fsdp.version is None or s.fsdp.offload_params:
        return None
    fsdp = dataclasses.replace(s.fsdp, offload_params=True)
    return Lever("fsdp_config.fsdp_offload_params", "true", s.replace(fsdp=fsdp))


def more_gpus(s: RunSetup, plan: MemoryPlan, shape: ModelShape) -> Lever | None:
    if s.fsdp.version is None:
        return None
    gpus = 2 * s.world_size
    return Lever("num_processes", str(gpus), s.replace(num_gpus=gpus),
                 "GPUs sharding the weights, gradients and optimizer states")  # fmt: skip


LEVERS: tuple[Callable[[RunSetup, MemoryPlan, ModelShape], Lever | None], ...] = (
    checkpointing, activation_offloading, chunked_loss, loss_chunk, micro_batch, sequence, experts_4bit,
    parameter_offload, more_gpus,
)  # fmt: skip


def ranked_levers(setup: RunSetup, shape: ModelShape, plan: MemoryPlan) -> list[Lever]:
    """The run's levers, each planned, that save at least MIN_SHARE of the total, the largest saving first."""
    planned = []
    for lever_of in LEVERS:
        lever = lever_of(setup, plan, shape)
        if lever is None:
            continue
        changed = plan_memory(shape, lever.setup)
        # The longest length that fits is the answer to a tight plan however little it saves.
        fitting_length = lever.setting == "max_length" and verdict(changed.total, setup.gpu_memory) == "fits"
        if plan.total - changed.total >= MIN_SHARE * plan.total or fitting_length:
            host = _offloaded(changed) - _offloaded(plan)
            planned.append(dataclasses.replace(lever, total=changed.total, host=host))
    return sorted(planned, key=lambda lever: lever.total)


def _offloaded(plan: MemoryPlan) -> int:
    """Host RAM per process the run holds while training (not while loading)."""
    return plan.host.get("activations_offloaded", 0) + plan.host.get("offloaded", 0)


def _changes(before, after) -> dict:
    """The fields `after` changed from `before` (a dataclass; nested dataclasses field by field)."""
    changes = {}
    for f in dataclasses.fields(before):
        old, new = getattr(before, f.name), getattr(after, f.name)
        if dataclasses.is_dataclass(old) and old != new:
            changes[f.name] = _changes(old, new)
        elif old != new:
            changes[f.name] = new
    return changes


def _apply(setup, changes: dict):
    nested = {k: _apply(getattr(setup, k), v) for k, v in changes.items() if isinstance(v, dict)}
    return dataclasses.replace(setup, **{**changes, **nested})


def combined(setup: RunSetup, shape: ModelShape, levers: list[Lever], gpu_memory: int) -> tuple[int, int]:
    """The levers applied together, largest saving first, until the plan fits: (how many, the total then)."""
    changed, total = setup, 0
    for count, lever in enumerate(levers, start=1):
        changed = _apply(changed, _changes(setup, lever.setup))
        total = plan_memory(shape, changed).total
        if verdict(total, gpu_memory) == "fits":
            break
    return count, total
