"""Keep ranks in step before wrapping: identical adapters on every rank, and failures that end every rank.

torch 2.13 seeds each process differently, so without a seed every rank initialises its LoRA weights
differently; with ``sync_module_states`` off (always on CPU, optional on GPU) FSDP then shards the
adapters from different initialisations and training starts from a model that exists on no rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .distributed import collective_device, is_distributed

__all__ = ["broadcast_trainable_parameters", "agree_on_failure"]


@torch.no_grad()
def broadcast_trainable_parameters(model, src: int = 0) -> int:
    """Make every trainable parameter (adapters, ``modules_to_save``, new heads) equal to rank `src`'s.

    Ranks first compare a checksum per parameter (one small all-gather); only the parameters that
    differ - freshly initialised ones such as LoRA A matrices or a new classification head - are
    broadcast, in one flat buffer per dtype. Weights every rank loaded from the same checkpoint (a
    full fine-tune's whole model) never travel. Parameters on the meta device (non-zero ranks under
    ``cpu_ram_efficient_loading``) are left to FSDP's ``sync_module_states``.

    Returns:
        The number of parameters broadcast (0 when not distributed or when all ranks already agree).
    """
    if not is_distributed():
        return 0
    params = [p for p in model.parameters() if p.requires_grad and p.device.type != "meta"]
    if not params:
        return 0
    device = collective_device()
    sums = torch.stack([torch.stack([p.double().sum(), p.double().abs().sum()]) for p in params]).to(device)
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    differs = torch.zeros(len(params), dtype=torch.bool, device=device)
    for other in gathered:
        differs |= (other != gathered[src]).any(dim=1)
    differing = [p for p, d in zip(params, differs.tolist()) if d]
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in differing:
        by_dtype.setdefault(param.dtype, []).append(param)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        group = by_dtype[dtype]
        flat = torch.cat([p.detach().reshape(-1).to(device) for p in group])
        dist.broadcast(flat, src=src)
        offset = 0
        for param in group:
            numel = param.numel()
            param.copy_(flat[offset : offset + numel].view_as(param))
            offset += numel
    return len(differing)


def agree_on_failure(error: BaseException | None) -> None:
    """Collective: every rank calls this with the error it hit (or None); if any rank failed, all raise.

    A check that fails on one rank only would otherwise leave the others waiting in the next collective
    until the timeout. The failing rank re-raises its own error; the others raise a RuntimeError that
    points at it.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    flag = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=collective_device())
    failed = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(failed, flag)
    if error is not None:
        raise error
    bad = [rank for rank, f in enumerate(failed) if int(f.item())]
    if bad:
        raise RuntimeError(
            f"hf_fsdp_qlora: rank(s) {bad} refused the setup before FSDP wrapping; see their error above. "
            "This rank stops too, so no process is left waiting in a collective."
        )
