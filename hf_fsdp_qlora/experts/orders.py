"""Fused weights a checkpoint stores in another order than the model holds them.

Some families' original checkpoints keep a fused expert tensor whole but permuted: Inkling 2 stores each expert's
gate and up rows alternating (``mlp.experts.w13_weight``: gate row 0, up row 0, gate row 1, ...), and transformers
de-interleaves them into ``gate_up_proj`` (all gate rows, then all up rows) when it loads the model, with its
``Interleave`` conversion operation (``save_pretrained`` interleaves them back); others transpose a fused tensor on
load (``Transpose``). The merge, its 4-bit round trip and the streamed loading read such a tensor through a
:class:`Reorder`: transformers' own operations, applied to the tensor (to the model's order and back), or to the
low-rank factors of an update whose product is the tensor (a permutation of rows or columns of a product is that
permutation of the left or the right factor), so the merge writes the base's own stored order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Reorder", "reorder_of", "whole_tensor_reorder"]


@dataclass(frozen=True)
class Reorder:
    """transformers' conversion operations (``Interleave``, ``Transpose``) that take one stored tensor, whole, to
    the model's parameter: `ops` in the order ``from_pretrained`` applies them."""

    ops: tuple

    def to_model(self, tensor: torch.Tensor) -> torch.Tensor:
        """The stored tensor in the model's order (what ``from_pretrained`` loads)."""
        for op in self.ops:
            tensor = _apply(op, tensor)
        return tensor

    def to_disk(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor in the model's order, in the stored order (what ``save_pretrained`` writes)."""
        for op in reversed(self.ops):
            tensor = _apply(op.reverse_op, tensor)
        return tensor

    def factors_to_disk(self, left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(left, right) such that ``left @ right`` is the stored order of the model-order product of the given
        factors (batched over experts when 3-D): each operation moves onto the factor that holds its dimension."""
        for op in reversed(self.ops):
            left, right = _factors_op(op.reverse_op, left, right)
        return left, right

    def roundtrip(self, weight: torch.Tensor, per_matrix: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`per_matrix` (a quantization round trip) on each expert's matrix as the model holds it (load_qlora_model
        quantizes the loaded, converted tensor), returned in the stored order."""
        model = self.to_model(weight)
        if model.dim() == 3:
            done = torch.stack([per_matrix(expert.contiguous()) for expert in model])
        else:
            done = per_matrix(model.contiguous())
        return self.to_disk(done).contiguous()


def reorder_of(ops, disk_shape: tuple, model_shape: tuple) -> Reorder | None:
    """The :class:`Reorder` of a converter's operations taking a stored tensor of `disk_shape` to a parameter of
    `model_shape` (2-D, or 3-D with the experts first), or None where an operation is not one that only permutes
    the rows or the columns of each expert's matrix (or transposes it)."""
    from transformers.core_model_loading import Interleave, Transpose

    kept, shape = [], list(disk_shape)
    for op in ops:
        if isinstance(op, Interleave) and 0 <= op.dim < len(shape) and shape[op.dim] % 2 == 0:
            if len(shape) == 3 and op.dim == 0:
                return None  # across experts: no factor holds that dimension alone
            kept.append(op)
        elif isinstance(op, Transpose) and sorted((op.dim0 % len(shape), op.dim1 % len(shape))) == [
            len(shape) - 2,
            len(shape) - 1,
        ]:
            if op.check_dims and tuple(shape) == tuple(model_shape):
                continue  # transformers transposes only a tensor not already of the parameter's shape
            kept.append(Transpose(op.dim0, op.dim1))
            shape[-2], shape[-1] = shape[-1], shape[-2]
        else:
            return None
    if tuple(shape) != tuple(model_shape):
        return None
    return Reorder(tuple(kept))


def _apply(op, tensor: torch.Tensor) -> torch.Tensor:
    """transformers' operation `op` on one tensor (its ``convert`` takes and returns a dict of tensors)."""
    out = op.convert({"tensor": tensor}, source_patterns=["tensor"], target_patterns=["tensor"])
    return next(iter(out.values()))


def _factors_op(op, left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`op` on the product ``left @ right``, done on the factors: an operation on the product's rows acts on the
    left factor's rows, one on its columns on the right factor's columns, a transpose swaps and transposes both."""
    from transformers.core_model_loading import Transpose

    rows, cols = left.dim() - 2, right.dim() - 1
    if isinstance(op, Transpose):
        return right.transpose(-2, -1), left.transpose(-2, -1)
    if op.dim == rows:
        return _apply(op, left), right
    if op.dim == cols:
        return left, _apply(op, right)
    raise ValueError(f"{type(op).__name__} on dimension {op.dim} of a product of {left.dim()}-D factors")


def whole_tensor_reorder(model, model_key: str, converter, disk_shape: tuple) -> Reorder | None:
    """The :class:`Reorder` by which transformers' `converter` takes one stored tensor of `disk_shape` to the
    parameter `model_key` of `model` (a meta model), or None where it stacks, splits or otherwise converts it."""
    if len(converter.source_patterns) != 1 or len(converter.target_patterns) != 1 or not converter.operations:
        return None
    try:
        shape = tuple(model.get_parameter(model_key).shape)
    except AttributeError:
        return None
    return reorder_of(converter.operations, disk_shape, shape)
