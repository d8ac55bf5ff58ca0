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
    "adapter_selection",
    "AdapterMismatchError",
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


def _adapter_name(peft_model) -> str:
    name = peft_model.active_adapter
    return name[0] if isinstance(name, (list, tuple)) else name


def adapter_selection(peft_model, adapter_name: str | None = None) -> dict[str, str]:
    """What peft's own ``save_pretrained`` would write for this model: {key in the file: parameter name}.

    peft decides by name: the LoRA tensors, ``modules_to_save`` copies, trainable-token deltas, and - with
    ``save_embedding_layers="auto"`` - the whole (frozen) input and output embeddings when the vocabulary
    was resized (peft's ChatML recipe) or the embeddings are targeted. Its selection is replayed here on
    the parameter objects themselves, without reading them, and each selected entry is traced back to its
    parameter by identity; the tensors are then gathered from the ranks (:func:`save_adapter`). Inside
    FSDP1 peft sees ``_fsdp_wrapped_module.`` segments in module names, so it is handed the names it sees
    and the answer is cleaned.
    """
    from peft import get_peft_model_state_dict

    adapter_name = adapter_name or _adapter_name(peft_model)
    seen = dict(peft_model.named_parameters(remove_duplicate=False))
    by_id = {id(p): clean_name(n) for n, p in seen.items()}
    # Both spellings: LoRA keys are matched against the wrapped module names, while modules_to_save and
    # trainable-token wrappers look their tensors up under clean names (FSDP1 wraps each trainable leaf in
    # its own unit, so "modules_to_save.default.weight" is seen as "...default._fsdp_wrapped_module.weight").
    names = {**seen, **{clean_name(n): p for n, p in seen.items()}}
    selected = get_peft_model_state_dict(peft_model, state_dict=names, adapter_name=adapter_name)
    selection = {}
    for key, value in selected.items():
        if id(value) not in by_id:
            raise RuntimeError(f"hf_fsdp_qlora: peft selected {key!r}, which is not a parameter of the model.")
        # Inside FSDP1 peft also leaves the adapter name in LoRA keys ("lora_A.default.weight"); write the
        # canonical form so the file matches what peft writes for an unsharded model.
        selection[_checkpoint_key(clean_name(key), adapter_name)] = by_id[id(value)]
    return selection


def _selection_of(model, peft_model, adapter_name: str) -> dict[str, str]:
    """Collective under FSDP1: :func:`adapter_selection` for a possibly FSDP1-wrapped `model`.

    peft lists a modules_to_save copy's keys with its ``state_dict()``; under FSDP1 that copy is a nested
    unit, and a nested unit's state_dict before the root ran once (resuming, before the first forward)
    takes itself for the root and breaks the wrapping ("Non-root FSDP instance's `_is_root` should not
    have been set yet"). Summoning the root alone (its own small parameters) initialises it properly first.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # `_is_root` stays None until FSDP1's lazy init (torch 2.13); once the root ran, nothing to do.
    if isinstance(model, FSDP) and getattr(model, "_is_root", None) is None:
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            pass
    return adapter_selection(peft_model, adapter_name)


def _gather_named(model, names: set[str]) -> dict[str, torch.Tensor]:
    """Collective: full CPU copies of the (frozen) parameters `names` (clean names), gathering only what holds them.

    Used for the embeddings peft saves after a resize: a full state-dict gather would move the whole 4-bit
    base. FSDP2: each parameter is a DTensor, gathered alone. FSDP1: only the units that own one of them are
    summoned, one at a time, without recursing into nested units.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    found = {}
    if not names:
        return found
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    if not units or unsharded_fsdp1(model):
        for name, param in model.named_parameters():
            if clean_name(name) in names:
                value = param.full_tensor() if hasattr(param, "full_tensor") else param
                found[clean_name(name)] = value.detach().to("cpu").clone()
        return found
    unit_names = [n for n, _ in units]

    def owner(param_name):  # the innermost FSDP1 unit whose subtree holds the parameter
        best = ""
        for unit in unit_names:
            if unit and param_name.startswith(unit + ".") and len(unit) > len(best):
                best = unit
        return best

    # Keyed by clean name: inside summon_full_params FSDP1's named_parameters drops the wrapper segments.
    wanted = {clean_name(n): owner(n) for n, _ in model.named_parameters() if clean_name(n) in names}
    for unit_name, unit in units:
        if unit_name not in set(wanted.values()):
            continue
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            for name, param in model.named_parameters():
                if wanted.get(clean_name(name)) == unit_name:
                    found[clean_name(name)] = param.detach().to("cpu").clone()
    return found


def _adapter_tensors(selection: dict[str, str], gathered: dict, adapter_name: str) -> dict[str, torch.Tensor]:
    tensors = {key: gathered[name] for key, name in selection.items() if name in gathered}
    # peft selects by name; an empty or meta result would save an adapter that silently does nothing.
    if not tensors:
        raise RuntimeError(
            "hf_fsdp_qlora: gathered no adapter weights to save (0 LoRA tensors among "
            f"{len(gathered)} gathered parameters). Check that the model is a peft model whose adapter "
            f"{adapter_name!r} is trainable."
        )
    lost = sorted(key for key, name in selection.items() if name not in gathered)
    if lost:
        raise RuntimeError(f"hf_fsdp_qlora: {len(lost)} adapter tensors could not be gathered: {lost[:5]}")
    bad = [name for name, t in tensors.items() if t.device.type == "meta" or t.numel() == 0]
    if bad:
        raise RuntimeError(f"hf_fsdp_qlora: adapter tensors are empty or on the meta device: {bad[:5]}")
    # peft selects a modules_to_save copy twice ("lm_head.weight" and, when the vocabulary was resized,
    # "lm_head.modules_to_save.weight"); safetensors refuses aliased tensors, so later ones are copies, as in
    # peft's own save.
    seen_ids, result = set(), {}
    for name, t in tensors.items():
        result[name] = t.contiguous() if id(t) not in seen_ids else t.clone().contiguous()
        seen_ids.add(id(t))
    return result


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
    adapter_name = _adapter_name(peft_model)
    selection = _selection_of(model, peft_model, adapter_name)
    state_dict = gather_trainable_state_dict(model)
    # Frozen tensors peft saves too (the embeddings of a resized vocabulary); every rank takes part.
    state_dict.update(_gather_named(model, {n for n in selection.values() if n not in state_dict}))
    if is_main_process is None:
        is_main_process = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    error = None
    if is_main_process:
        try:
            _write_adapter(peft_model, _adapter_tensors(selection, state_dict, adapter_name), Path(output_dir))
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
    # A failed write on the main process must not leave the other ranks waiting in the next collective.
    agree_on_failure(error)
    return Path(output_dir) if is_main_process else None


def _write_adapter(peft_model, tensors: dict, output_dir: Path) -> None:
    from safetensors.torch import save_file

    adapter_name = _adapter_name(peft_model)

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


class AdapterMismatchError(ValueError):
    """The adapter on disk was trained with a different configuration than the model it is loaded into."""


def _lora_hint(adapter_dir: Path, peft_model, adapter_name: str) -> str:
    import json

    try:
        saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return ""
    config = peft_model.peft_config[adapter_name]
    diffs = []
    for field in ("r", "lora_alpha", "target_modules", "modules_to_save", "trainable_token_indices", "use_dora"):
        mine, theirs = getattr(config, field, None), saved.get(field)
        if isinstance(mine, (set, tuple)):
            mine = sorted(mine)
        if isinstance(theirs, list) and isinstance(mine, list):
            theirs, mine = sorted(theirs), sorted(mine)
        if field in saved and mine != theirs:
            diffs.append(f"{field}={theirs!r} in the checkpoint, {mine!r} in this model")
    return (" (" + "; ".join(diffs) + ")") if diffs else ""


def load_adapter_into(model, adapter_dir: str | os.PathLike) -> int:
    """Collective: load ``adapter_model.safetensors`` from `adapter_dir` into a (possibly FSDP-wrapped) peft model.

    Every rank reads the file and hands full tensors to torch's distributed state-dict API, which keeps
    only each rank's shard. Used to resume from our adapter-only checkpoints, where upstream's resume
    path would look for a full FSDP model state that was never written. Everything :func:`save_adapter`
    writes comes back: LoRA tensors, ``modules_to_save``, trainable tokens and resized embeddings.

    Returns:
        The number of tensors loaded.

    Raises:
        FileNotFoundError: no adapter weights in `adapter_dir`.
        AdapterMismatchError: the file lacks tensors the model saves, holds tensors the model has no place
            for, or holds tensors of other shapes (another LoRA rank): one line naming the difference.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"No {ADAPTER_WEIGHTS} in {adapter_dir}: not an adapter checkpoint.")
    peft_model = unwrap_peft_model(model)
    if peft_model is None:
        raise TypeError("load_adapter_into needs a peft model (PeftModel, possibly FSDP-wrapped).")
    adapter_name = _adapter_name(peft_model)
    selection = _selection_of(model, peft_model, adapter_name)
    saved = load_file(str(path))
    missing = sorted(k for k in selection if k not in saved)
    unexpected = sorted(k for k in saved if k not in selection)
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"lacks {len(missing)} tensors this model trains or saves (e.g. {missing[0]})")
        if unexpected:
            what.append(f"holds {len(unexpected)} tensors this model has no place for (e.g. {unexpected[0]})")
        raise AdapterMismatchError(
            f"hf_fsdp_qlora: the adapter in {adapter_dir} {' and '.join(what)}"
            f"{_lora_hint(adapter_dir, peft_model, adapter_name)}: it was saved from a differently configured "
            "model. Resume with the LoraConfig (r, target_modules, modules_to_save, trainable_token_indices) and "
            "the vocabulary size it was trained with, or start a new run (a new output_dir)."
        )
    params = {clean_name(n): p for n, p in model.named_parameters()}
    state_dict = {name: saved[key] for key, name in selection.items()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = any(isinstance(m, FSDP) for m in model.modules())

    def check_shapes(shape_of):
        wrong = [(k, tuple(saved[k].shape), shape_of(n)) for k, n in selection.items()
                 if tuple(saved[k].shape) != shape_of(n)]  # fmt: skip
        if wrong:
            key, theirs, mine = wrong[0]
            return AdapterMismatchError(
                f"hf_fsdp_qlora: the adapter in {adapter_dir} does not fit this model: {len(wrong)} tensors differ "
                f"in shape, e.g. {key} is {list(theirs)} in the checkpoint and {list(mine)} in the model"
                f"{_lora_hint(adapter_dir, peft_model, adapter_name)}. Resume with the LoraConfig the checkpoint "
                "was trained with (same r and target_modules), or start a new run (a new output_dir)."
            )
        return None

    if fsdp1:
        # FSDP1 (use_orig_params=True): set_model_state_dict swaps the parameters' storage, which then no
        # longer views the FlatParameter the optimizer steps - the resumed run silently diverges after
        # one step. Writing into the gathered parameters with writeback keeps every view intact. Shapes are
        # only visible while gathered; every rank reads the same file, so all raise alike.
        with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
            full = {clean_name(n): p for n, p in model.named_parameters()}
            error = check_shapes(lambda n: tuple(full[n].shape))
            if error is None:
                for name, param in full.items():
                    value = state_dict.get(name)
                    if value is not None:
                        param.copy_(value.to(device=param.device, dtype=param.dtype))
        if error is not None:
            raise error
    else:
        error = check_shapes(lambda n: tuple(params[n].shape))  # DTensors report the global shape
        if error is not None:
            raise error
        state_dict = {n: v.to(params[n].dtype) for n, v in state_dict.items()}
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
