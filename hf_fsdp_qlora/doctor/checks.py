"""The doctor's checks: every known way a QLoRA/FSDP setup fails, from its settings alone, before launch.

One implementation serves three callers: ``hf-fsdp-qlora doctor`` (settings from an accelerate YAML and a
config.json), :func:`check_setup` in Python, and our trainers, which run the same checks on the live model and
FSDP plugin before wrapping and raise on errors (:func:`hf_fsdp_qlora.train.consistency.make_fsdp_consistent`).

Each :class:`Finding` says what is wrong, the setting to change and the value to use. Severity depends on the
trainer: ``hf_fsdp_qlora`` fixes dtype and ``use_orig_params`` problems itself (``info``), a stock
``transformers.Trainer`` (or trl trainer) or a plain accelerate loop fails on them (``error``). Which failure
each rule predicts, and that the run really fails or trains, is tested against real 2-rank FSDP runs on CPU
(``tests/test_doctor.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..loss_paths import LOSS_PATHS
from ..model_shapes import ModelShape, apply_checkpoint_quantization, model_shape
from ._launch_rules import (
    checkpoint_rules,
    checkpointing_rules,
    data_rules,
    device_map_rule,
    launcher_rules,
    memory_rules,
    sequence_parallel_rule,
    wrap_rules,
)
from ._rules import Context, dtype_rules, experts_rule, quantization_rules, requires_grad_rule
from .memory import MemoryPlan, plan_memory
from .setup import (
    TRAINERS,
    RunSetup,
    SetupInputError,
    facts_from_model,
    fsdp_from_plugin,
    read_accelerate_config,
)

# in report order
RULES = (
    launcher_rules,
    quantization_rules,
    experts_rule,
    dtype_rules,
    requires_grad_rule,
    device_map_rule,
    wrap_rules,
    checkpointing_rules,
    sequence_parallel_rule,
    memory_rules,
    checkpoint_rules,
    data_rules,
)


__all__ = ["SEVERITIES", "Diagnosis", "Finding", "check_setup", "diagnose", "raise_for_errors"]

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """One problem (or one thing the trainer fixes for you).

    Attributes:
        id: stable identifier, e.g. ``"fsdp1-integer-storage"``.
        severity: ``"error"`` (the run fails or trains wrong), ``"warning"`` (it runs, badly) or ``"info"``.
        problem: what is wrong and why.
        setting: the setting to change (a YAML key, a ``TrainingArguments`` field, a loading argument).
        value: the value to use.
    """

    id: str
    severity: str
    problem: str
    setting: str
    value: str

    @property
    def message(self) -> str:
        return f"{self.problem} Set {self.setting} to {self.value}."

    def to_dict(self) -> dict:
        return {"id": self.id, "severity": self.severity, "problem": self.problem, "setting": self.setting,
                "value": self.value}  # fmt: skip


@dataclass
class Diagnosis:
    """Everything the doctor found about one setup: the resolved settings, the findings, the memory plan."""

    setup: RunSetup
    findings: list[Finding] = field(default_factory=list)
    plan: MemoryPlan | None = None
    shape: ModelShape | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0


def _build_setup(model, accelerate_config, fsdp_plugin, settings: dict) -> RunSetup:
    known = set(RunSetup.__dataclass_fields__) - {"fsdp"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"check_setup() got unknown settings {unknown}; known: {sorted(known)}")
    setup = RunSetup()
    if accelerate_config is not None:
        setup.fsdp = read_accelerate_config(accelerate_config)
    if fsdp_plugin is not None:
        setup.fsdp = fsdp_from_plugin(fsdp_plugin)
    if model is not None and hasattr(model, "named_parameters"):
        for key, value in facts_from_model(model).items():
            setattr(setup, key, value)
    elif model is not None:
        setup.model = str(model)
    for key, value in settings.items():
        setattr(setup, key, value)
    if model is not None and not hasattr(model, "named_parameters"):
        apply_checkpoint_quantization(setup, model)
    if fsdp_plugin is not None and setup.peft_wraps and hasattr(model, "peft_config"):
        # Under FSDP1 Trainer installs peft's fsdp_auto_wrap_policy, which takes the layer classes from
        # accelerate's launch environment (set from the YAML), not from the plugin.
        classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
        setup.fsdp.transformer_cls_to_wrap = [c for c in classes.split(",") if c] if classes else None
    if setup.trainer not in TRAINERS:
        raise SetupInputError(f"trainer={setup.trainer!r}: use 'hf_fsdp_qlora', 'transformers' or 'accelerate'.")
    if setup.loss_path is not None and setup.loss_path not in LOSS_PATHS:
        raise SetupInputError(f"loss_path={setup.loss_path!r}: use one of {', '.join(map(repr, LOSS_PATHS))}.")
    if setup.full_finetune and setup.quantization:
        raise SetupInputError(
            "A full fine-tune trains every weight: it cannot load them quantized. Drop load_in_4bit/8bit."
        )
    return setup


def _live_classes(model) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def diagnose(model=None, *, accelerate_config=None, fsdp_plugin=None, **settings) -> Diagnosis:
    """Run every check on a setup, and plan its memory when the model's shapes are known.

    Args:
        model: a model directory or config.json (shapes from the config, built on the meta device), a
            transformers config, or a loaded model (its quantization, dtypes and adapters are read from it).
        accelerate_config: a YAML path, a shipped config name or the YAML's dict.
        fsdp_plugin: a live ``FullyShardedDataParallelPlugin`` (what the trainer passes).
        **settings: fields of :class:`~hf_fsdp_qlora.doctor.setup.RunSetup` (``quantization="4bit"``,
            ``trainer="transformers"``, ``seq_len=4096``, ``gpu_memory=80 * 2**30``, ...).

    Returns:
        A :class:`Diagnosis`.

    Raises:
        SetupInputError: unusable input (not an accelerate config, unknown key, no config.json).
        TypeError: an unknown setting name.
    """
    setup = _build_setup(model, accelerate_config, fsdp_plugin, settings)
    shape = plan = None
    classes = None
    if model is not None and hasattr(model, "named_parameters"):
        classes = _live_classes(model)
    elif model is not None:
        shape = model_shape(model, setup.lora_target_modules)
        classes = shape.module_classes
        plan = plan_memory(shape, setup)
    ctx = Context(setup=setup, shape=shape, plan=plan, module_classes=classes)
    findings = []
    for rule in RULES:
        findings.extend(Finding(**f) for f in rule(ctx))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order[f.severity])
    return Diagnosis(setup=setup, findings=findings, plan=plan, shape=shape)


def check_setup(model=None, *, accelerate_config=None, fsdp_plugin=None, **settings) -> list[Finding]:
    """Every inconsistency of a QLoRA/FSDP setup, before launch. Same arguments as :func:`diagnose`.

    Example::

        from hf_fsdp_qlora import check_setup

        for f in check_setup("path/to/Llama-3.1-70B", accelerate_config="fsdp2_qlora", quantization="4bit",
                             seq_len=4096, gpu_memory=80 * 2**30):
            print(f.severity, f.id, f.message)

    Returns:
        The findings, errors first.
    """
    return diagnose(model, accelerate_config=accelerate_config, fsdp_plugin=fsdp_plugin, **settings).findings


def raise_for_errors(findings: list[Finding]) -> None:
    """Raise :class:`~hf_fsdp_qlora.UnsupportedSetupError` naming every error among `findings`."""
    from ..errors import UnsupportedSetupError

    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise UnsupportedSetupError(" ".join(f"[{f.id}] {f.message}" for f in errors))
