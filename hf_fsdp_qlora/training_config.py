"""A run's training settings in one YAML file, read by the launch and by the doctor.

The keys are the field names of transformers' ``TrainingArguments`` and of trl's script configs (``SFTConfig``,
``DPOConfig``, ``GRPOConfig``, ``ModelConfig``), so one file serves every reader and the plan cannot drift from the
run:

* trl's scripts read it with their own ``--config FILE`` (flags given beside it win);
* ``examples/train_qlora.py`` and ``examples/safety_classifier.py`` read it with ``--config FILE``
  (:func:`script_settings`);
* ``hf-fsdp-qlora doctor --training-config FILE`` plans with the keys that change memory (:func:`doctor_values`).

The recipes' files are in ``examples/recipes/``. Only the standard library and PyYAML are imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DOCTOR_KEYS", "ScriptSettings", "doctor_values", "held_out_rows", "parse_with_config", "read_training_config",
    "script_settings",
]  # fmt: skip

# YAML key -> the doctor's option (its argparse dest). Keys not listed (learning rate, scheduler, gradient
# accumulation, evaluation steps, ...) change no byte of the per-GPU plan: the doctor reads past them.
DOCTOR_KEYS = {
    "max_length": "seq_len",
    "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size",
    "save_steps": "save_steps",
    "save_only_model": "save_only_model",
    "load_in_4bit": "load_in_4bit",
    "load_in_8bit": "load_in_8bit",
    "full_finetune": "full_finetune",
    "lora_r": "lora_r",
    "lora_dropout": "lora_dropout",
    "lora_target_modules": "lora_target_modules",
    "lora_target_parameters": "lora_target_parameters",
    "use_dora": "use_dora",
    "activation_offloading": "activation_offloading",
    "packing": "packing",
    "dtype": "dtype",
    "bnb_4bit_quant_storage": "quant_storage",
    "use_bnb_nested_quant": "no_double_quant",
    "optim": "optimizer",
}
# transformers' optimizer names -> the doctor's (the bytes per trainable parameter it plans).
_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_bnb_8bit": "adamw_8bit",
    "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "adamw_8bit", "sgd": "sgd",
}  # fmt: skip


def read_training_config(path: str | Path) -> dict:
    """The YAML mapping in `path` (trl's ``env`` key, environment variables for the run, left out).

    Raises:
        FileNotFoundError: no such file. ValueError: not a YAML mapping.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config {path}: no such file (the recipes' files are in examples/recipes/)")
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"training config {path}: not a YAML mapping of setting: value")  # noqa: TRY004
    config.pop("env", None)
    return config


def _names(value) -> str:
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


def doctor_values(config: dict) -> dict:
    """The doctor's options (argparse dests) that `config` sets, in the doctor's own form.

    Raises:
        ValueError: an optimizer the doctor has no plan for.
    """
    values = {}
    for key, dest in DOCTOR_KEYS.items():
        if key not in config or config[key] is None:
            continue
        value = config[key]
        if key in ("lora_target_modules", "lora_target_parameters"):
            value = _names(value)
        elif key == "use_bnb_nested_quant":
            value = not value
        elif key == "optim":
            if value not in _OPTIMIZERS:
                raise ValueError(f"optim: {value!r} has no memory plan; use one of {sorted(_OPTIMIZERS)}")
            value = _OPTIMIZERS[value]
        values[dest] = value
    if config.get("save_strategy") == "no":  # no checkpoint, whatever save_steps says
        values["save_steps"] = 0
    return values


@dataclass
class ScriptSettings:
    """What an example script takes from a training config: its own options' new defaults (flags still win) and
    the remaining keys, passed to ``FSDPQLoRATrainingArguments`` as they are."""

    defaults: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)


def script_settings(config: dict, options: dict[str, str], fixed: dict, training_fields: set[str]) -> ScriptSettings:
    """Split `config` for a script whose options `options` maps (key -> argparse dest).

    Args:
        options: YAML keys that are the script's own options (``max_length`` -> ``max_length``, ...).
        fixed: keys the script cannot change, with the one value it runs (``load_in_4bit: True``): the file may
            state them, so that the doctor reads them, but not otherwise.
        training_fields: ``FSDPQLoRATrainingArguments``' field names; every other key is refused by name.

    Raises:
        ValueError: a key the script does not take, or a fixed key with another value.
    """
    settings = ScriptSettings()
    unknown = []
    for key, value in config.items():
        if key in fixed:
            if value != fixed[key]:
                raise ValueError(f"{key}: {value!r} - this script runs {key}={fixed[key]!r} only; remove the line")
        elif key in options:
            settings.defaults[options[key]] = value
        elif key in training_fields:
            settings.training[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"{', '.join(sorted(unknown))}: not a setting of this script nor of TrainingArguments; "
            f"its own settings: {', '.join(sorted(options))}"
        )
    return settings


def parse_with_config(parser, argv, options: dict[str, str], fixed: dict):
    """An example script's arguments: with ``--config FILE``, the file's keys first become the options' defaults (so
    flags still win) and its ``TrainingArguments`` keys are kept, as they are, in ``args.training``."""
    from dataclasses import fields

    from hf_fsdp_qlora.train.training_args import FSDPQLoRATrainingArguments

    known, _ = parser.parse_known_args(argv)
    training = {}
    if known.config:
        names = {f.name for f in fields(FSDPQLoRATrainingArguments)}
        try:
            settings = script_settings(read_training_config(known.config), options, fixed, names)
        except (OSError, ValueError) as err:
            parser.error(f"--config {known.config}: {err}")
        parser.set_defaults(**settings.defaults)
        training = settings.training
    args = parser.parse_args(argv)
    args.training = training
    return args


def held_out_rows(rows: list, fraction: float, training: dict) -> tuple[list, list]:
    """(training rows, evaluation rows): the last `fraction` of the rows, at least one, when the training settings
    ask for evaluation; none otherwise.

    Raises:
        ValueError: evaluation asked for without a fraction to hold out.
    """
    strategy = training.get("eval_strategy", "no")
    if strategy == "no":
        return rows, []
    if not fraction or fraction <= 0:
        raise ValueError(
            f"eval_strategy {strategy!r} needs rows to evaluate on: set eval_fraction (e.g. 0.02) in the --config "
            "file, or --eval-fraction"
        )
    held = max(1, round(len(rows) * fraction))
    return rows[:-held], rows[-held:]
