"""Tiled MLP: each dense MLP runs over tiles of the sequence and is recomputed in backward, one tile at a time.

At long sequences the MLP's intermediate activations dominate what a decoder layer keeps for backward: for
Llama-3.1-8B each of gate, up and their product is ``sequence x 14336`` values, three times the hidden states'
size each. ``FSDPQLoRATrainingArguments(tiled_mlp=True)`` replaces the ``forward`` of every dense MLP instance
(the module a decoder layer holds as ``mlp`` or ``feed_forward``) by one that splits the tokens into tiles of
``tiled_mlp_tokens`` and runs each tile under non-reentrant activation checkpointing. Forward keeps only the
tile inputs (views of the MLP's input, which the layer keeps anyway) and the output; backward recomputes one
tile's intermediates, takes its gradients and frees them before the next tile. So the intermediates of the
whole sequence are never held at once: at most one tile's, in forward and in backward.

Exact: every token's MLP is a function of that token alone, so tiling changes only how the matmuls are blocked
(float32 differences at the last bit, measured in tests/test_tiled_mlp.py). LoRA dropout draws its mask per tile,
so with ``lora_dropout > 0`` the random masks differ from an untiled run's (same distribution).

Cost: a second forward of every MLP in backward (about a third more MLP compute), and 4-bit weights are
dequantized once per tile instead of once per call.

Mixtures of experts keep their own path: an MLP holding ``experts`` (routed experts, shared ones beside them) is
left alone, and so is any module whose class is not a dense MLP (a Mamba or linear-attention mixer).

Composes with the model's or FSDP's activation checkpointing (non-reentrant checkpoints nest: a layer's
recomputation runs the tiles again, each checkpointed) and with FSDP1/FSDP2: the MLP is no FSDP unit of its own,
its parameters are gathered with its decoder layer's, and its hooks run once per call.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_TILE_TOKENS", "install_tiled_mlp", "tiled_mlp_modules"]

logger = logging.getLogger(__name__)

DEFAULT_TILE_TOKENS = 1024
_MLP_NAMES = ("mlp", "feed_forward")  # what decoder layers call their MLP (Llama, Qwen, Mistral...; Llama 4)
_INSTALLED_ATTR = "_hf_fsdp_qlora_tiled_mlp"  # on an MLP: its tile size, once tiled


def _is_dense_mlp(module: torch.nn.Module) -> bool:
    """A feed-forward block computing each token on its own: no routed experts inside, and a projection in it."""
    names = {name.rpartition(".")[2] for name, _ in module.named_modules()}
    if "experts" in names or "router" in names:
        return False
    return bool(names & {"gate_proj", "up_proj", "down_proj", "fc1", "fc2", "w1", "w2", "w3", "c_fc"})


def tiled_mlp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The dense MLPs of `model`'s decoder layers (name, module), MoE blocks left out."""
    found = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in _MLP_NAMES and _is_dense_mlp(module):
            found.append((name, module))
    return found


def _tiled_forward(original, tile_tokens: int, hidden_states: torch.Tensor, *args, **kwargs):
    """`original` over tiles of `tile_tokens` tokens along the sequence dimension (-2), each checkpointed."""
    length = hidden_states.shape[-2] if hidden_states.dim() >= 2 else 0
    if length <= tile_tokens or not torch.is_grad_enabled():
        return original(hidden_states, *args, **kwargs)  # one tile, or nothing kept for backward: plain forward
    outputs = [
        checkpoint(original, tile, *args, use_reentrant=False, **kwargs)
        for tile in hidden_states.split(tile_tokens, dim=-2)
    ]
    return torch.cat(outputs, dim=-2)


def install_tiled_mlp(model: torch.nn.Module, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Tile every dense MLP of `model` (before FSDP wraps it); returns how many. Calling it again changes nothing.

    Raises:
        ValueError: `tile_tokens` is below 1.
    """
    if tile_tokens < 1:
        raise ValueError(
            f"tiled_mlp_tokens={tile_tokens}: a tile must hold at least 1 token; use {DEFAULT_TILE_TOKENS} (the "
            "default)."
        )
    count = 0
    for _, module in tiled_mlp_modules(model):
        if getattr(module, _INSTALLED_ATTR, None) is not None:
            continue
        # An instance attribute: the class (shared with untiled models in the process) is left alone.
        module.forward = functools.partial(_tiled_forward, module.forward, tile_tokens)
        setattr(module, _INSTALLED_ATTR, tile_tokens)
        count += 1
    logger.info("hf_fsdp_qlora: tiled MLP on %d dense MLP(s), %d tokens per tile", count, tile_tokens)
    return count
