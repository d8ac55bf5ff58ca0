"""Low CPU-RAM loading under FSDP2, rank 0 included: rank 0 streams the checkpoint one tensor at a time.

With ``load_qlora_model(path, low_cpu_ram=True)`` under an FSDP2 launch, every rank - rank 0 too - builds
the quantized module tree on the meta device. Rank 0 then reads the local safetensors checkpoint one
tensor at a time, quantizes each 4-bit weight exactly as ``from_pretrained`` does (bitsandbytes'
``Params4bit(value, **meta_param.__dict__).to(device)``), sends every other rank the rows FSDP2 will keep
there, and keeps only its own. So no rank ever holds the whole quantized model, rank 0's peak is its
shard plus one tensor, and FSDP2 copies each rank's rows into its shard.

Streaming needs a checkpoint that maps one to one onto the model: local safetensors whose keys are the
model's parameter names, 4-bit weights stored in the load dtype, no modules kept in float32 and no
Conv1D layers. Anything else (a Hub id, renamed or pre-quantized keys, ...) falls back to
:func:`hf_fsdp_qlora.loading.low_ram.materialize_from_rank0`, where rank 0 loads the model whole.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import collective_device
from ..dtypes import is_params4bit
from ..rank_sync import agree_on_failure
from ._transfer import (
    _FLAG_ATTR,
    _as_bytes,
    _empty_untouched,
    _new_tensor,
    _receive_rows,
    _remember_rows,
    _row_bytes,
    _send_rows,
    _slots,
    params4bit_fields,
)

__all__ = ["stream_plan", "stream_to_ranks"]

logger = logging.getLogger(__name__)


def _checkpoint_entries(path) -> tuple[dict | None, str]:
    from ..errors import MergeError
    from ..safetensors_io import checkpoint_shards, read_header

    folder = Path(path)
    if not folder.is_dir():
        return None, f"{path} is not a local folder"
    try:
        found = checkpoint_shards(folder)
    except MergeError as err:  # a broken index: the whole load reports it
        return None, str(err)
    if found is None:
        return None, "no safetensors checkpoint"
    files = found[0]
    entries = {}
    for name in files:
        entries.update(read_header(folder / name)[0])
    return entries, ""


def _transposed(module) -> bool:
    """transformers transposes a GPT-2 style Conv1D weight before quantizing it."""
    from transformers.pytorch_utils import Conv1D

    source = getattr(module, "source_cls", None)
    return isinstance(source, type) and issubclass(source, Conv1D)


def stream_plan(model, path, dtype: torch.dtype, from_pretrained_kwargs: dict) -> dict:
    """Rank 0: ``{"entries": {name: TensorEntry} or None, "reason": why not}`` for the skeleton `model`.

    `dtype`: the load dtype; ``from_pretrained`` quantizes each 4-bit weight from a tensor of that dtype.
    """
    extra = sorted(set(from_pretrained_kwargs) - {"attn_implementation"})
    if extra:
        return {"entries": None, "reason": f"from_pretrained arguments {extra} are only honoured by a whole load"}
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        return {"entries": None, "reason": "the model keeps some modules in float32"}
    entries, reason = _checkpoint_entries(path)
    if entries is None:
        return {"entries": None, "reason": reason}

    wanted, seen = set(), set()
    for name, module, local, is_param in _slots(model):
        tensor = (module._parameters if is_param else module._buffers)[local]
        if id(tensor) in seen:
            continue  # a tied alias: the checkpoint stores the tensor once
        seen.add(id(tensor))
        if not is_param:
            wanted.add(name)
            continue
        entry = entries.get(name)
        if entry is None:
            return {"entries": None, "reason": f"the checkpoint has no tensor {name}"}
        if tuple(entry.shape) != tuple(tensor.shape):
            return {"entries": None, "reason": f"{name} is {tuple(entry.shape)} in the checkpoint"}
        if is_params4bit(tensor) and (entry.torch_dtype != dtype or _transposed(module)):
            return {"entries": None, "reason": f"{name} needs a conversion before quantizing"}
        wanted.add(name)
    unknown = sorted(set(entries) - wanted)
    if unknown:
        return {"entries": None, "reason": f"checkpoint keys the model does not name, e.g. {unknown[:3]}"}
    return {"entries": entries, "reason": ""}


def _produce(name, module, local, is_param, entries, handles, dtype):
    """Rank 0: the tensor `from_pretrained` would have put in this slot, read from the checkpoint now."""
    from ..safetensors_io import read_tensor

    tensor = (module._parameters if is_param else module._buffers)[local]
    entry = entries.get(name)
    if entry is None:  # a buffer computed at construction (rotary inv_freq): the skeleton holds it
        return tensor
    if entry.path not in handles:
        handles[entry.path] = open(entry.path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    raw = read_tensor(handles[entry.path], entry)
    if is_params4bit(tensor):
        from bitsandbytes.nn import Params4bit

        # What transformers' bnb quantizer does with each checkpoint tensor (of the load dtype).
        return Params4bit(raw.to(dtype), requires_grad=False, **tensor.__dict__).to(raw.device)
    return raw.to(tensor.dtype)


def _describe(tensor, is_param: bool, requires_grad: bool) -> dict:
    entry = {"param": is_param, "shape": tuple(tensor.shape), "dtype": tensor.dtype, "on_cpu": True}
    if is_param:
        entry["requires_grad"] = requires_grad  # as from_pretrained leaves it: the skeleton's
    if is_params4bit(tensor):
        entry["params4bit"] = params4bit_fields(tensor)
    return entry


@torch.no_grad()
def stream_to_ranks(model, entries: dict | None, shard_world: int, dtype: torch.dtype, src: int = 0) -> int:
    """Collective: fill every rank's skeleton `model` from rank `src`'s checkpoint `entries`, one tensor at a time.

    Parameters arrive as the rows FSDP2 over `shard_world` ranks keeps on each rank (rank `src` keeps its
    own rows of what it read); buffers arrive whole. Returns the number of tensors filled.
    """
    is_src = dist.get_rank() == src
    device = collective_device()
    made, first_name, handles, count = {}, {}, {}, 0
    try:
        for name, module, local, is_param in list(_slots(model)):
            store = module._parameters if is_param else module._buffers
            key = id(store[local])
            if key in first_name:  # tied: the same skeleton tensor on every rank
                store[local] = made[first_name[key]]
                continue
            first_name[key] = name
            error, tensor, described = None, None, [None]
            if is_src:
                try:
                    requires_grad = store[local].requires_grad
                    tensor = _produce(name, module, local, is_param, entries, handles, dtype)
                    described[0] = _describe(tensor, is_param, requires_grad)
                except Exception as err:  # noqa: BLE001 - shared with every rank below
                    error = err
            agree_on_failure(error)
            dist.broadcast_object_list(described, src=src)
            entry = described[0]
            if is_param and len(entry["shape"]) >= 1:
                if is_src:
                    data = tensor.data.contiguous()
                    _send_rows(data, device, shard_world, src)
                    first, end, total = _row_bytes(entry["shape"], entry["dtype"], src, shard_world)
                    kept = _empty_untouched(entry["shape"], entry["dtype"], torch.device("cpu"))
                    _as_bytes(kept)[first:end].copy_(_as_bytes(data)[first:end])
                    _remember_rows(module, local, first, end, total)
                    del tensor, data
                else:
                    kept = _receive_rows(entry, module, local, device, shard_world, src)
            else:
                kept = tensor.data.contiguous() if is_src else torch.empty(entry["shape"], dtype=entry["dtype"])
                if kept.numel():
                    staged = kept.to(device)
                    dist.broadcast(staged, src=src)
                    if staged is not kept:
                        kept.copy_(staged)
            made[name] = store[local] = _new_tensor(entry, module, kept)
            count += 1
    finally:
        for handle in handles.values():
            handle.close()
    object.__setattr__(model, _FLAG_ATTR, True)
    return count
