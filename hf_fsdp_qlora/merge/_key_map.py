"""Where a base's files hold the weights of the model's linear layers when transformers renames or splits them.

A few families store a layer under another name than the model's module (LFM3: `self_attn.gate_proj` on disk is the
model's `self_attn.g_proj`), or several layers in one tensor that transformers splits into equal row chunks when it
loads it (HRM: `attn.gqkv_proj.weight` holds `self_attn.gate_proj`, `q_proj`, `k_proj` and `v_proj`;
`mlp.gate_up_proj.weight` holds `mlp.gate_proj` and `up_proj`). transformers' own conversion mapping (the one
`from_pretrained` applies, and `save_pretrained` reverses) says which; the adapter names the model's modules. The merge
writes the base's layout: each LoRA goes to the rows of the file tensor its layer came from, and the 4-bit round trip
of `dequantize` runs on each chunk, as each layer was quantized on its own in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.merge._lora_math import LoraFactors, TensorUpdate

__all__ = [
    "Place",
    "checkpoint_places",
    "chunked_quantization",
    "follow_checkpoint_keys",
    "places_covering",
    "quantized_places",
]


@dataclass
class Place:
    """Where a model weight lies in the base's files: `disk_key`, chunk `index` of its `chunks` equal row chunks."""

    disk_key: str
    index: int = 0
    chunks: int = 1


def checkpoint_places(model, entries) -> dict[str, Place]:
    """{model weight name: its place} for every file tensor transformers renames or splits into row chunks when it
    loads `model` (built on the meta device); a tensor it stacks or converts otherwise is left out (experts:
    :mod:`._experts`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not transforms:
        return {}
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    places = {}
    for disk_key in entries:
        model_key, pattern = rename_source_key(disk_key, renamings, converters)
        if pattern is None:
            if model_key != disk_key:
                places[model_key] = Place(disk_key)
            continue
        converter = by_pattern[pattern]
        ops, targets = converter.operations, list(converter.target_patterns)
        if not (
            len(ops) == 1 and isinstance(ops[0], Chunk) and ops[0].dim == 0 and ops[0].num_shards_attribute is None
        ):
            continue
        if not model_key.endswith(targets[0]):
            raise MergeError(
                f"transformers splits the base's tensor {disk_key} into {targets} when it loads it, and merge-adapters "
                "cannot tell which rows are which layer. Save the base in the model's own layout, "
                "AutoModelForCausalLM.from_pretrained(BASE).save_pretrained(NEW_BASE, save_original_format=False), "
                "and pass that as `base`."
            )
        stem = model_key[: len(model_key) - len(targets[0])]
        for index, target in enumerate(targets):
            places[stem + target] = Place(disk_key, index, len(targets))
    return places


def prefix_places(model, entries) -> dict[str, Place]:
    """{model weight name: its place} for the file tensors transformers loads into `model` by dropping its
    ``base_model_prefix``: a text-only class (``MllamaForCausalLM``, ``Llama4ForCausalLM``) reads a composite
    checkpoint's ``language_model.model.layers...`` as its ``model.layers...``."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix:
        return {}
    names = {name for name, _ in model.named_parameters()}
    places = {}
    for disk_key in entries:
        inner = disk_key[len(prefix) + 1 :] if disk_key.startswith(f"{prefix}.") else None
        if inner is not None and inner in names and inner not in entries:
            places[inner] = Place(disk_key)
    return places


def places_covering(models, entries, keys) -> dict[str, Place]:
    """The places (:func:`checkpoint_places`, :func:`prefix_places`) of the first class in `models` (meta models,
    the causal-LM class first) under which every one of `keys` (the adapter's model weight names) lies in the base's
    files: an adapter names the modules of the class it was trained on (trl's loader picks Mllama's composite
    class, ``AutoModelForCausalLM`` its text-only one). None covering: the first class's (the merge then names
    what the base lacks)."""
    first = None
    for model in models:
        places = {**prefix_places(model, entries), **checkpoint_places(model, entries)}
        first = places if first is None else first
        if all(key in entries or key in places for key in keys):
            return places
    return first or {}


def follow_checkpoint_keys(updates: dict[str, TensorUpdate], places: dict[str, Place], entries):
    """`updates` keyed by the base's file tensors: a renamed layer's update moves to its file name, and the updates
    of the layers one file tensor holds become one low-rank update of that tensor (each layer's factors on its rows)."""
    out, chunked = {}, {}
    for key, update in updates.items():
        place = places.get(key) if key not in entries else None
        if place is None:
            out[key] = update
        elif place.chunks == 1:
            if place.disk_key in out or place.disk_key in updates:
                raise MergeError(f"the adapter changes both {key} and {place.disk_key}, which the base stores as one")
            out[place.disk_key] = update
        else:
            chunked.setdefault(place.disk_key, {})[place.index] = (key, update)
    for disk_key, parts in chunked.items():
        if disk_key in out:
            raise MergeError(f"the adapter changes {disk_key} both whole and through the layers it holds")
        out[disk_key] = _joined(disk_key, parts, places, entries)
    return out


def _joined(disk_key: str, parts: dict, places, entries) -> TensorUpdate:
    """One update of the file tensor `disk_key` from its layers' LoRA updates: B placed on each layer's rows."""
    rows = entries[disk_key].shape[0]
    chunks = next(places[key].chunks for key, _ in parts.values())
    step = rows // chunks
    for key, update in parts.values():
        f = update.lora
        if (
            f is None
            or update.replacement is not None
            or update.lora_bias is not None
            or update.token_rows is not None
        ):
            raise MergeError(
                f"the adapter changes {key} ({update.sources[0]}) in a way merge-adapters cannot write into the base's "
                f"tensor {disk_key}, which holds {chunks} layers: only plain LoRA merges there. Save the base in the "
                "model's own layout, AutoModelForCausalLM.from_pretrained(BASE).save_pretrained(NEW_BASE, "
                "save_original_format=False), and pass that as `base`."
            )
        if f.magnitude is not None or f.embedding or f.fan_in_fan_out:
            raise MergeError(
                f"{key} uses DoRA or a transposed LoRA, which merge-adapters cannot write into {disk_key}"
            )
    factors = [parts[i][1].lora for i in sorted(parts)]
    same = len({f.scaling for f in factors}) == 1
    dtype = (
        factors[0].a.dtype if len({f.a.dtype for f in factors} | {f.b.dtype for f in factors}) == 1 else torch.float32
    )
    rank = sum(f.a.shape[0] for f in factors)
    a = torch.cat([f.a.to(dtype) for f in factors])
    b = torch.zeros(rows, rank, dtype=dtype if same else torch.float32)
    column = 0
    for index in sorted(parts):
        f = parts[index][1].lora
        r = f.a.shape[0]
        # each layer's rows get only its own factors: the other columns are exact zeros
        b[index * step : (index + 1) * step, column : column + r] = f.b if same else f.b.float() * f.scaling
        column += r
    sources = [s for i in sorted(parts) for s in parts[i][1].sources]
    lora = LoraFactors(a, b, factors[0].scaling if same else 1.0, False, False, None, disk_key)
    return TensorUpdate(lora=lora, sources=sources)


def chunked_quantization(names, places: dict[str, Place], entries) -> tuple[set[str], dict[str, tuple[bool, ...]]]:
    """The quantized weights `names` (model names) that lie elsewhere in the files: (the file tensors of renamed
    ones, {file tensor: which of its row chunks were quantized} for split ones); the others are not returned."""
    renamed, chunks = set(), {}
    for name in names:
        place = places.get(name) if name not in entries else None
        if place is None:
            continue
        if place.chunks == 1:
            renamed.add(place.disk_key)
        else:
            flags = chunks.setdefault(place.disk_key, [False] * place.chunks)
            flags[place.index] = True
    return renamed, {key: tuple(flags) for key, flags in chunks.items()}


def quantized_places(base, names, entries, places: dict[str, Place]):
    """:func:`._experts.quantized_files` for `names`, with renamed and split layers followed to their file tensors:
    (the file tensors to round-trip, the expert groups, {file tensor: which row chunks were quantized})."""
    from hf_fsdp_qlora.merge._experts import quantized_files

    names = set(names)
    renamed, chunks = chunked_quantization(names, places, entries)
    rest = {n for n in names if n in entries or n not in places}
    keys, groups = quantized_files(base, rest, entries)
    return keys | renamed | set(chunks), groups, chunks
