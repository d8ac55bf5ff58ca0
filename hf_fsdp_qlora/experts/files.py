"""Where a checkpoint's files hold a model's fused expert parameters: whole, or per expert (``experts.0.gate_proj.weight``
...: transformers' ``save_pretrained`` writes Qwen3-MoE and Mixtral that way, and so are their Hub checkpoints), read
with transformers' own conversion mapping (the one ``from_pretrained`` applies). Below both readers: the merge
(merge/_experts.py) and the streamed expert loading (experts/stream.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hf_fsdp_qlora.errors import MergeError

from .orders import Reorder, whole_tensor_reorder

__all__ = ["ExpertSlice", "expert_file_slices"]


@dataclass
class ExpertSlice:
    """One tensor of the base's files holding part of a model parameter: expert `expert`, `start:stop` of `dim`
    of that expert's matrix (the whole matrix when `dim` is None); `expert` None: the whole parameter. `rows`: the
    rows of the file tensor holding the piece (None: all of it), `transposed`: the file holds its transpose (DBRX's
    2-D expert stacks, hf_fsdp_qlora/experts/dbrx.py)."""

    disk_key: str
    expert: int | None = None
    dim: int | None = None
    start: int = 0
    stop: int = 0
    rows: tuple[int, int] | None = None
    transposed: bool = False
    reorder: Reorder | None = None  # the whole parameter, stored permuted (Inkling 2's interleaved gate/up rows)


def expert_file_slices(model, params: list[str], entries) -> dict[str, list[ExpertSlice]]:
    """Where the base's files hold `params` (absent from them under the model's names): per expert, mapped
    with transformers' conversion mapping (the one `from_pretrained` applies)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from .dbrx import file_slices

    dbrx = file_slices(model, params, entries, ExpertSlice)  # DBRX's 2-D stacks: no conversion of transformers'
    if dbrx is not None:
        rest = [p for p in params if p not in dbrx]
        return {**dbrx, **(expert_file_slices(model, rest, entries) if rest else {})}
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    wanted, found = set(params), {}
    for disk_key, entry in entries.items():
        model_key, pattern = rename_source_key(disk_key, renamings, converters)
        if model_key not in wanted:
            continue
        shape = tuple(entry.shape)
        if pattern is None:  # only renamed: the whole parameter in one tensor
            piece = (ExpertSlice(disk_key), None, shape)
        else:
            piece = _converted_slice(model, model_key, disk_key, shape, by_pattern[pattern], pattern)
        found.setdefault(model_key, []).append(piece)
    return _placed(params, found)


def _converted_slice(model, model_key: str, disk_key: str, shape: tuple, converter, pattern: str) -> tuple:
    """(slice, source index, shape) of one file tensor that transformers' `converter` turns into (part of)
    `model_key`: the whole parameter in another order, or one expert's matrix (or a part of it, concatenated)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = converter.operations
    reorder = whole_tensor_reorder(model, model_key, converter, shape)
    if reorder is not None:  # one stored tensor, the parameter's values in another order
        return ExpertSlice(disk_key, reorder=reorder), None, shape
    if not (
        isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and (len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1))
    ):
        raise MergeError(
            f"the base stores {model_key} as {disk_key}, converted by transformers with "
            f"{[type(op).__name__ for op in ops]} when loading; merge-adapters maps only experts stacked (and "
            "concatenated) from per-expert tensors, or stored whole with rows or columns interleaved or "
            "transposed. Save the base with its experts fused, "
            "AutoModelForCausalLM.from_pretrained(BASE).save_pretrained(NEW_BASE, save_original_format=False), and "
            "pass that as `base`."
        )
    expert = _expert_index(pattern, disk_key)
    if expert is None:
        raise MergeError(
            f"cannot tell which expert the base's tensor {disk_key} holds (transformers converts it with the "
            f"pattern {pattern!r}). Save the base with its experts fused, AutoModelForCausalLM.from_pretrained(BASE)"
            ".save_pretrained(NEW_BASE, save_original_format=False), and pass that as `base`."
        )
    dim = ops[1].dim - 1 if len(ops) == 2 else None
    return ExpertSlice(disk_key, expert, dim), converter.source_patterns.index(pattern), shape


def _placed(params: list[str], found: dict) -> dict[str, list[ExpertSlice]]:
    """Each parameter's slices, each concatenated source's offset set from the earlier sources' sizes; an error
    for a parameter the files do not hold."""
    out = {}
    for key in params:
        pieces = found.get(key)
        if not pieces:
            raise MergeError(
                f"the adapter changes {key}, which the base's files do not hold, fused or per expert: the adapter "
                "was trained on a different model. Pass the model it was trained on as `base`."
            )
        for piece, index, shape in pieces:
            if piece.dim is not None:  # offset of this source within the concatenation: earlier sources' sizes
                sizes = {i: s[piece.dim] for p, i, s in pieces if p.expert == piece.expert}
                piece.start = sum(sizes[i] for i in range(index))
                piece.stop = piece.start + shape[piece.dim]
        out[key] = [piece for piece, _, _ in pieces]
    return out


def _expert_index(pattern: str, disk_key: str) -> int | None:
    """The expert number in `disk_key`, where `pattern` (a converter's source) has its ``*``. transformers reads a
    source as a regex whose ``*`` stands for ``.*`` (core_model_loading's glob alternation): a glob
    (``mlp.experts.*.gate_proj.weight``) and a regex (Kimi-Linear's ``\\.experts.*.w1.weight``) alike."""
    found = re.search(pattern.replace("*", "(.*)"), disk_key)
    numbers = [g for g in (found.groups() if found else ()) if g is not None and g.isdigit()]
    return int(numbers[0]) if numbers else None
