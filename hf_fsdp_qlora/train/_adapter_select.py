"""Which tensors an adapter save holds - peft's own selection - and gathering the frozen ones from FSDP ranks.

Names first: under FSDP1 parameter names carry wrapper segments (``_fsdp_wrapped_module.``), under activation
checkpointing ``_checkpoint_wrapped_module.``; files and peft's saved keys never do.
"""

from __future__ import annotations

import torch

from ..param_names import clean_name

__all__ = ["adapter_selection", "clean_name", "unsharded_fsdp1"]


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


def adapter_name_of(peft_model) -> str:
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

    adapter_name = adapter_name or adapter_name_of(peft_model)
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
        selection[checkpoint_key(clean_name(key), adapter_name)] = by_id[id(value)]
    return selection


def selection_of(model, peft_model, adapter_name: str) -> dict[str, str]:
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


def gather_named(model, names: set[str]) -> dict[str, torch.Tensor]:
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


def checkpoint_key(name: str, adapter_name: str) -> str:
    # The inverse of what peft's save does to a parameter name: drop the adapter-name segment
    # ("...lora_A.default.weight" -> "...lora_A.weight"; DoRA's "...lora_magnitude_vector.default.weight"
    # -> "...lora_magnitude_vector").
    key = name.replace(f".{adapter_name}.", ".")
    if key.endswith(f".{adapter_name}"):
        key = key[: -len(adapter_name) - 1]
    if key.endswith("lora_magnitude_vector.weight"):
        key = key[: -len(".weight")]
    return key
