"""DBRX's experts in transformers' experts layout, so that they get 4-bit storage, expert LoRA, grouped compute and
the merge like every other mixture-of-experts family.

DBRX (``DbrxFFN``) keeps its experts one module deeper than the other families, in 2-D matrices:
``ffn.experts.mlp.w1`` / ``v1`` / ``w2``, each ``[experts * ffn_hidden_size, hidden_size]``, that ``DbrxExperts``
slices per expert (gate ``x @ w1_e.T``, up ``x @ v1_e.T``, out ``(act(gate) * up) @ w2_e``). peft cannot adapt
those (its ``ParamWrapper`` on one hides the other two from ``DbrxExperts``). :func:`fuse_dbrx_experts` replaces each
``DbrxFFN`` by :class:`DbrxFusedFFN`: the same router, the same routing, and :class:`DbrxFusedExperts`, a class
transformers' ``use_experts_implementation`` declares (concatenated gate/up, not transposed): ``gate_up_proj``
``[E, 2I, H]`` (expert e: ``w1_e`` rows, then ``v1_e`` rows) and ``down_proj`` ``[E, H, I]`` (``w2_e`` transposed).
Parameter names stay DBRX's module paths (``transformer.blocks.N.ffn.experts.gate_up_proj``).

Checkpoints keep DBRX's own names and shapes: :func:`file_slices` says where each fused parameter lies in the files
(row blocks of ``w1`` / ``v1``, transposed row blocks of ``w2``), for the merge (which writes the merged experts
back as ``w1`` / ``v1`` / ``w2``, a checkpoint ``DbrxForCausalLM`` loads) and the doctor; :func:`to_stored` maps a
state dict of the fused model to DBRX's names.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn

__all__ = [
    "FUSED_CLASSES",
    "block_factors",
    "file_slices",
    "fuse_dbrx_experts",
    "fused_experts",
    "roundtrip_group",
    "stock_stream_names",
    "to_stored",
]

FUSED_CLASSES = ("DbrxFusedExperts",)
_STORED = ("w1", "v1", "w2")


@functools.cache
def _experts_class() -> type:
    """:class:`DbrxFusedExperts`, declared through transformers' decorator (built once, at first use: the decorator
    lives in transformers, which this module does not import at import time)."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation  # the defaults: concatenated gate/up, [E, out, in], no bias, gated
    class DbrxFusedExperts(nn.Module):
        """DBRX's experts of one layer in transformers' layout (see the module docstring)."""

        def __init__(self, settings, act_fn: nn.Module, dtype=None, device=None):
            super().__init__()
            experts, inner, hidden = settings.moe_num_experts, settings.ffn_hidden_size, settings.hidden_size
            self.num_experts, self.intermediate_dim, self.hidden_size = experts, inner, hidden
            self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden, dtype=dtype, device=device))
            self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner, dtype=dtype, device=device))
            self.act_fn = act_fn

        def forward(self, hidden_states, top_k_index, top_k_weights):
            """The eager loop (``_experts_implementation="eager"``): each routed expert on its tokens."""
            out = torch.zeros_like(hidden_states)
            for expert in top_k_index.unique().tolist():
                if expert >= self.num_experts:
                    continue
                token, slot = torch.where(top_k_index == expert)
                gate_up = nn.functional.linear(hidden_states[token], self.gate_up_proj[expert])
                states = nn.functional.linear(self._apply_gate(gate_up), self.down_proj[expert])
                out.index_add_(0, token, (states * top_k_weights[token, slot, None]).to(out.dtype))
            return out

    DbrxFusedExperts.__module__, DbrxFusedExperts.__qualname__ = __name__, "DbrxFusedExperts"
    globals()["DbrxFusedExperts"] = DbrxFusedExperts  # importable by name (pickling, deepcopy of the class)
    return DbrxFusedExperts


class DbrxFusedFFN(nn.Module):
    """``DbrxFFN`` with :class:`DbrxFusedExperts`: DBRX's router and routing, the experts called as transformers'
    experts are (``[tokens, hidden]`` rows), the output in the input's shape as ``DbrxFFN`` returns it."""

    def __init__(self, ffn: nn.Module, experts: nn.Module):
        super().__init__()
        self.router = ffn.router
        self.experts = experts
        self.moe_normalize_expert_weights = ffn.moe_normalize_expert_weights
        self.top_k = ffn.top_k

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from transformers.models.dbrx.modeling_dbrx import DbrxFFN

        router_logits = self.router(hidden_states)  # jitters hidden_states in place when training, as DbrxFFN
        top_k_weights, top_k_index = DbrxFFN.route_tokens_to_experts(self, router_logits)
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.experts(rows, top_k_index, top_k_weights).reshape(hidden_states.shape)


def fuse_dbrx_experts(model: nn.Module, copy_weights: bool = True) -> list[str]:
    """Replace every ``DbrxFFN`` of `model` by :class:`DbrxFusedFFN`, in place (meta-device models too).

    `copy_weights`: fill the fused weights from ``w1`` / ``v1`` / ``w2`` (False: leave them allocated and unwritten,
    for a caller that writes them itself). Returns the names of the fused experts modules (empty: no DBRX layer).
    """
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "DbrxFFN"]
    names = []
    for name, ffn in found:
        glu = ffn.experts.mlp
        settings = SimpleNamespace(
            moe_num_experts=glu.moe_num_experts,
            ffn_hidden_size=glu.ffn_hidden_size,
            hidden_size=glu.hidden_size,
            _experts_implementation="eager",  # the dispatch of transformers' decorator: our forward above
        )
        experts = _experts_class()(settings, glu.activation_fn, dtype=glu.w1.dtype, device=glu.w1.device)
        if copy_weights and glu.w1.device.type != "meta":
            _copy_stored(experts, glu)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, DbrxFusedFFN(ffn, experts))
        names.append(f"{name}.experts")
    return names


@torch.no_grad()
def _copy_stored(experts: nn.Module, glu: nn.Module) -> None:
    shape = (experts.num_experts, experts.intermediate_dim, experts.hidden_size)
    inner = experts.intermediate_dim
    experts.gate_up_proj[:, :inner].copy_(glu.w1.view(shape))
    experts.gate_up_proj[:, inner:].copy_(glu.v1.view(shape))
    experts.down_proj.copy_(glu.w2.view(shape).transpose(1, 2))
    experts.gate_up_proj.requires_grad_(glu.w1.requires_grad)
    experts.down_proj.requires_grad_(glu.w2.requires_grad)


def fused_experts(model: nn.Module) -> list[str]:
    """The names of `model`'s fused DBRX experts modules (16-bit, or our 4-bit ones built from them), as in the base
    model (without peft's prefixes)."""
    return [
        name.removeprefix("base_model.model.").replace(".base_layer", "")
        for name, module in model.named_modules()
        if type(module).__name__ in FUSED_CLASSES or getattr(module, "family", None) in FUSED_CLASSES
    ]


def to_stored(state: dict[str, torch.Tensor], experts) -> dict[str, torch.Tensor]:
    """A state dict of a fused model (or any ``{name: tensor}``) under DBRX's own names and shapes: each
    ``<experts>.gate_up_proj`` / ``down_proj`` (`experts`: :func:`fused_experts`) becomes ``<experts>.mlp.w1`` /
    ``v1`` / ``w2``."""
    experts, out = set(experts), {}
    for key, value in state.items():
        prefix, _, param = key.rpartition(".")
        if prefix not in experts or param not in ("gate_up_proj", "down_proj"):
            out[key] = value
        elif param == "gate_up_proj":
            inner = value.shape[1] // 2
            out[f"{prefix}.mlp.w1"] = value[:, :inner].reshape(-1, value.shape[-1])
            out[f"{prefix}.mlp.v1"] = value[:, inner:].reshape(-1, value.shape[-1])
        else:
            out[f"{prefix}.mlp.w2"] = value.transpose(1, 2).reshape(-1, value.shape[1])
    return out


def file_slices(model: nn.Module, params: list[str], entries: dict, slice_class) -> dict[str, list] | None:
    """Where DBRX's files hold the fused parameters `params` of `model` (None: none of them is DBRX's).

    Per expert e of ``gate_up_proj``: rows ``e*I .. (e+1)*I`` of ``mlp.w1`` (its first I rows) and of ``mlp.v1``
    (the next I); of ``down_proj``: those rows of ``mlp.w2``, transposed. `slice_class` builds each piece
    (``expert_files.ExpertSlice``).
    """
    modules = dict(model.named_modules())
    out = {}
    for key in params:
        prefix, _, param = key.rpartition(".")
        experts = modules.get(prefix)
        if type(experts).__name__ not in FUSED_CLASSES:
            continue
        count, inner = experts.num_experts, experts.intermediate_dim
        sources = (("w1", 0), ("v1", inner)) if param == "gate_up_proj" else (("w2", None),)
        pieces = []
        for stored, start in sources:
            disk_key = f"{prefix}.mlp.{stored}"
            if disk_key not in entries:
                return None  # not DBRX's files: the caller says what is missing
            for e in range(count):
                rows = (e * inner, (e + 1) * inner)
                if start is None:
                    pieces.append(slice_class(disk_key, e, rows=rows, transposed=True))
                else:
                    pieces.append(slice_class(disk_key, e, dim=0, start=start, stop=start + inner, rows=rows))
        out[key] = pieces
    return out or None


def stock_stream_names(modules: dict) -> tuple[list[str], tuple] | None:
    """For streamed loading (experts/stream.py), when `modules` (name -> experts module of a fused meta
    model) are DBRX's: the stock parameter names ``from_pretrained`` leaves unread (``<experts>.mlp.w1`` / ``v1`` /
    ``w2``) and the stock classes whose initialisation it must skip; None for any other family."""
    names = [n for n, m in modules.items() if type(m).__name__ in FUSED_CLASSES]
    if not names:
        return None
    from transformers.models.dbrx.modeling_dbrx import DbrxExpertGLU, DbrxExperts

    return sorted(f"{n}.mlp.{w}" for n in names for w in _STORED), (DbrxExperts, DbrxExpertGLU)


def block_factors(pieces: list, left: torch.Tensor, right: torch.Tensor) -> list[tuple[str, tuple]]:
    """[(file tensor, (a, b))]: the LoRA update of a fused parameter (``left[e] @ right[e]`` for expert e, ``[E, out,
    r] @ [E, r, in]``) as batched low-rank factors of each 2-D DBRX file tensor it lies in: ``b`` ``[E, rows, r]``,
    ``a`` ``[E, r, cols]``, expert e's ``b[e] @ a[e]`` the update of its block of rows (``bmm(b, a)`` reshaped to
    ``[E * rows, cols]`` is the tensor's update, :mod:`hf_fsdp_qlora.merge._lora_math`). Each expert's rows come from
    its own factors only: 1/E of the arithmetic of one block-diagonal product over the whole tensor."""
    by_key: dict[str, list] = {}
    for piece in pieces:
        if piece.transposed:  # w2_e holds down_e transposed: (B_e A_e)^T = A_e^T B_e^T
            lhs, rhs = right[piece.expert].transpose(0, 1), left[piece.expert].transpose(0, 1)
        else:
            lhs, rhs = left[piece.expert][piece.start : piece.stop], right[piece.expert]
        by_key.setdefault(piece.disk_key, []).append((piece.rows, lhs, rhs))
    found = []
    for disk_key, blocks in by_key.items():
        blocks.sort(key=lambda block: block[0][0])  # expert e's rows are block e of the file tensor
        b = torch.stack([lhs for _, lhs, _ in blocks])
        a = torch.stack([rhs for _, _, rhs in blocks])
        found.append((disk_key, (a, b)))
    return found


def roundtrip_group(pieces: list, entries: dict):
    """{file tensor: round trip}: the 4-bit round trip training saw of each DBRX file tensor holding `pieces`, as
    a callable ``(weight, quant, read) -> weight``: expert e's ``gate_up_proj`` was quantized as one matrix
    (``w1_e`` rows, then ``v1_e`` rows), its ``down_proj`` as ``w2_e`` transposed. `read(entry)` reads a partner
    tensor (``v1`` for ``w1`` and back)."""
    keys = {piece.disk_key for piece in pieces}
    partners = {k: next((p for p in keys if p != k), None) for k in keys}
    out = {}
    for key in keys:
        transposed = any(p.transposed for p in pieces if p.disk_key == key)
        count = sum(p.disk_key == key for p in pieces)
        partner = None if transposed else (entries[partners[key]], key.endswith(".w1"))
        out[key] = functools.partial(_roundtrip, count, partner)
    return out


def _roundtrip(count: int, partner, weight, quant, roundtrip, read):
    experts = weight.view(count, -1, weight.shape[-1])
    if partner is None:  # w2: expert e's down_proj, transposed, was quantized
        return torch.stack([roundtrip(e.T.contiguous(), *quant).T for e in experts]).reshape(weight.shape)
    entry, first = partner
    other = read(entry).to(weight.device, weight.dtype).view(experts.shape)
    whole = torch.cat((experts, other) if first else (other, experts), dim=1)
    back = torch.stack([roundtrip(e.contiguous(), *quant) for e in whole])
    rows = experts.shape[1]
    return (back[:, :rows] if first else back[:, rows:]).reshape(weight.shape)
