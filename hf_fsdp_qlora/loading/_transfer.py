"""Rank-to-rank tensor transfer for low CPU-RAM loading, shared by the in-memory and the streamed path.

Rank 0 sends each tensor (or, for an FSDP2 launch, only the dim-0 rows FSDP2 will keep on each receiving rank);
a receiving rank allocates the full tensor untouched and writes only its byte range, and remembers that range so
the model can be checked once FSDP2 has sharded it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ROWS_ATTR = "_hf_fsdp_qlora_received_bytes"  # on a module: {param name: (first byte, end byte, total bytes)}
_FLAG_ATTR = "_hf_fsdp_qlora_partial_rows"  # on the base model, every rank: partial rows were sent


def params4bit_fields(tensor) -> dict:
    """What rebuilds a 4-bit weight exactly on another rank: its Params4bit fields and the quant state object
    itself (a few small tensors; pickling keeps every field exact)."""
    return {
        key: getattr(tensor, key)
        for key in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "quant_state")
    }


def _slots(model):
    """Every (qualified name, owning module, local name, is_parameter) in a fixed order, tied ones included."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for local, tensor in module._parameters.items():
            if tensor is not None:
                yield prefix + local, module, local, True
        for local, tensor in module._buffers.items():
            if tensor is not None:
                yield prefix + local, module, local, False


def _new_tensor(entry, module, data):
    if "params4bit" in entry:
        from bitsandbytes.nn import Params4bit

        # bitsandbytes restores weight.quant_state from module.quant_state when FSDP2 hands the layer a
        # plain (all-gathered) tensor; quantizing sets it on rank 0, so set it here too.
        module.quant_state = entry["params4bit"]["quant_state"]
        return Params4bit(data, requires_grad=False, module=module, bnb_quantized=True, **entry["params4bit"])
    if entry["param"]:
        return torch.nn.Parameter(data, requires_grad=entry["requires_grad"])
    return data


def _row_bytes(shape, dtype, rank: int, world: int) -> tuple[int, int, int]:
    """(first byte, end byte, total bytes) of the dim-0 rows FSDP2 keeps on `rank` (``torch.chunk`` layout)."""
    rows = shape[0]
    row_bytes = dtype.itemsize
    for dim in shape[1:]:
        row_bytes *= dim
    per_rank = -(-rows // world)
    first = min(rows, rank * per_rank)
    end = min(rows, first + per_rank)
    return first * row_bytes, end * row_bytes, rows * row_bytes


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _empty_untouched(shape, dtype, device) -> torch.Tensor:
    # Deterministic mode would fill new memory with NaN, touching (and making resident) every page.
    from torch.utils import deterministic

    fill, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    finally:
        deterministic.fill_uninitialized_memory = fill


def _guard(module, args):
    if getattr(module, _ROWS_ATTR, None) is not None:
        raise RuntimeError(
            "hf_fsdp_qlora: this rank holds only its FSDP2 shard of the base weights (load_qlora_model("
            "low_cpu_ram=True) under an FSDP2 launch), and the model has not been checked since FSDP2 wrapped "
            "it. Train it with FSDPQLoRATrainer / FSDPQLoRASFTTrainer (or add FSDPQLoRACallback to your trainer), "
            "or load with low_cpu_ram=False to use the model outside FSDP2."
        )


def _send_rows(data: torch.Tensor, device, world: int, src: int) -> None:
    flat = _as_bytes(data)
    for rank in range(world):
        first, end, _ = _row_bytes(tuple(data.shape), data.dtype, rank, world)
        if rank == src or end == first:
            continue
        dist.send(flat[first:end].to(device), dst=rank)


def _receive_rows(entry, module, local, device, world: int, src: int) -> torch.Tensor:
    shape, dtype = entry["shape"], entry["dtype"]
    first, end, total = _row_bytes(shape, dtype, dist.get_rank(), world)
    home = torch.device("cpu") if entry["on_cpu"] else device
    full = _empty_untouched(shape, dtype, home)
    if end > first:
        region = _as_bytes(full)[first:end]
        if region.device == device:
            dist.recv(region, src=src)
        else:
            staged = torch.empty(end - first, dtype=torch.uint8, device=device)
            dist.recv(staged, src=src)
            region.copy_(staged)
    _remember_rows(module, local, first, end, total)
    return full


def _remember_rows(module, local: str, first: int, end: int, total: int) -> None:
    """Note that `module.<local>` holds only bytes [first, end) of its `total`; guard the module until checked."""
    rows = getattr(module, _ROWS_ATTR, None)
    if rows is None:
        rows = {}
        object.__setattr__(module, _ROWS_ATTR, rows)
        module.register_forward_pre_hook(_guard)
    rows[local] = (first, end, total)
