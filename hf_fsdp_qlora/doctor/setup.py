"""What the doctor checks: one run's settings as plain values, read from an accelerate config, a live plugin or model.

:class:`RunSetup` holds every setting a check or the memory plan looks at; :class:`FsdpSettings` the FSDP part of
it. The accelerate YAML is read the way ``accelerate launch`` reads it - accelerate's own launch parser and its
``prepare_multi_gpu_env`` compute the ``FSDP_*`` environment the training processes would see - so defaults and
refusals (``cpu_ram_efficient_loading`` without ``sync_module_states``) are accelerate's, not a copy of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..dtype_names import DTYPE_OF_MIXED_PRECISION
from ..errors import SetupInputError
from ..loss_paths import DEFAULT_LOSS_CHUNK_SIZE, loss_path

__all__ = [
    "TRAINERS",
    "FsdpSettings",
    "RunSetup",
    "SetupInputError",
    "facts_from_model",
    "fsdp_from_plugin",
    "read_accelerate_config",
]

TRAINERS = ("hf_fsdp_qlora", "transformers", "accelerate")


@dataclass
class FsdpSettings:
    """The FSDP settings of a launch, normalised; ``version=None`` means the launch does not use FSDP."""

    version: int | None = None
    num_processes: int = 1
    num_machines: int = 1
    mixed_precision: str = "no"
    use_cpu: bool = False
    auto_wrap_policy: str = "NO_WRAP"
    transformer_cls_to_wrap: list[str] | None = None
    # FULL_SHARD / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD (FSDP2: reshard_after_forward True -> FULL_SHARD).
    sharding_strategy: str = "FULL_SHARD"
    offload_params: bool = False
    use_orig_params: bool | None = None
    sync_module_states: bool | None = None
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    # What `accelerate launch` itself refuses for this file (its own message), if anything.
    launcher_error: str | None = None
    source: str = ""

    @property
    def param_dtype(self) -> str | None:
        """FSDP's mixed-precision param dtype as accelerate sets it from ``mixed_precision`` (None: no cast)."""
        return DTYPE_OF_MIXED_PRECISION.get(self.mixed_precision)


@dataclass
class RunSetup:
    """One planned run, as plain values. Field names are the keyword arguments of :func:`check_setup`.

    Dtypes are names (``"bfloat16"``, ``"uint8"``). ``None`` for ``quant_storage``/``compute_dtype`` means "same
    as ``dtype``" (what :func:`~hf_fsdp_qlora.load_qlora_model` does). ``adapter_dtype``: the adapters' dtype as
    loaded (``None``: ``dtype`` with our trainer, which casts them anyway, ``float32`` otherwise: peft's default
    ``autocast_adapter_dtype=True``); with our trainer the memory plan trains them in float32 (master weights)
    unless it is a 16-bit dtype (``adapter_dtype="bfloat16"``), see ``plan_context._trained_adapter_dtype``.
    """

    model: str | None = None
    quantization: str | None = None  # "4bit", "8bit" or None (16-bit base)
    full_finetune: bool = False
    dtype: str = "bfloat16"
    quant_storage: str | None = None
    compute_dtype: str | None = None
    adapter_dtype: str | None = None
    norm_dtype: str | None = None  # "float32" after prepare_model_for_kbit_training
    double_quant: bool = True
    # Why our 8-bit route cannot take this base: a pre-quantized 8-bit checkpoint the loader refuses. None: an
    # 8-bit base is loaded by load_qlora_model(path, bits=8) (or a stock load_in_8bit model our trainers convert).
    int8_unsupported: str | None = None
    quantize_experts: bool = True  # load_qlora_model's default: fused MoE experts in 4 bits (stock: 16-bit)
    lora_r: int = 16
    lora_dropout: float = 0.05
    use_dora: bool = False  # LoraConfig(use_dora=True): magnitude vectors, and a weight norm in every forward
    lora_target_modules: str | list[str] = "all-linear"
    lora_target_parameters: list[str] | None = None  # peft's target_parameters (trl: --lora_target_parameters)
    device_map: str | None = None
    trainer: str = "hf_fsdp_qlora"
    # Whose loss computes the logits: "ours", "sft", "stock" or "dpo" (hf_fsdp_qlora.loss_paths); None: what the run
    # takes (hf_fsdp_qlora.loss_paths.loss_path: the trainer, its class and the model's config decide).
    loss_path: str | None = None
    # The Trainer class the script builds when it has a loss of its own (trl's "SFTTrainer", "DPOTrainer", e.g. trl's
    # sft.py under `python -m hf_fsdp_qlora.run`); None: a Trainer that keeps transformers' loss.
    trainer_class: str | None = None
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE  # FSDPQLoRATrainingArguments.loss_chunk_size
    gradient_checkpointing: bool = (
        False  # TrainingArguments.activation_checkpointing (formerly gradient_checkpointing)
    )
    model_checkpointing: bool = False  # enabled on the model itself (load_qlora_model's default)
    activation_offloading: bool = False  # FSDPQLoRATrainingArguments.activation_offloading
    sp_size: int = 1  # FSDPQLoRATrainingArguments.sp_size: ranks sharing each sequence (Ulysses)
    tiled_mlp_tokens: int = 0  # FSDPQLoRATrainingArguments.tiled_mlp_tokens when tiled_mlp=True; 0: not tiled
    optimizer: str = "adamw"
    attn_implementation: str = "sdpa"
    seq_len: int = 2048
    batch_size: int = 1
    eval_batch_size: int | None = None
    padding: str = "longest"
    packing: bool = False
    save_steps: int | None = None
    save_only_model: bool = False
    timeout_minutes: float = 30.0
    write_speed_mb_s: float = 200.0
    num_gpus: int | None = None
    gpu_memory: int | None = None  # bytes
    mixed_precision: str | None = None  # overrides the accelerate config's, as TrainingArguments(bf16=True) does
    fsdp: FsdpSettings = field(default_factory=FsdpSettings)

    @property
    def storage(self) -> str:
        return self.quant_storage or self.dtype

    @property
    def compute(self) -> str:
        return self.compute_dtype or self.dtype

    @property
    def adapter(self) -> str:
        if self.adapter_dtype:
            return self.adapter_dtype
        return self.dtype if self.trainer == "hf_fsdp_qlora" else "float32"

    @property
    def effective_loss_path(self) -> str:
        """The loss path without the model's config (the memory plan also asks the config: MemoryPlan.loss_path)."""
        return self.loss_path or loss_path(self.trainer, self.trainer_class)[0]

    @property
    def world_size(self) -> int:
        return self.num_gpus or max(1, self.fsdp.num_processes)

    @property
    def integer_storage_sharded(self) -> bool:
        """Integer 4-bit storage is viewed as the compute dtype (so FSDP1 flattens it and FSDP2 shards it): only where
        our trainer re-types it, under FSDP1 and FSDP2."""
        return self.trainer == "hf_fsdp_qlora" and self.fsdp.version in (1, 2)

    @property
    def peft_wraps(self) -> bool:
        """transformers.Trainer swaps FSDP1's wrap policy for peft's: each decoder layer and each LoRA layer a unit."""
        return self.fsdp.version == 1 and self.trainer != "accelerate" and not self.full_finetune

    @property
    def effective_mixed_precision(self) -> str:
        return self.mixed_precision or self.fsdp.mixed_precision

    def replace(self, **changes) -> RunSetup:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _fields_of_launch_parser() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {action.dest for action in launch_command_parser()._actions}


def _check_keys(config: dict, where: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    if not isinstance(config, dict) or "distributed_type" not in config:
        raise SetupInputError(
            f"{where} is not an accelerate config: it has no `distributed_type`. Pass a file written by "
            "`accelerate config` or a shipped name (hf-fsdp-qlora config --list), e.g. `accelerate_config='fsdp2_qlora'`."
        )
    known = set(ClusterConfig.__dataclass_fields__)
    for key in config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise SetupInputError(f"{where}: unknown key `{key}` (accelerate refuses it).{hint} Remove or rename it.")
    launch = _fields_of_launch_parser()
    for key in config.get("fsdp_config") or {}:
        # accelerate maps a key not starting with "fsdp" to `fsdp_<key>` and silently ignores unknown ones.
        dest = key if key.startswith("fsdp") else f"fsdp_{key}"
        if dest not in launch and dest != "fsdp_ignored_modules":
            options = sorted(d for d in launch if d.startswith("fsdp_"))
            close = difflib.get_close_matches(dest, options, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise SetupInputError(
                f"{where}: unknown fsdp_config key `{key}` - accelerate would ignore it silently.{hint} "
                f"Known keys: {', '.join(options)}."
            )


def _launch_env(path: str) -> tuple[dict, str | None, object]:
    """The FSDP environment `accelerate launch --config_file path` gives its processes, and its refusal if any."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", path, "--main_process_port", "0", "train.py"])
    args = _validate_launch_command(args)[0]
    try:
        env = prepare_multi_gpu_env(args)
    except ValueError as err:  # accelerate's own refusal, e.g. cpu_ram_efficient_loading without sync_module_states
        return {}, str(err), args
    return env, None, args


def _bool(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "y")


def read_accelerate_config(config) -> FsdpSettings:
    """Read an accelerate config the way ``accelerate launch`` does.

    Args:
        config: a path to a YAML file, the name of a shipped config (``"fsdp2_qlora"``) or the YAML's dict.

    Returns:
        The normalised FSDP settings.

    Raises:
        SetupInputError: not a file / not a mapping / not an accelerate config / an unknown key.
    """
    import yaml

    if isinstance(config, dict):
        data, where = config, "the accelerate config"
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as tmp:
            yaml.safe_dump(data, tmp)
        path, cleanup = tmp.name, True
    else:
        path, cleanup = _resolve_config_path(os.fspath(config)), False
        where = path
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise SetupInputError(f"{path} is not valid YAML ({err}). Pass an accelerate config file.") from err
    try:
        _check_keys(data, where)
        env, refusal, args = _launch_env(path)
    except SetupInputError:
        raise
    except (ValueError, TypeError, KeyError) as err:
        raise SetupInputError(f"accelerate cannot read {where}: {err}") from err
    finally:
        if cleanup:
            os.unlink(path)
    return _settings_from_launch(data, env, refusal, args, where)


def _resolve_config_path(value: str) -> str:
    if os.path.isfile(value):
        return value
    if os.sep not in value and not value.endswith((".yml",)):
        from ..configs import config_path

        try:
            return str(config_path(value))
        except ValueError as err:
            raise SetupInputError(
                f"`accelerate_config` {value!r} is neither a file nor a shipped config. {err}"
            ) from err
    raise SetupInputError(f"Accelerate config {value!r} does not exist. Pass a YAML file or a shipped config name.")


def _settings_from_launch(data: dict, env: dict, refusal: str | None, args, where: str) -> FsdpSettings:
    fsdp_cfg = data.get("fsdp_config") or {}
    is_fsdp = str(data.get("distributed_type", "")).upper() == "FSDP"
    settings = FsdpSettings(
        version=None,
        num_processes=int(args.num_processes or data.get("num_processes") or 1),
        num_machines=int(args.num_machines or 1),
        mixed_precision=str(args.mixed_precision or "no").lower(),
        use_cpu=_bool(data.get("use_cpu", False)),
        launcher_error=refusal,
        source=where,
    )
    if not is_fsdp:
        return settings
    if refusal is not None:  # no environment came back: read the file's own values
        env = {f"FSDP_{k.removeprefix('fsdp_').upper()}": str(v) for k, v in fsdp_cfg.items()}
        env.setdefault("FSDP_VERSION", str(fsdp_cfg.get("fsdp_version", 1)))
    settings.version = int(env.get("FSDP_VERSION", "1"))
    settings.auto_wrap_policy = env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    classes = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    settings.transformer_cls_to_wrap = [c.strip() for c in classes.split(",") if c.strip()] if classes else None
    if settings.version == 2:
        reshard = _bool(env.get("FSDP_RESHARD_AFTER_FORWARD", "true"))
        settings.sharding_strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
        settings.use_orig_params = None
        settings.sync_module_states = None  # obsolete in FSDP2
    else:
        strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        names = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        settings.sharding_strategy = names[int(strategy) - 1] if strategy.isdigit() else strategy
        settings.use_orig_params = _bool(env.get("FSDP_USE_ORIG_PARAMS", "false"))
        settings.sync_module_states = _bool(env.get("FSDP_SYNC_MODULE_STATES", "false"))
    settings.offload_params = _bool(env.get("FSDP_OFFLOAD_PARAMS", "false"))
    settings.cpu_ram_efficient_loading = _bool(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"))
    if settings.version == 2:
        settings.sync_module_states = _bool(fsdp_cfg.get("fsdp_sync_module_states", False))
    settings.activation_checkpointing = _bool(env.get("FSDP_ACTIVATION_CHECKPOINTING", "false"))
    settings.state_dict_type = env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT").upper()
    return settings


def fsdp_from_plugin(plugin) -> FsdpSettings:
    """The settings of a live ``accelerate.utils.FullyShardedDataParallelPlugin`` (inside a launched run)."""
    import torch

    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    policy = getattr(plugin, "auto_wrap_policy", None)
    func = getattr(policy, "func", policy)
    name = getattr(func, "__name__", "")
    wrap = "TRANSFORMER_BASED_WRAP" if "transformer" in name else "SIZE_BASED_WRAP" if "size" in name else "NO_WRAP"
    if policy is not None and wrap == "NO_WRAP":
        wrap = "CUSTOM"
    offload = getattr(plugin, "cpu_offload", None)
    offloaded = bool(getattr(offload, "offload_params", False)) or type(offload).__name__ == "CPUOffloadPolicy"
    mp = getattr(getattr(plugin, "mixed_precision_policy", None), "param_dtype", None)
    mixed = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mp, "no")
    reshard = getattr(plugin, "reshard_after_forward", True)
    strategy = getattr(plugin, "sharding_strategy", None) or reshard
    if isinstance(strategy, bool):
        strategy = "FULL_SHARD" if strategy else "SHARD_GRAD_OP"
    state_dict_type = getattr(plugin, "state_dict_type", None)
    from accelerate.state import PartialState

    return FsdpSettings(
        version=version,
        num_processes=PartialState().num_processes if PartialState._shared_state else 1,
        mixed_precision=mixed,
        auto_wrap_policy=wrap,
        transformer_cls_to_wrap=list(getattr(plugin, "transformer_cls_names_to_wrap", None) or []) or None,
        sharding_strategy=getattr(strategy, "name", str(strategy)),
        offload_params=offloaded,
        use_orig_params=getattr(plugin, "use_orig_params", None),
        sync_module_states=getattr(plugin, "sync_module_states", None),
        cpu_ram_efficient_loading=bool(getattr(plugin, "cpu_ram_efficient_loading", False)),
        activation_checkpointing=bool(getattr(plugin, "activation_checkpointing", False)),
        state_dict_type=getattr(state_dict_type, "name", str(state_dict_type or "FULL_STATE_DICT")),
        source="the live FSDP plugin",
    )


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def facts_from_model(model) -> dict:
    """RunSetup fields read from a loaded (possibly peft-wrapped, 4-/8-bit) model: what it really holds."""
    from ..dtypes import quant_storage_dtype, quantization_kind

    kind = quantization_kind(model)
    facts: dict = {"quantization": kind}
    floating = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    plain = [(n, p) for n, p in floating if type(p).__name__ not in ("Params4bit", "Int8Params")]
    frozen = [p for n, p in plain if not p.requires_grad]
    adapters = [p for n, p in plain if p.requires_grad]
    base = frozen[0].dtype if frozen else (adapters[0].dtype if adapters else None)
    if base is not None:
        facts["dtype"] = _name(base)
    if kind == "4bit":
        facts["quant_storage"] = _name(quant_storage_dtype(model))
        qconfig = getattr(getattr(model, "config", None), "quantization_config", None)
        compute = getattr(qconfig, "bnb_4bit_compute_dtype", None)
        if compute is not None:
            facts["compute_dtype"] = _name(compute)
        facts["double_quant"] = bool(getattr(qconfig, "bnb_4bit_use_double_quant", True))
    # The odd dtype out, if any: what FSDP1 would find beside the rest inside one unit.
    reference = facts.get("quant_storage") if kind == "4bit" else facts.get("dtype")
    adapter_dtypes = {_name(p.dtype) for p in adapters}
    frozen_dtypes = {_name(p.dtype) for p in frozen}
    if adapter_dtypes:
        odd_adapters = sorted(d for d in adapter_dtypes if d != reference)
        facts["adapter_dtype"] = odd_adapters[0] if odd_adapters else next(iter(adapter_dtypes))
    odd = sorted(d for d in frozen_dtypes if d != reference)
    if odd:
        facts["norm_dtype"] = odd[0]
    facts["use_dora"] = any("lora_magnitude_vector" in n for n, _ in plain)
    facts["full_finetune"] = kind is None and bool(adapters) and not any("lora_" in n for n, _ in plain)
    device_map = getattr(model, "hf_device_map", None)
    if device_map is None and hasattr(model, "get_base_model"):
        device_map = getattr(model.get_base_model(), "hf_device_map", None)
    if isinstance(device_map, dict) and len(device_map) > 1:
        facts["device_map"] = "multi-device"
    return facts
