"""What Ulysses sequence parallelism (``sp_size``) cannot train, from the model's config alone.

One implementation serves the trainers, which refuse before the first step
(:func:`hf_fsdp_qlora.train.sequence_parallel.check_sequence_parallel`), and the doctor, which says the same before
launch (rule ``sequence-parallel-refused``). It sits below both: it reads plain values, never a live model.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUPPORTED_ATTENTION", "SpProblem", "local_attention_kinds", "sequence_parallel_problem"]

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
