"""What Ulysses sequence parallelism (``sp_size``) cannot train, from the model's config alone.

One implementation serves the trainers, which refuse before the first step
(:func:`hf_fsdp_qlora.train.sequence_parallel.check_sequence_parallel`), and the doctor, which says the same before
launch (rule ``sequence-parallel-refused``). It sits below both: it reads plain values (a config's, a model class's),
never a live model's state.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

__all__ = [
    "SUPPORTED_ATTENTION",
    "SpProblem",
    "local_attention_kinds",
    "router_aux_kind",
    "router_aux_problem",
    "sequence_parallel_problem",
]

# transformers' load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask): the router aux loss of
# most mixture-of-experts families, which train/sp_outputs.py recomputes from the router logits of the whole sequence.
BALANCING_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")

# The attention implementations the Ulysses all-to-all wraps (on CPU only SDPA runs).
SUPPORTED_ATTENTION = ("sdpa",)


@dataclass(frozen=True)
class SpProblem:
    """Why `sp_size` cannot work: `problem` (after the setting's name) and the `fix` to use instead."""

    problem: str
    fix: str


def local_attention_kinds(text_config) -> tuple[str, ...]:
    """The config's attention layers that are not full causal attention (sliding-window, linear, chunked), sorted."""
    kinds = set(getattr(text_config, "layer_types", None) or ()) - {"full_attention"}
    windowed = getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True)
    if windowed and not getattr(text_config, "layer_types", None):
        kinds.add("sliding_attention")
    return tuple(sorted(kinds))


def sequence_parallel_problem(
    sp_size: int, world_size: int, num_heads: int | None, attn_implementation: str | None, local_attention=(),
    sliding_window=None, wrapped_attention: str | None = None,
) -> SpProblem | None:  # fmt: skip
    """The first reason `sp_size` cannot train this model on `world_size` processes, or None (sp_size 1: None).

    `wrapped_attention` is the name of the Ulysses attention once installed (a second check then passes).
    """
    if sp_size <= 1:
        return None
    if world_size % sp_size:
        sizes = [n for n in range(1, world_size + 1) if not world_size % n]
        return SpProblem(
            f" on {world_size} processes: sp_size must divide the number of processes (groups of sp_size ranks share "
            "each sequence).",
            f"Use an sp_size among {sizes}.",
        )
    if not num_heads or num_heads % sp_size:
        return SpProblem(
            f": the model has num_attention_heads={num_heads}, not divisible by sp_size, so the heads cannot be split "
            "evenly across the ranks of a group.",
            "Use an sp_size that divides the number of attention heads.",
        )
    if attn_implementation not in SUPPORTED_ATTENTION and attn_implementation != wrapped_attention:
        return SpProblem(
            f" with attn_implementation={attn_implementation!r}: sequence parallelism wraps SDPA through "
            "transformers' attention interface, and this implementation is not wrapped (on CPU only SDPA runs).",
            "Load the model with attn_implementation='sdpa'.",
        )
    if local_attention:
        return SpProblem(
            f": the model has {', '.join(local_attention)} layers (sliding_window={sliding_window}); the Ulysses "
            "attention computes full causal attention only, so they would attend too far.",
            "Train this model with sp_size=1.",
        )
    return None


def router_aux_kind(model_class: type) -> str | None:
    """How a causal-LM class computes its router aux loss when asked for its router logits: None (it computes none),
    "balancing" (its module's ``load_balancing_loss_func`` with transformers' usual parameters), "other"."""
    balancing = getattr(sys.modules.get(model_class.__module__), "load_balancing_loss_func", None)
    if balancing is None:
        return None
    names = tuple(inspect.signature(balancing).parameters)[: len(BALANCING_PARAMETERS)]
    return "balancing" if names == BALANCING_PARAMETERS else "other"


def router_aux_problem(name: str, output_router_logits: bool, kind: str | None) -> SpProblem | None:
    """Why a router aux loss cannot be made exact under sp_size (None: not asked, none computed, or recomputed).

    Each rank's chunk of a sequence gives another load-balancing loss (a product of two means over the tokens, not a
    sum), so the loss is recomputed from the router logits of the whole sequence, for the function it knows only."""
    if not output_router_logits or kind in (None, "balancing"):
        return None
    return SpProblem(
        f" with output_router_logits=True: {name} computes its router aux loss with a load_balancing_loss_func of "
        "other parameters, which cannot be recomputed over the whole sequence (each rank's chunk gives another value).",
        "Set output_router_logits=False in the model's config, or use sp_size=1.",
    )
