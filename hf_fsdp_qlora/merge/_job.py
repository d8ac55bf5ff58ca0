"""The merge's planning steps, in the order :func:`hf_fsdp_qlora.merge.pipeline.merge_adapters` runs them.

Each step reads files (never a live model) and returns what the next needs: the base's config, the adapter's updates
keyed by the base checkpoint's names, what training quantized, the output items, the output config, and a folder
with room for them. Writing the shards is :mod:`hf_fsdp_qlora.merge.pipeline`'s.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

from hf_fsdp_qlora.errors import MergeError, MergeUsageError
from hf_fsdp_qlora.merge._base_model import (
    architecture_meta_models,
    conv1d_modules,
    is_input_embedding,
    meta_model_or_none,
    quantized_keys,
    task_model,
    tied_map,
)
from hf_fsdp_qlora.merge._experts import read_param_targets
from hf_fsdp_qlora.merge._key_map import follow_checkpoint_keys, places_covering, quantized_places
from hf_fsdp_qlora.merge._lora_math import collect_updates
from hf_fsdp_qlora.merge._plan import plan, torch_dtype
from hf_fsdp_qlora.merge._quant_settings import quant_settings
from hf_fsdp_qlora.merge.output_dir import AtomicOutputDir

__all__ = [
    "adapter_updates",
    "check_quant_options",
    "output_with_room",
    "planned_items",
    "quantized_layout",
    "read_base_config",
    "update_config",
]


def check_quant_options(skip_modules, dequantize, double_quant, blocksize) -> None:
    """Options that describe training's quantization, refused without the `dequantize` they apply to."""
    if skip_modules and not dequantize:
        raise MergeUsageError(
            f"`skip_modules` {list(skip_modules)} only applies with `dequantize` (the layers training kept 16-bit): "
            "pass dequantize='int8' (or nf4/fp4) too, or leave skip_modules out"
        )
    for name, value in (("double_quant", double_quant), ("quant_blocksize", blocksize)):
        if value is not None and dequantize not in ("nf4", "fp4"):
            raise MergeUsageError(
                f"`{name}` only applies with `dequantize` nf4 or fp4 (a 4-bit training's settings), not with "
                f"dequantize={dequantize!r}: pass dequantize='nf4' (or fp4) too, or leave {name} out"
            )


def read_base_config(base: Path) -> dict:
    """The base's config.json; a quantized base is refused (merging needs the 16-bit weights it was made from)."""
    config = json.loads((base / "config.json").read_text())
    if config.get("quantization_config"):
        raise MergeError(
            f"{base} is a quantized checkpoint (config.json has quantization_config): merging needs the 16-bit "
            "base the quantized model was made from; pass that as `base` (and `dequantize='nf4'` to match QLoRA)."
        )
    return config


def adapter_updates(base: Path, loaded, entries: dict):
    """The adapter's updates keyed by the base checkpoint's tensor names, the Conv1D modules (transposed
    weights) and where the model's classes rename or split checkpoint keys on load."""
    params = read_param_targets(base, loaded.config, entries) if loaded.config.get("target_parameters") else None
    skeleton = meta_model_or_none(base)  # what only the model's classes say: Conv1D, key conversions
    conv1d = conv1d_modules(skeleton)
    updates = collect_updates(loaded.config, loaded.tensors, params, transposed=conv1d)
    # renamed or split on load, under the class the adapter names (causal-LM, or config.json's architectures)
    models = itertools.chain([skeleton] if skeleton is not None else [], architecture_meta_models(base))
    places = places_covering(models, entries, updates)
    return follow_checkpoint_keys(updates, places, entries), conv1d, places


def quantized_layout(base, loaded, entries, places, *, dequantize, dequantize_experts, skip_modules, double_quant,
                     blocksize):  # fmt: skip
    """What training quantized (tensor names, expert groups, fused chunks) and the 4-bit settings to round-trip
    with: the record saved with the adapter, else transformers' rule (experts by the experts table, 4-bit only)
    with the settings a pre-quantized base or the caller gives (:mod:`._quant_settings`), else nothing."""
    settings = quant_settings(loaded.folder, loaded.config, dequantize, double_quant, blocksize)
    record = settings.record
    if record is not None:  # what training quantized, recorded when the adapter was saved: exactly those
        quantized, groups, chunks = quantized_places(base, record.names, entries, places)
        return quantized, groups, chunks, settings.double_quant, settings.blocksize
    if dequantize:  # stock peft: transformers' rule; experts (4-bit only) by the experts table
        experts = dequantize_experts and dequantize != "int8"
        skip = [*skip_modules, *settings.skip_modules]
        keys = quantized_keys(base, experts=experts, skip_modules=skip)
        return (*quantized_places(base, keys, entries, places), settings.double_quant, settings.blocksize)
    return set(), {}, {}, settings.double_quant, settings.blocksize


def planned_items(base, config, loaded, entries, updates, layout, conv1d, *, out_dtype, untie_embeddings, device):
    """The output tensors in order (each with its expert group, transposition and fused chunks), whether tied
    embeddings were untied, and the task head's model (a reward model's score head) or None."""
    quantized, groups, chunks = layout
    tied = tied_map(base, config, entries)
    fold_tied_layers(updates, meta_model_or_none(base), entries, tied)
    heads = {
        k: tuple(u.replacement.shape)
        for k, u in updates.items()
        if k not in entries and k not in tied and u.replacement is not None and u.lora is None
    }
    task = task_model(base, config, loaded.config, heads) if heads else None
    base_model = loaded.config.get("base_model_name_or_path")
    items, untied = plan(entries, updates, tied, out_dtype, quantized, untie_embeddings, device, base_model, task)
    for item in items:
        item.group = groups.get(item.name)
        item.transposed = item.name.removesuffix(".weight") in conv1d
        item.chunks = chunks.get(item.name)
    return items, untied, task


def _same_update(one, other) -> bool:
    """Whether two updates change a tensor alike (their LoRA factors, scaling, bias, replaced rows all equal)."""
    import torch

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, tuple) and isinstance(y, tuple):
            return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
        return x == y

    fields = ("replacement", "lora_bias", "token_rows")
    if not all(same(getattr(one, f), getattr(other, f)) for f in fields):
        return False
    if one.lora is None or other.lora is None:
        return one.lora is other.lora
    lora = ("a", "b", "scaling", "embedding", "fan_in_fan_out", "magnitude")  # not `module`: the names differ
    return all(same(getattr(one.lora, f), getattr(other.lora, f)) for f in lora)


def fold_tied_layers(updates: dict, skeleton, entries: dict, tied: dict) -> None:
    """Updates of a layer the model ties to another (Zamba's one attention block shared by its hybrid layers: the
    checkpoint stores it once, under the first layer) onto the stored tensor. Training ran one module under both
    names, so peft's adapter holds the same LoRA under each (its merge_and_unload merges it once); different
    updates cannot come from one module and are refused. Tied embeddings (`tied`) are the plan's to resolve."""
    ties = getattr(skeleton, "all_tied_weights_keys", None) or {}
    for alias, source in ties.items():
        if alias in tied or alias in entries or alias not in updates or source not in entries:
            continue
        update = updates.pop(alias)
        if source not in updates:
            updates[source] = update
        elif not _same_update(update, updates[source]):
            raise MergeError(
                f"the base ties {alias} to {source} (one layer shared by both places, stored once), but the adapter "
                f"changes them differently ({update.sources[0]} and {updates[source].sources[0]}): one shared layer "
                "cannot hold both. Train without LoRA on the shared layer (load_qlora_model's all-linear leaves it out)."
            )


def update_config(config: dict, items, task, out_dtype, untied: bool) -> None:
    """The output's config.json: the task's class, a resized vocabulary, the output dtype, untied embeddings."""
    if task is not None:  # e.g. a reward model: loads with AutoModelForSequenceClassification
        config.update(task[2])
    vocab = next((item.shape[0] for item in items if item.resized and is_input_embedding(item.name)), None)
    if vocab is not None:  # embeddings resized for added tokens (e.g. ChatML) and saved whole with the adapter
        for cfg in (config, config.get("text_config")):
            if isinstance(cfg, dict) and ("vocab_size" in cfg or cfg is config):
                cfg["vocab_size"] = vocab
    # Always said, also when the base's dtype is kept: engines serve config.json's dtype for `--dtype auto`
    # (vLLM falls back to its own default where it is missing).
    written = out_dtype or _dominant_dtype(items)
    if written is not None:
        config["dtype"] = str(written).removeprefix("torch.")
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
    if untied:
        for cfg in (config, config.get("text_config")):
            if isinstance(cfg, dict):
                cfg["tie_word_embeddings"] = False


def _dominant_dtype(items):
    """The floating dtype holding most of the written bytes (a base may keep a few tensors, e.g. norms, in fp32)."""
    sizes = {}
    for item in items:
        dtype = torch_dtype(item.dtype)
        if dtype.is_floating_point:
            sizes[dtype] = sizes.get(dtype, 0) + item.nbytes
    return max(sizes, key=sizes.get) if sizes else None


def output_with_room(output: Path, needed: int) -> AtomicOutputDir:
    """The atomic output folder, once the disk has room for `needed` bytes (refused before anything is written)."""
    # Leftovers of killed runs go first: on a tight disk they may hold the room this merge needs.
    atomic = AtomicOutputDir(output, "merge-adapters")
    existing = next(p for p in output.absolute().parents if p.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise no_space(output, needed, free)
    return atomic


def no_space(output: Path, needed: int | None, free: int | None) -> MergeError:
    sizes = f" (the merged model needs {needed / 1e9:.2f} GB, {free / 1e9:.2f} GB are free)" if needed else ""
    return MergeError(
        f"no space left on the device for `output` {output}{sizes}; nothing was written. Free disk space, or pass "
        "an `output` on a disk with room for the merged model."
    )
