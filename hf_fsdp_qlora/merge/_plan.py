"""What the merge writes: one planned item per output tensor, in base file order.

Each item says where its tensor comes from (a base tensor, or one computed ahead: tied embeddings, a task
head the base lacks) and what happens to it (the adapter's update, a 4-bit round trip, a new dtype or a
vocabulary resized for added tokens). Tied weights are resolved here, before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.merge._base_model import resized_vocab
from hf_fsdp_qlora.merge._lora_math import TensorUpdate, apply_update, check_shape
from hf_fsdp_qlora.safetensors_io import DTYPE_NAMES, TORCH_DTYPES, TensorEntry, read_tensor

__all__ = ["Item", "plan", "torch_dtype"]


@dataclass
class Item:
    """One output tensor: where it comes from and what happens to it."""

    name: str
    entry: TensorEntry  # the base tensor it is computed from
    dtype: str  # output safetensors dtype name
    update: TensorUpdate | None = None
    quantize: bool = False
    ready: torch.Tensor | None = None  # computed ahead (tied embeddings, task heads the base lacks)
    resized: tuple[int, ...] | None = None  # the output shape, where the adapter resized the vocabulary
    group: object = None  # a slice of an expert quantized as one matrix: (its entries, dim, start, stop); or a
    # parameter stored in another order (experts.orders.Reorder)
    transposed: bool = False  # a Conv1D weight, stored (in, out): bitsandbytes quantized its transpose
    chunks: tuple[bool, ...] | None = None  # layers stored as equal row chunks: which of them were quantized

    @property
    def shape(self) -> tuple[int, ...]:
        return self.resized or tuple(self.entry.shape)

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch_dtype(self.dtype).itemsize

    @property
    def passthrough(self) -> bool:
        return self.update is None and self.ready is None and not self.quantize and self.dtype == self.entry.dtype


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``"BF16"`` -> ``torch.bfloat16``)."""
    return TORCH_DTYPES[name]


def _resolve_ties(entries, updates, tied, dtype_of, untie: bool, device) -> tuple[dict, dict]:
    """Merge tied embeddings ahead; returns ({name: item} computed now, {source: alias item} to write untied)."""
    ready, untied = {}, {}
    for alias, source in tied.items():
        src_up, alias_up = updates.get(source), updates.get(alias)
        if src_up is None and alias_up is None:
            continue
        entry = entries[source]
        with open(entry.path, "rb", buffering=0) as fh:
            stored = read_tensor(fh, entry)
        # What each side of the tie was in training: both start from the one stored tensor.
        a = apply_update(stored, src_up, device) if src_up else stored.to(device, torch.float32)
        b = apply_update(stored, alias_up, device) if alias_up else stored.to(device, torch.float32)
        if alias_up is None and src_up is not None and src_up.token_rows is not None and src_up.lora is None:
            b = a  # peft gives the tied output head the embedding's trainable-token rows too
        if a.shape != b.shape:  # one side saved resized (added tokens): in training both were that one tensor
            a = b = a if a.shape != stored.shape else b
        out = torch_dtype(dtype_of(entry))
        if torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max())):
            ready[source] = Item(source, entry, dtype_of(entry), ready=a.to(out), resized=tuple(a.shape))
        elif untie:
            ready[source] = Item(source, entry, dtype_of(entry), ready=a.to(out), resized=tuple(a.shape))
            untied[source] = Item(alias, entry, dtype_of(entry), ready=b.to(out), resized=tuple(b.shape))
        else:
            changed, other = (source, alias) if src_up is not None else (alias, source)
            raise MergeError(
                f"the base ties {alias} to {source} (tie_word_embeddings=true), but the adapter changes them "
                f"differently ({changed} via {(src_up or alias_up).sources[0]}); in training {other} did not see "
                "that change, and one tied tensor cannot hold both. Pass `untie_embeddings=True` to write "
                f"{alias} separately (sets tie_word_embeddings=false; one more vocab x hidden tensor), or train "
                "with LoraConfig(ensure_weight_tying=True) so both sides share the update."
            )
    return ready, untied


def plan(entries, updates, tied, out_dtype, quantized, untie, device, base_model, task=None):
    """The output tensors in base file order (tied weights stored once); returns (items, whether untied).

    `task`: `(class name, its tensor names, config updates)` when the adapter carries a task head the base
    lacks (see :func:`task_model`): the head is added and base tensors the task model has not are left out.
    """
    task_names = task[1] if task else None
    unknown = sorted(k for k in updates if k not in entries and k not in tied)
    no_bias = [k for k in unknown if updates[k].lora_bias is not None and updates[k].replacement is None]
    if no_bias:
        raise MergeError(
            f"the adapter has a LoRA bias for {no_bias[0].removesuffix('.bias')} (lora_bias=True), but that layer has "
            "no bias in the base, so the bias cannot be merged (peft cannot either). Train with lora_bias=False, or "
            "target only layers with a bias."
        )
    added = [k for k in unknown if task_names and k in task_names and updates[k].lora is None]
    unknown = [k for k in unknown if k not in added]
    if unknown:
        raise MergeError(
            f"the adapter changes {len(unknown)} tensor(s) the base does not have, e.g. {unknown[:4]} (from "
            f"{updates[unknown[0]].sources[0]}): the adapter was trained on a different model (adapter_config.json: "
            f"base_model_name_or_path={base_model!r}). Pass the model it was trained on as `base`."
        )
    shapes = {}  # base tensor -> the shape the adapter gives it (a vocabulary resized for added tokens)
    for key, update in updates.items():
        if key in added:
            continue
        base_shape = tuple(entries[tied.get(key, key)].shape)
        if update.replacement is not None and resized_vocab(key, tuple(update.replacement.shape), base_shape):
            shapes[key] = base_shape = tuple(update.replacement.shape)
        check_shape(key, update, base_shape, base_model)

    def dtype_of(entry: TensorEntry) -> str:
        floating = entry.torch_dtype.is_floating_point
        return DTYPE_NAMES[out_dtype] if out_dtype is not None and floating else entry.dtype

    ready, untied = _resolve_ties(entries, updates, tied, dtype_of, untie, device)
    items = []
    for name, entry in entries.items():
        if name in tied or (task_names is not None and name not in task_names):
            continue  # a second stored copy of a tied weight (written once, like save_pretrained), or not in the task model
        update = updates.get(name)
        replaced = update is not None and update.replacement is not None
        items.append(
            ready.get(name)
            or Item(name, entry, dtype_of(entry), update, name in quantized and not replaced, resized=shapes.get(name))
        )
        if name in untied:
            items.append(untied[name])
    # A task head the base lacks (the `score` of a reward model), as trained: in the dtype of the model.
    like = next(iter(entries.values()))
    for name in added:
        tensor = updates[name].replacement
        entry = TensorEntry(name, dtype_of(like), tuple(tensor.shape), 0, 0, like.path)
        items.append(Item(name, entry, entry.dtype, ready=tensor.to(torch_dtype(entry.dtype)).contiguous()))
    return items, bool(untied)
