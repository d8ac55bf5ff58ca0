"""LoRA on parameters (peft's `target_parameters`, e.g. the fused 3-D experts of mixture-of-experts models).

peft wraps each targeted parameter in a `ParamWrapper`. Two targets on one module nest: the parameter the module
registers first is wrapped first and sits innermost, and the saved keys name the module, not the parameter
(`mlp.experts.lora_A.weight` is the module's last targeted parameter, `mlp.experts.base_layer.lora_A.weight` the one
before it). For a 3-D parameter of E experts, `lora_A` is `[r*E, in]` (expert-major rows) and `lora_B` is
`[out, r*E]` (rank-major columns), so expert e's update is `scaling * B[:, e::E] @ A[e*r:(e+1)*r]`, transposed for
families that store `[E, in, out]` (gpt-oss: `is_transposed`). That is peft's `ParamWrapper.get_delta_weight`.

The base may store such a parameter fused, as the model holds it, or per expert (`experts.0.gate_proj.weight`, ...:
transformers' `save_pretrained` writes Qwen3-MoE and Mixtral that way, and so are their Hub checkpoints).
transformers' own conversion mapping says which file tensor is which slice of which expert; each is merged on its
own, so the output keeps the base's layout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.experts.files import ExpertSlice as _Slice
from hf_fsdp_qlora.experts.files import expert_file_slices as _per_expert_files
from hf_fsdp_qlora.merge._lora_math import _pattern_value

__all__ = ["ParamTargets", "quantized_files", "read_param_targets"]

_WRAPPER_KEY = re.compile(r"^(?P<module>.+?)(?P<nest>(\.base_layer)*)$")


@dataclass
class ParamTargets:
    """What the merge needs to know about the base's parameters that `target_parameters` may name."""

    target_names: list[str]
    module_params: dict[str, list[str]]  # module -> its own parameter names, in registration order
    shapes: dict[str, tuple[int, ...]]  # parameter -> shape, as the model holds it
    transposed: set[str]  # modules whose 3-D parameters are stored [experts, in, out]
    on_disk: dict[str, list[_Slice]] = field(default_factory=dict)  # parameter -> where its values lie in the files

    def targeted(self, module: str) -> list[str]:
        """The parameters of `module` peft wraps, innermost first (its own matching rule: a name equal to a
        target or ending with `.` + a target)."""
        return [
            p
            for p in self.module_params.get(module, [])
            if any(f"{module}.{p}" == t or f"{module}.{p}".endswith(f".{t}") for t in self.target_names)
        ]

    def names_wrapper(self, module: str) -> bool:
        """Whether a LoRA module key belongs to a ParamWrapper: its unwrapped module is named by a target."""
        base = _WRAPPER_KEY.match(module)["module"]
        return bool(self.targeted(base)) or any(
            f".{base}.".endswith(f".{t.rpartition('.')[0]}.") for t in self.target_names if "." in t
        )

    def updates(self, module: str, a: torch.Tensor, b: torch.Tensor, config: dict, sources: list[str]):
        """[(base file tensor, (a, b, scaling))]: the wrapper at `module` as plain low-rank factors per file tensor,
        so that `scaling * b @ a` is that tensor's update (batched over experts for a fused 3-D tensor)."""
        match = _WRAPPER_KEY.match(module)
        owner, depth = match["module"], match["nest"].count(".base_layer")
        params = self.targeted(owner)
        if depth >= len(params):
            have = ", ".join(f"{owner}.{p}" for p in self.module_params.get(owner, [])) or "no such module"
            raise MergeError(
                f"adapter tensor {sources[0]} belongs to a LoRA on a parameter of {owner}, but adapter_config.json's "
                f"target_parameters={self.target_names} name {len(params)} parameter(s) of that module in the base "
                f"({have}): the adapter was trained on a different model. Pass the model it was trained on as `base`."
            )
        key = f"{owner}.{params[len(params) - 1 - depth]}"
        # peft matches rank_pattern / alpha_pattern against the parameter's name for these wrappers
        rank = _pattern_value(config.get("rank_pattern"), key, config.get("r", 8))
        alpha = _pattern_value(config.get("alpha_pattern"), key, config.get("lora_alpha", 8))
        rslora = bool(config.get("use_rslora"))
        shape = self.shapes[key]
        experts, out_f, in_f = (1, *shape) if len(shape) == 2 else shape
        if owner in self.transposed and len(shape) == 3:
            in_f, out_f = out_f, in_f
        fits = tuple(a.shape) == (rank * experts, in_f) and tuple(b.shape) == (out_f, rank * experts)
        if not fits:
            raise MergeError(
                f"adapter tensors {sources[0]} {tuple(a.shape)} and {sources[1]} {tuple(b.shape)} do not fit {key} of "
                f"the base, shape {shape} (LoRA of rank {rank} on it has lora_A {(rank * experts, in_f)} and lora_B "
                f"{(out_f, rank * experts)}): the adapter was trained on a different model, or adapter_config.json's r "
                "/ rank_pattern does not belong to these weights. Pass the model it was trained on as `base`."
            )
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        a3 = a.reshape(experts, rank, in_f)  # [E, r, in]
        b3 = b.reshape(out_f, rank, experts).permute(2, 0, 1)  # [E, out, r]
        if owner in self.transposed and len(shape) == 3:  # the stored matrix is (B_e @ A_e).T
            left, right = a3.transpose(-2, -1), b3.transpose(-2, -1)
        else:
            left, right = b3, a3
        if len(shape) == 2:
            left, right = left[0], right[0]
        pieces = self.on_disk.get(key, [_Slice(key)])
        if any(piece.rows is not None for piece in pieces):  # DBRX's 2-D stacks: one (a, b) per file tensor
            from hf_fsdp_qlora.experts.dbrx import block_factors

            return [(disk_key, (a, b, scaling)) for disk_key, (a, b) in block_factors(pieces, left, right)]
        found = []
        for piece in pieces:
            lhs, rhs = left, right
            if piece.expert is not None:
                lhs, rhs = lhs[piece.expert], rhs[piece.expert]
            if piece.dim == 0:
                lhs = lhs[piece.start : piece.stop]
            elif piece.dim == 1:
                rhs = rhs[:, piece.start : piece.stop]
            if piece.reorder is not None:  # stored permuted (interleaved gate/up rows): the factors follow
                lhs, rhs = piece.reorder.factors_to_disk(lhs, rhs)
            found.append((piece.disk_key, (rhs, lhs, scaling)))
        return found


def read_param_targets(base: Path, config: dict, entries) -> ParamTargets:
    """The base's parameters that `target_parameters` may name, and where their values lie in its files.

    Built on the meta device from config.json (nothing is allocated).

    Raises:
        MergeError: no parameter of the base matches `target_parameters`, or a targeted parameter is stored in a
            layout the merge cannot map.
    """
    from hf_fsdp_qlora.merge._base_model import meta_model

    names = list(config.get("target_parameters") or [])
    model = meta_model(base)
    module_params, shapes, transposed = {}, {}, set()
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if own:
            module_params[name] = list(own)
            for p, value in own.items():
                shapes[f"{name}.{p}" if name else p] = tuple(value.shape)
        if getattr(module, "is_transposed", False):
            transposed.add(name)
    targets = ParamTargets(names, module_params, shapes, transposed)
    wanted = [f"{m}.{p}" for m in module_params for p in targets.targeted(m)]
    if not wanted:
        raise MergeError(
            f"adapter_config.json's target_parameters={names} match no parameter of the base {base} (a "
            f"{type(model).__name__}): the adapter was trained on a different model. Pass the model it was trained "
            "on as `base`."
        )
    missing = [k for k in wanted if k not in entries]
    if missing:
        targets.on_disk = _per_expert_files(model, missing, entries)
    return targets


def quantized_files(base: Path, params: set[str], entries) -> tuple[set[str], dict[str, tuple[list, int, int, int]]]:
    """Where the base's files hold the quantized weights `params` (model names), fused or per expert.

    Returns:
        (the disk tensors, {disk tensor: (the entries of its expert's whole matrix in concatenation order, the
        dimension, its start, its stop)} for slices of an expert, e.g. gate and up stored apart, or its
        :class:`~hf_fsdp_qlora.experts.orders.Reorder` for a parameter stored whole in another order). An expert is
        quantized as one matrix, so a slice's 4-bit round trip is that slice of the whole matrix's round trip.
    """
    from hf_fsdp_qlora.merge._base_model import meta_model

    keys, groups = {k for k in params if k in entries}, {}
    missing = sorted(k for k in params if k not in entries)
    if not missing:
        return keys, groups
    for pieces in _per_expert_files(meta_model(base), missing, entries).values():
        if any(piece.rows is not None for piece in pieces):  # DBRX's 2-D stacks: a round trip of their own
            from hf_fsdp_qlora.experts.dbrx import roundtrip_group

            keys |= {piece.disk_key for piece in pieces}
            groups.update(roundtrip_group(pieces, entries))
            continue
        for piece in pieces:
            keys.add(piece.disk_key)
            if piece.reorder is not None:  # round-tripped in the model's order, as training quantized it
                groups[piece.disk_key] = piece.reorder
            if piece.dim is not None:
                parts = sorted((p for p in pieces if p.expert == piece.expert), key=lambda p: p.start)
                groups[piece.disk_key] = ([entries[p.disk_key] for p in parts], piece.dim, piece.start, piece.stop)
    return keys, groups
