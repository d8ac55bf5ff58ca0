"""The doctor's output: a stable JSON document and a readable table (schema in :mod:`hf_fsdp_qlora.doctor`)."""

from __future__ import annotations

import textwrap

from .checks import Diagnosis
from .memory import format_size

__all__ = ["SCHEMA_VERSION", "render", "to_json"]

SCHEMA_VERSION = 1

_SETUP_KEYS = (
    "model", "quantization", "full_finetune", "dtype", "quant_storage", "compute_dtype", "adapter_dtype",
    "lora_r", "use_dora", "trainer", "loss_path", "seq_len", "batch_size", "gradient_checkpointing", "optimizer", "num_gpus",
    "gpu_memory", "device_map", "quantize_experts", "lora_target_parameters",
)  # fmt: skip


def to_json(diagnosis: Diagnosis) -> dict:
    """The JSON document of a diagnosis (see the schema in :mod:`hf_fsdp_qlora.doctor`)."""
    s = diagnosis.setup
    f = s.fsdp
    setup = {key: getattr(s, key) for key in _SETUP_KEYS}
    setup.update(
        loss_path=diagnosis.plan.loss_path if diagnosis.plan else s.effective_loss_path,
        quant_storage=s.storage if s.quantization == "4bit" else None,
        compute_dtype=s.compute,
        adapter_dtype=None if s.full_finetune else s.adapter,
        num_gpus=s.world_size,
        mixed_precision=s.effective_mixed_precision,
        fsdp={
            "version": f.version,
            "source": f.source,
            "sharding_strategy": f.sharding_strategy,
            "auto_wrap_policy": f.auto_wrap_policy,
            "transformer_cls_to_wrap": f.transformer_cls_to_wrap,
            "offload_params": f.offload_params,
            "use_orig_params": f.use_orig_params,
            "activation_checkpointing": f.activation_checkpointing,
            "state_dict_type": f.state_dict_type,
        },
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": not diagnosis.errors,
        "exit_code": diagnosis.exit_code,
        "counts": {sev: sum(x.severity == sev for x in diagnosis.findings) for sev in ("error", "warning", "info")},
        "setup": setup,
        "findings": [x.to_dict() for x in diagnosis.findings],
        "memory": diagnosis.plan.to_dict() if diagnosis.plan is not None else None,
    }


def _wrap(text: str, width: int, indent: str) -> str:
    return textwrap.fill(text, width=width, initial_indent=indent, subsequent_indent=indent)


def _parameters(params: dict) -> list[str]:
    """The mixture-of-experts lines of the memory plan: parameters, and the experts' bytes as held and in 16 bits."""
    if not params.get("experts"):
        return []
    line = (f"  parameters: {params['total'] / 1e9:.2f}B total, {params['active'] / 1e9:.2f}B active per token, "
            f"experts {params['experts'] / 1e9:.2f}B: {format_size(params['experts_bytes'])} as held "
            f"({format_size(params['experts_bytes_16bit'])} in 16 bits)")  # fmt: skip
    lines = [line]
    if "total_with_16bit_experts" in params:
        lines.append(f"  with 16-bit experts (a stock load_in_4bit): {format_size(params['total_with_16bit_experts'])}"
                     " per GPU")  # fmt: skip
    return lines


def _terms(plan) -> list[str]:
    """One line per term that takes memory: its name, bytes per GPU, why (and its host RAM where it has some)."""
    lines = []
    for term in plan.terms:
        if not (term["bytes"] or term["host_bytes"]):
            continue
        host = f" (host RAM {format_size(term['host_bytes'])})" if term["host_bytes"] else ""
        lines.append(f"  {term['name']:<20} {format_size(term['bytes']):>12}  {term['reason']}{host}")
    return lines


def render(diagnosis: Diagnosis, width: int = 100) -> str:
    """A human-readable report: the setup line, the findings table, the memory table and the verdict."""
    s, plan = diagnosis.setup, diagnosis.plan
    lines = []
    mode = "full fine-tune" if s.full_finetune else {"4bit": "QLoRA (4-bit)", "8bit": "LoRA on 8-bit"}.get(
        s.quantization, "LoRA on a 16-bit base")  # fmt: skip
    fsdp = f"FSDP{s.fsdp.version}" if s.fsdp.version else "no FSDP"
    lines.append(f"hf-fsdp-qlora doctor: {s.model or 'model'} | {mode} | {fsdp} | {s.world_size} GPU(s) | "
                 f"trainer {s.trainer} | loss {plan.loss_path if plan else s.effective_loss_path} | batch {s.batch_size} x {s.seq_len} tokens")  # fmt: skip
    lines.append("")
    if diagnosis.findings:
        lines.append(f"{'SEVERITY':<8}  {'CHECK':<40}  SETTING -> VALUE")
        for x in diagnosis.findings:
            lines.append(f"{x.severity.upper():<8}  {x.id:<40}  {x.setting} -> {x.value}")
            lines.append(_wrap(x.problem, width, " " * 10))
    else:
        lines.append("No findings.")
    if plan is not None:
        lines.append("")
        lines.append(f"Memory plan per GPU ({plan.num_gpus} GPU(s), activations: checkpointing={plan.checkpointing})")
        lines.extend(_parameters(plan.parameters))
        lines.extend(_terms(plan))
        lines.append(f"  {'total':<20} {format_size(plan.total):>12}")
        lines.append(f"  activations with / without checkpointing: {format_size(plan.activations_with_checkpointing)}"
                     f" / {format_size(plan.activations_without_checkpointing)}")  # fmt: skip
        if plan.host.get("offloaded"):
            lines.append(f"  offloaded to host RAM per process: {format_size(plan.host['offloaded'])}")
        if plan.host.get("activations_offloaded"):
            lines.append(
                f"  activations offloaded to host RAM per process: {format_size(plan.host['activations_offloaded'])}"
            )
        if plan.load_peak_per_gpu:
            lines.append(f"  loading peak per GPU (whole model as loaded): {format_size(plan.load_peak_per_gpu)}")
        if plan.host.get("loading"):
            lines.append(f"  host RAM per process while loading: {format_size(plan.host['loading'])}")
        lines.append(f"  checkpoint: weights {format_size(plan.checkpoint['weights'])}, optimizer "
                     f"{format_size(plan.checkpoint['optimizer'])}")  # fmt: skip
        gpu = format_size(plan.gpu_memory) if plan.gpu_memory else "unknown (pass --gpu-memory)"
        lines.append(f"  GPU memory: {gpu} -> verdict: {plan.verdict.replace('_', ' ').upper()}")
        for note in plan.notes:
            lines.append(_wrap(f"note: {note}", width, "  "))
    errors = len(diagnosis.errors)
    lines.append("")
    lines.append(f"{errors} error(s): " + ("fix them before launching." if errors else "ready to launch."))
    return "\n".join(lines)
