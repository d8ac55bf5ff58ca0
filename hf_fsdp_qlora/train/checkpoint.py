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
import re
from pathlib import Path

import torch

from ..distributed import is_main_process as main_process
from ..errors import AdapterMismatchError
from ..param_names import clean_name
from ..quant_record import RECORD_ATTR, write_record
from ..rank_sync import agree_on_failure
from ..safetensors_io import apply_umask_mode
from ._adapter_select import (
    adapter_name_of,
    adapter_selection,
    gather_named,
    selection_of,
    unsharded_fsdp1,
)

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
    adapter_name = adapter_name_of(peft_model)
    selection = selection_of(model, peft_model, adapter_name)
    state_dict = gather_trainable_state_dict(model)
    # Frozen tensors peft saves too (the embeddings of a resized vocabulary); every rank takes part.
    state_dict.update(gather_named(model, {n for n in selection.values() if n not in state_dict}))
    if is_main_process is None:
        is_main_process = main_process()
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

    adapter_name = adapter_name_of(peft_model)

    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    apply_umask_mode(tmp)  # save_file writes 0600 whatever the umask
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    config.inference_mode = True
    if getattr(config, "base_model_name_or_path", None) is None:
        config.base_model_name_or_path = getattr(peft_model.base_model.model, "name_or_path", None)
    config.save_pretrained(str(output_dir))
    write_record(output_dir, getattr(peft_model, RECORD_ATTR, None))  # what training quantized, for the merge
    os.replace(tmp, output_dir / ADAPTER_WEIGHTS)


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
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"No {ADAPTER_WEIGHTS} in {adapter_dir}: not an adapter checkpoint.")
    peft_model = unwrap_peft_model(model)
    if peft_model is None:
        raise TypeError("load_adapter_into needs a peft model (PeftModel, possibly FSDP-wrapped).")
    adapter_name = adapter_name_of(peft_model)
    selection = selection_of(model, peft_model, adapter_name)
    saved = load_file(str(path))
    hint = _lora_hint(adapter_dir, peft_model, adapter_name)
    _check_tensor_names(selection, saved, adapter_dir, hint)
    if any(isinstance(m, FSDP) for m in model.modules()):
        _write_into_gathered_fsdp1(model, selection, saved, adapter_dir, hint)
    else:
        _load_with_state_dict_api(model, selection, saved, adapter_dir, hint)
    return len(saved)  # the adapter file's tensors (every one was loaded: the checks above)


def _check_tensor_names(selection: dict, saved: dict, adapter_dir: Path, hint: str) -> None:
    """An AdapterMismatchError naming the difference unless the file holds exactly the tensors the model saves."""
    missing = sorted(k for k in selection if k not in saved)
    unexpected = sorted(k for k in saved if k not in selection)
    if not (missing or unexpected):
        return
    what = []
    if missing:
        what.append(f"lacks {len(missing)} tensors this model trains or saves (e.g. {missing[0]})")
    if unexpected:
        what.append(f"holds {len(unexpected)} tensors this model has no place for (e.g. {unexpected[0]})")
    raise AdapterMismatchError(
        f"hf_fsdp_qlora: the adapter in {adapter_dir} {' and '.join(what)}{hint}: it was saved from a differently "
        "configured model. Resume with the LoraConfig (r, target_modules, modules_to_save, trainable_token_indices) "
        "and the vocabulary size it was trained with, or start a new run (a new output_dir)."
    )


def _shape_mismatch(selection: dict, saved: dict, shape_of, adapter_dir: Path, hint: str):
    """An AdapterMismatchError for the first saved tensor whose shape is not the model's (None when all fit)."""
    wrong = [(k, tuple(saved[k].shape), shape_of(n)) for k, n in selection.items()
             if tuple(saved[k].shape) != shape_of(n)]  # fmt: skip
    if not wrong:
        return None
    key, theirs, mine = wrong[0]
    return AdapterMismatchError(
        f"hf_fsdp_qlora: the adapter in {adapter_dir} does not fit this model: {len(wrong)} tensors differ in shape, "
        f"e.g. {key} is {list(theirs)} in the checkpoint and {list(mine)} in the model{hint}. Resume with the "
        "LoraConfig the checkpoint was trained with (same r and target_modules), or start a new run "
        "(a new output_dir)."
    )


def _write_into_gathered_fsdp1(model, selection: dict, saved: dict, adapter_dir: Path, hint: str) -> None:
    """FSDP1 (use_orig_params=True): set_model_state_dict swaps the parameters' storage, which then no longer views
    the FlatParameter the optimizer steps - the resumed run silently diverges after one step. Writing into the
    gathered parameters with writeback keeps every view intact. Shapes are only visible while gathered; every rank
    reads the same file, so all raise alike (after leaving the gathered context together)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state_dict = {name: saved[key] for key, name in selection.items()}
    with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
        full = {clean_name(n): p for n, p in model.named_parameters()}
        error = _shape_mismatch(selection, saved, lambda n: tuple(full[n].shape), adapter_dir, hint)
        if error is None:
            for name, param in full.items():
                value = state_dict.get(name)
                if value is not None:
                    param.copy_(value.to(device=param.device, dtype=param.dtype))
    if error is not None:
        raise error


def _load_with_state_dict_api(model, selection: dict, saved: dict, adapter_dir: Path, hint: str) -> None:
    """FSDP2 or unwrapped: full tensors to torch's distributed state-dict API, which keeps each rank's shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    params = {clean_name(n): p for n, p in model.named_parameters()}
    error = _shape_mismatch(selection, saved, lambda n: tuple(params[n].shape), adapter_dir, hint)  # global shapes
    if error is not None:
        raise error
    state_dict = {name: saved[key].to(params[name].dtype) for key, name in selection.items()}
    on_accelerator = any(p.device.type not in ("cpu", "meta") for p in model.parameters())
    options = StateDictOptions(full_state_dict=True, strict=False, cpu_offload=on_accelerator)
    set_model_state_dict(model, state_dict, options=options)  # fills state_dict with every model parameter


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` folder directly in `output_dir`, or None.

    Complete: named ``checkpoint-<step>`` (our staging folder's checkpoints never are) and holding
    ``trainer_state.json``, which the Trainer writes last - so a checkpoint a stock Trainer left half-written when
    killed is skipped too.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    steps = {}
    for entry in folder.iterdir():
        match = re.fullmatch(r"checkpoint-(\d+)", entry.name)
        if match and entry.is_dir() and (entry / "trainer_state.json").is_file():
            steps[int(match.group(1))] = entry
    return str(steps[max(steps)]) if steps else None


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
    if not state["state"]:  # a stateless optimizer (SGD without momentum): torch's loader cannot place nothing
        _load_group_settings(optimizer, state["param_groups"])
        return
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=_options(model))


def _load_group_settings(optimizer, saved_groups: list) -> None:
    """The saved param groups' settings (learning rate, weight decay, ...) into `optimizer`'s groups, their
    parameters kept: all a stateless optimizer's checkpoint holds (torch's set_optimizer_state_dict raises
    "Expected device to be set" on it, with no tensor to take the device from)."""
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({key: value for key, value in saved.items() if key != "params"})


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
        is_main_process = main_process()
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
            apply_umask_mode(*Path(output_dir).glob("*.safetensors"))  # written 0600 by safetensors' save_file
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
    agree_on_failure(error)
    return Path(output_dir) if is_main_process else None
