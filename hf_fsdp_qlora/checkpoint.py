"""Gather the trained adapter from every rank and write it as a plain peft adapter.

Upstream, under FSDP: ``Trainer.save_model`` with SHARDED_STATE_DICT writes nothing; with
FULL_STATE_DICT, FSDP2 crashes inside peft's ``save_pretrained`` ("Attempted to access the data
pointer on an invalid python storage"), FSDP1 with nested units can write an EMPTY adapter (peft's key
filter misses the wrapped names), and adapter-only saves have written only rank 0's slice. Here the
trainable parameters alone are gathered into full tensors with torch's distributed state-dict API
(names free of FSDP prefixes), peft's own key filter turns them into adapter keys, and rank 0 writes
them - refusing to write an empty or partial adapter.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist

from .rank_sync import agree_on_failure

__all__ = [
    "unwrap_peft_model",
    "clean_name",
    "gather_trainable_state_dict",
    "save_adapter",
    "load_adapter_into",
    "directory_size",
    "gather_optimizer_state",
    "load_optimizer_state",
    "save_full_model",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The optimizer state of the trainable parameters, gathered whole and keyed by parameter name.
OPTIMIZER_STATE = "optimizer_gathered.pt"


def unwrap_peft_model(model):
    """The PeftModel inside `model` (FSDP1 wraps it in ``.module``; FSDP2 keeps the object), or None."""
    from peft import PeftModel

    seen = model
    for _ in range(8):
        if isinstance(seen, PeftModel):
            return seen
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if inner is None:
            return None
        seen = inner
    return None


def unsharded_fsdp1(model) -> bool:
    """True when `model` is wrapped by FSDP1 and every unit is ``NO_SHARD`` (what FSDP1 makes of one rank).

    With ``use_orig_params=True`` such a unit's forward leaves the frozen parameters as plain tensor
    attributes, not in the module's ``_parameters``, and FSDP's own state-dict hook then fails ("FSDP
    assumes ...base_layer.weight is in the state_dict but the state_dict only has ...": on one GPU no
    adapter could be saved). Nothing is sharded there, so the trainable parameters are read directly.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    units = [m for m in model.modules() if isinstance(m, FSDP)]
    return bool(units) and all(m.sharding_strategy == ShardingStrategy.NO_SHARD for m in units)


def _trainable_by_name(model) -> dict[str, torch.nn.Parameter]:
    return {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def gather_trainable_state_dict(model) -> dict[str, torch.Tensor]:
    """Collective: full (unsharded) CPU tensors of every trainable parameter, on every rank.

    Works on FSDP1 (``use_orig_params=True``), FSDP2, DDP and plain models. Only trainable parameters
    travel, so gathering a 70B QLoRA model moves megabytes, not the base.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    on_accelerator = any(p.device.type not in ("cpu", "meta") for p in model.parameters())
    # cpu_offload=True crashes FSDP1 on CPU-only ranks (SIGSEGV / "setStorage: ... out of bounds");
    # on GPUs it keeps the gathered tensors off the device.
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator, ignore_frozen_params=True)
    if unsharded_fsdp1(model):
        return {name: p.detach().to("cpu").clone() for name, p in _trainable_by_name(model).items()}
    state_dict = get_model_state_dict(model, options=options)
    gathered = {}
    for name, tensor in state_dict.items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        gathered[name] = tensor.detach().to("cpu").clone()
    return gathered


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name without FSDP1 / activation-checkpoint / compile wrapper segments."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _adapter_tensors(peft_model, state_dict: dict, adapter_name: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    # peft selects adapter keys by the module names it sees. Inside FSDP1 those carry
    # `_fsdp_wrapped_module.` segments while the gathered state dict does not, and peft then selects
    # nothing (an EMPTY adapter on disk). So hand peft the names it sees, and clean its answer.
    seen_names = {clean_name(n): n for n, p in peft_model.named_parameters() if p.requires_grad}
    trainable = {seen_names[k]: v for k, v in state_dict.items() if k in seen_names}
    tensors = get_peft_model_state_dict(peft_model, state_dict=trainable, adapter_name=adapter_name)
    # Inside FSDP1, peft also leaves the adapter name in the keys ("lora_A.default.weight"); write the
    # canonical form so the file matches what peft writes for an unsharded model.
    tensors = {_checkpoint_key(clean_name(k), adapter_name): v for k, v in tensors.items()}
    # peft selects by name; an empty or meta result would save an adapter that silently does nothing.
    if not tensors:
        raise RuntimeError(
            "hf_fsdp_qlora: gathered no adapter weights to save (0 LoRA tensors among "
            f"{len(state_dict)} trainable parameters). Check that the model is a peft model whose adapter "
            f"{adapter_name!r} is trainable."
        )
    bad = [name for name, t in tensors.items() if t.device.type == "meta" or t.numel() == 0]
    if bad:
        raise RuntimeError(f"hf_fsdp_qlora: adapter tensors are empty or on the meta device: {bad[:5]}")
    return {name: t.contiguous() for name, t in tensors.items()}


def save_adapter(model, output_dir: str | os.PathLike, *, is_main_process: bool | None = None) -> Path | None:
    """Collective: gather the adapter from all ranks; the main process writes it to `output_dir`.

    The result is what ``peft_model.save_pretrained`` would write for an unsharded model:
    ``adapter_model.safetensors`` and ``adapter_config.json``; it loads with
    ``PeftModel.from_pretrained(base, output_dir)``. Files are written under temporary names and
    renamed, so an interrupted save never leaves a half-written adapter under the final name.

    Args:
        model: the (possibly FSDP-wrapped) peft model, on every rank.
        output_dir: where to write.
        is_main_process: whether this rank writes; defaults to rank 0.

    Returns:
        `output_dir` on the writing rank, None elsewhere.
    """
    peft_model = unwrap_peft_model(model)
    if peft_model is None:
        raise TypeError("save_adapter needs a peft model (PeftModel, possibly FSDP-wrapped).")
    state_dict = gather_trainable_state_dict(model)
    if is_main_process is None:
        is_main_process = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    error = None
    if is_main_process:
        try:
            _write_adapter(peft_model, state_dict, Path(output_dir))
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
    # A failed write on the main process must not leave the other ranks waiting in the next collective.
    agree_on_failure(error)
    return Path(output_dir) if is_main_process else None


def _write_adapter(peft_model, state_dict: dict, output_dir: Path) -> None:
    from safetensors.torch import save_file

    adapter_name = peft_model.active_adapter
    if isinstance(adapter_name, (list, tuple)):
        adapter_name = adapter_name[0]
    tensors = _adapter_tensors(peft_model, state_dict, adapter_name)

    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    config.inference_mode = True
    if getattr(config, "base_model_name_or_path", None) is None:
        config.base_model_name_or_path = getattr(peft_model.base_model.model, "name_or_path", None)
    config.save_pretrained(str(output_dir))
    os.replace(tmp, output_dir / ADAPTER_WEIGHTS)


def _checkpoint_key(name: str, adapter_name: str) -> str:
    # The inverse of what peft's save does to a parameter name: drop the adapter-name segment
    # ("...lora_A.default.weight" -> "...lora_A.weight"; DoRA's "...lora_magnitude_vector.default.weight"
    # -> "...lora_magnitude_vector").
    key = name.replace(f".{adapter_name}.", ".")
    if key.endswith(f".{adapter_name}"):
        key = key[: -len(adapter_name) - 1]
    if key.endswith("lora_magnitude_vector.weight"):
        key = key[: -len(".weight")]
    return key


def load_adapter_into(model, adapter_dir: str | os.PathLike) -> int:
    """Collective: load ``adapter_model.safetensors`` from `adapter_dir` into a (possibly FSDP-wrapped) peft model.

    Every rank reads the file and hands full tensors to torch's distributed state-dict API, which keeps
    only each rank's shard. Used to resume from our adapter-only checkpoints, where upstream's resume
    path would look for a full FSDP model state that was never written.

    Returns:
        The number of tensors loaded.

    Raises:
        FileNotFoundError: no adapter weights in `adapter_dir`.
        KeyError: a trainable parameter of the model has no tensor in the file (a different adapter).
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"No {ADAPTER_WEIGHTS} in {adapter_dir}: not an adapter checkpoint.")
    peft_model = unwrap_peft_model(model)
    adapter_name = peft_model.active_adapter
    if isinstance(adapter_name, (list, tuple)):
        adapter_name = adapter_name[0]
    saved = load_file(str(path))
    state_dict, missing = {}, []
    for name, param in peft_model.named_parameters():
        if not param.requires_grad:
            continue
        clean = clean_name(name)
        key = _checkpoint_key(clean, adapter_name)
        if key not in saved:
            missing.append(key)
            continue
        state_dict[clean] = saved[key].to(param.dtype)
    if missing:
        raise KeyError(
            f"The adapter in {adapter_dir} lacks {len(missing)} trainable tensors of this model (e.g. {missing[0]}); "
            "resume with the same LoraConfig (r, target_modules) the checkpoint was trained with."
        )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if any(isinstance(m, FSDP) for m in model.modules()):
        # FSDP1 (use_orig_params=True): set_model_state_dict swaps the parameters' storage, which then no
        # longer views the FlatParameter the optimizer steps - the resumed run silently diverges after
        # one step. Writing into the gathered parameters with writeback keeps every view intact.
        with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
            for name, param in model.named_parameters():
                value = state_dict.get(clean_name(name))
                if value is not None:
                    param.copy_(value.to(param.device))
    else:
        on_accelerator = any(p.device.type not in ("cpu", "meta") for p in model.parameters())
        options = StateDictOptions(full_state_dict=True, strict=False, cpu_offload=on_accelerator)
        set_model_state_dict(model, state_dict, options=options)
    return len(state_dict)


def directory_size(path: str | os.PathLike) -> int:
    """Bytes of all files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _options(model, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    on_accelerator = any(p.device.type not in ("cpu", "meta") for p in model.parameters())
    return StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator, **kw)


def gather_optimizer_state(model, optimizer) -> dict:
    """Collective: the optimizer state of the trainable parameters as full CPU tensors keyed by name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def to_cpu(value):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        return value.detach().to("cpu").clone() if torch.is_tensor(value) else value

    if unsharded_fsdp1(model):  # see unsharded_fsdp1: the same layout as torch's API gives, read directly
        names = {id(p): name for name, p in _trainable_by_name(model).items()}
        state = {
            "state": {names[id(p)]: entry for p, entry in optimizer.state.items() if id(p) in names},
            "param_groups": [
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [names[id(p)] for p in group["params"]],
                }
                for group in optimizer.param_groups
            ],
        }
    else:
        state = get_optimizer_state_dict(model, optimizer, options=_options(model))

    return {
        "state": {name: {k: to_cpu(v) for k, v in entry.items()} for name, entry in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """Collective: load what :func:`gather_optimizer_state` returned; each rank keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if unsharded_fsdp1(model):  # torch's own index layout, built from the names
        index, groups = {}, []
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            by_id = {id(p): name for name, p in _trainable_by_name(model).items()}
            groups.append({**saved, "params": [len(index) + i for i in range(len(group["params"]))]})
            index.update({by_id[id(p)]: len(index) + i for i, p in enumerate(group["params"])})
        optimizer.load_state_dict({"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups})
        return
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=_options(model))


def save_full_model(model, output_dir: str | os.PathLike, *, is_main_process: bool | None = None) -> Path | None:
    """Collective: gather a full fine-tune's whole model and write it with ``save_pretrained`` (safetensors).

    Upstream, under FSDP: SHARDED_STATE_DICT makes ``Trainer.save_model`` write nothing, and the FULL
    state-dict gather segfaults FSDP1 on CPU ranks (``cpu_offload=True``). Here the full state dict is
    gathered with torch's API (offloaded to CPU on GPUs) and the main process writes a model that
    ``from_pretrained`` loads.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state_dict = get_model_state_dict(model, options=_options(model))
    if is_main_process is None:
        is_main_process = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    error = None
    if is_main_process:
        try:
            inner = model
            while not hasattr(inner, "save_pretrained") and hasattr(inner, "module"):
                inner = inner.module
            tensors = {}
            for name, tensor in state_dict.items():
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                tensors[clean_name(name)] = tensor.detach().to("cpu")
            inner.save_pretrained(str(output_dir), state_dict=tensors, safe_serialization=True)
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
    agree_on_failure(error)
    return Path(output_dir) if is_main_process else None
