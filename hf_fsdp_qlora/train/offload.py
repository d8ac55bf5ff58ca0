"""Activation offloading: the tensors a model's forward saves for backward wait in host RAM instead of GPU memory.

``FSDPQLoRATrainingArguments(activation_offloading=True)`` installs :class:`ActivationOffloading` on the model
before it is wrapped. For long sequences on small GPUs the saved activations dominate the per-GPU plan
(``hf-fsdp-qlora doctor`` shows the term); with FSDP's activation checkpointing only each decoder layer's input
is saved, and this moves those inputs (and the final norm / LM-head inputs) to host RAM as well. Cost: one
device-to-host copy per saved tensor in forward and one host-to-device copy in backward, over PCIe, not overlapped
with compute (torchtune overlaps them on a side stream; a later step could).

What is not moved, and why:

* tensors already in host memory (every tensor of a CPU run): the hook hands them back unchanged, so on CPU the
  option is an exact no-op that still counts what it saw (:attr:`ActivationOffloading.packed`);
* parameters (frozen 4-bit weights, LoRA weights, FSDP's gathered copies): they stay alive on the GPU anyway, so a
  host copy would only add traffic;
* tensors below ``min_bytes``: the copy's latency costs more than the memory saved.

The hooks wrap the whole forward of the outermost model, as torchtune does, not each decoder layer: saved-tensor
hooks nest, and hooks entered inside a checkpointed layer would replace the checkpoint's own and save every
intermediate. Entered outside, the checkpoint keeps its region (recomputed in backward, nothing saved) and only
the tensors saved outside it reach this hook.
"""

from __future__ import annotations

import torch

_INSTALLED_ATTR = "_hf_fsdp_qlora_offloading"  # on the model: its ActivationOffloading hooks

__all__ = ["ActivationOffloading", "install_activation_offloading"]

DEFAULT_MIN_BYTES = 1024


class ActivationOffloading(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep activations in (pinned) host memory between forward and backward.

    Args:
        min_bytes: tensors smaller than this stay where they are.
        pin_memory: use page-locked host buffers (faster copies; needs a CUDA build with a GPU).

    Attributes:
        packed: tensors the hook has seen since the last :meth:`reset` (proof it engaged).
        offloaded: of those, how many were moved to host memory; ``offloaded_bytes`` their size.
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, pin_memory: bool = True):
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.reset()
        super().__init__(self._pack, self._unpack)

    def reset(self) -> None:
        self.packed = self.offloaded = self.offloaded_bytes = 0

    def _stays(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == "cpu"
            or isinstance(tensor, torch.nn.Parameter)
            or tensor.layout != torch.strided
            or tensor.numel() * tensor.element_size() < self.min_bytes
        )

    def _pack(self, tensor: torch.Tensor):
        self.packed += 1
        if self._stays(tensor):
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=self.pin_memory)
        # Blocking into pageable memory; with pinned memory the copy is ordered on the current stream before any
        # reuse of `tensor`'s block by the caching allocator, as in torch.autograd.graph.save_on_cpu.
        host.copy_(tensor, non_blocking=self.pin_memory)
        self.offloaded += 1
        self.offloaded_bytes += host.numel() * host.element_size()
        return (tensor.device, host)

    def _unpack(self, packed):
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=self.pin_memory)
        return packed


def install_activation_offloading(model: torch.nn.Module, **kwargs) -> ActivationOffloading:
    """Enter :class:`ActivationOffloading` around every forward of `model` (the outermost model, before wrapping).

    Uses module hooks, not a replaced ``forward``, so FSDP2 (which keeps the module object) and DDP (which calls the
    inner module) both run it. The exit hook runs even when the forward raises, so a failed step cannot leave the
    hooks installed. Installing twice returns the first instance.

    Returns:
        The hooks object, whose counters show what was packed and moved.
    """
    existing = getattr(model, _INSTALLED_ATTR, None)
    if existing is not None:
        return existing
    hooks = ActivationOffloading(**kwargs)

    def enter(module, args):
        hooks.__enter__()

    def leave(module, args, output):
        hooks.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    setattr(model, _INSTALLED_ATTR, hooks)
    return hooks
