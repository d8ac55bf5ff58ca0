"""Ulysses attention: an attention function registered with transformers' attention interface.

Under sequence parallelism (:mod:`hf_fsdp_qlora.train.sequence_parallel`) each of the ``sp_size`` ranks of a group
holds a contiguous ``1/sp_size`` of every sequence's tokens. Everything in a decoder layer but the core attention
works token by token, so it runs on the local tokens unchanged; the attention needs every token of the sequence.
Around it, one all-to-all trades the sequence split for a head split (each rank then holds ``heads/sp_size`` heads
of the whole sequence), the model's own attention implementation (SDPA) runs on that, and a second all-to-all
trades back. The collectives are differentiable (their backward is the reverse all-to-all), so each rank's LoRA
gradients are its tokens' share and the shares sum, over the group, to the whole sequence's gradient.

Registered with ``AttentionInterface.register`` (no model class is patched): the model's
``config._attn_implementation`` names :data:`ATTENTION_NAME` and the function looks up the implementation it
replaced. A mask function that returns no mask is registered under the same name: the local ``attention_mask``
transformers would build covers local tokens only; the function builds the whole sequence's mask itself from the
global position ids (causal, and block-causal for padding-free packed sequences).

Key/value heads fewer than ``sp_size``, or not divisible by it (grouped-query attention), are replicated to the
query heads before the exchange: exact, at the cost of sending ``num_heads / num_key_value_heads`` times more
key/value bytes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = [
    "ATTENTION_NAME",
    "UlyssesGroup",
    "active_group",
    "document_ids",
    "gather_sequence",
    "register_ulysses_attention",
    "ulysses_attention",
]

ATTENTION_NAME = "hf_fsdp_qlora_ulysses"


@dataclasses.dataclass
class UlyssesGroup:
    """The sequence-parallel group this rank belongs to, and what one forward needs to know of the whole batch."""

    sp_size: int
    group: object  # torch.distributed ProcessGroup of the sp_size ranks sharing each sequence
    inner: str = "sdpa"  # the attention implementation the model had, run on the head-split whole sequence
    sp_rank: int = 0  # which contiguous chunk of each sequence this rank holds
    dp_index: int = 0  # which data-parallel group (of sp_size ranks) this rank belongs to
    global_position_ids: torch.Tensor | None = None  # [batch, whole sequence]: set per forward when packed
    length: int | None = None  # the batch's whole sequence length (before the split's padding): set per forward
    gather_outputs: bool = False  # make the model's sequence-shaped outputs whole (logits for a loss or predictions)
    aux_divisor: float = 1.0  # what the split's loss scale multiplies the model's loss by (router aux loss)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` over equal chunks of dim 0, differentiable: chunk j goes to rank j, and the
    gradient of what came from rank i goes back to rank i, by the same exchange. (torch's differentiable one in
    ``torch.distributed.nn.functional`` is deprecated in favour of a private module.)"""

    @staticmethod
    def forward(ctx, send: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        send = send.contiguous()
        # contiguous_format: the collective writes the buffer's storage in row-major order, whatever its strides
        received = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(received, send, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # a permuted gradient's empty_like would keep its strides and scramble the result
        sent_back = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(sent_back, grad, group=ctx.group)
        return sent_back, None


class _AllGather(torch.autograd.Function):
    """``dist.all_gather`` over the group, stacked on a new dim 0, differentiable. Every rank's loss then uses the
    whole (the same on every rank of the group), so the backward sums the group's gradients of the whole and keeps
    this rank's part: over the group, each token's gradient is counted once per rank, as each rank's loss counts it."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(part, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]  # fmt: skip
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None


def gather_sequence(part: torch.Tensor, group: UlyssesGroup, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of the sequence (along `dim`) made whole over the group, the split's padding dropped."""
    parts = _AllGather.apply(part, group.group, group.sp_rank)
    return torch.cat(parts.unbind(0), dim=dim).narrow(dim, 0, group.length).contiguous()  # users .view() logits


_ACTIVE: list[UlyssesGroup] = []  # one per process: the group of the model being trained


def active_group() -> UlyssesGroup | None:
    return _ACTIVE[0] if _ACTIVE else None


def set_active_group(group: UlyssesGroup | None) -> None:
    _ACTIVE.clear()
    if group is not None:
        _ACTIVE.append(group)


def _exchange(x: torch.Tensor, group: UlyssesGroup, seq_to_heads: bool) -> torch.Tensor:
    """[batch, heads, seq/sp, dim] -> [batch, heads/sp, seq, dim] (seq_to_heads) or the reverse."""
    sp = group.sp_size
    b, h, s, d = x.shape
    if seq_to_heads:  # send head chunk j to rank j; receive every rank's tokens of our head chunk, in rank order
        send = x.reshape(b, sp, h // sp, s, d).permute(1, 0, 2, 3, 4).contiguous()
    else:  # send sequence chunk j (rank j's tokens) back to rank j; receive every rank's head chunk
        send = x.reshape(b, h, sp, s // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _AllToAll.apply(send, group.group)
    if seq_to_heads:  # [sp (source rank = sequence chunk), b, h/sp, s, d]
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)
    return received.permute(1, 0, 2, 3, 4).reshape(b, sp * h, s // sp, d)  # [sp (source = head chunk), b, h, s/sp, d]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: which packed sequence each token belongs to. transformers' rule (masking_utils, for position ids
    without an attention mask): a new sequence starts wherever the position does not step by exactly 1."""
    steps = torch.ones_like(position_ids)
    steps[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1]
    return (steps != 1).cumsum(-1)


def _packed_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool: causal within each packed sequence (:func:`document_ids`)."""
    document = document_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def _replicate_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to `heads` (each kv head serves heads/kv consecutive query heads, as repeat_kv)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


class _AllHeadsKV:
    """The attention module as the inner function sees it once key/value heads are replicated to the query heads:
    one query head per key/value head, so the function repeats nothing again."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature: [batch, heads, local seq, dim] in, ([batch, local seq, heads, dim],
    None) out."""
    from transformers import AttentionInterface

    group = active_group()
    if group is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} outside sequence-parallel training: load the model with "
            "attn_implementation='sdpa' for inference, or train with FSDPQLoRATrainingArguments(sp_size=...)."
        )
    heads = query.shape[1]
    if key.shape[1] % group.sp_size:
        key, value = _replicate_kv(key, heads), _replicate_kv(value, heads)
        module = _AllHeadsKV(module)
    query, key, value = (_exchange(t, group, seq_to_heads=True) for t in (query, key, value))
    mask = None if group.global_position_ids is None else _packed_mask(group.global_position_ids.to(query.device))
    inner = AttentionInterface()[group.inner]
    kwargs.pop("position_ids", None)  # local positions: the whole sequence's mask is ours
    out, _ = inner(module, query, key, value, mask, **kwargs)  # [batch, seq, heads/sp, dim]
    out = _exchange(out.transpose(1, 2), group, seq_to_heads=False)  # [batch, heads, seq/sp, dim]
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    # The local mask would cover local tokens only; ulysses_attention builds the whole sequence's.
    return None


def register_ulysses_attention() -> str:
    """Register the function (and its mask function) with transformers; returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME


def new_groups(sp_size: int) -> tuple[object, int, int]:
    """(this rank's sequence-parallel process group, its rank in the group, its data-parallel index).

    Groups are consecutive ranks (a node's GPUs first: the all-to-alls are the traffic that needs the fast links).
    Every rank creates every group, as ``new_group`` requires.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, sp_size):
        group = dist.new_group(list(range(start, start + sp_size)))
        if start <= rank < start + sp_size:
            mine = group
    return mine, rank % sp_size, rank // sp_size
