"""Streamed expert loading: the experts go from the safetensors shards into 4 bits one layer at a time.

A plain ``from_pretrained`` materialises every fused expert weight in 16 bits before :func:`quantize_experts` packs
them (Qwen3-30B-A3B: 54 GiB per process), and with ``low_cpu_ram=True`` the other ranks received those 16-bit
weights too. Here the checkpoint's expert tensors are hidden from ``from_pretrained`` (a ``key_mapping`` renames them
to keys no module has, so transformers never reads them), the experts' parameters are left as allocated and never
written (transformers would otherwise draw random values for the "missing" weights: 16 bits resident again), and
:meth:`StreamedExperts.quantize` then reads each experts module's tensors with safetensors' lazy ``safe_open``
slices (``pread``: no memory map keeps the pages), assembles that one layer in 16 bits exactly as transformers'
conversion mapping would (stacked per expert, gate and up concatenated or de-interleaved), packs it with
:class:`~hf_fsdp_qlora.experts.quantized.QuantizedExperts` and drops the 16-bit copy before the next layer.

Host RAM per process while loading: the 4-bit model, one layer's 16-bit experts and the process's own runtime
(``doctor``'s ``host_per_process["loading"]``). With ``low_cpu_ram`` rank 0 streams and quantizes, and the other
ranks receive the packed bytes and quantization constants (:meth:`StreamedExperts.stand_in` builds the module they
land in).

A checkpoint that cannot be streamed (not a local safetensors folder, experts converted by operations other than
stacking, concatenation, interleaving and transposing, a ``from_pretrained`` argument that changes which files or
keys are read) loads as before, with a log line saying why.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..dtypes import PACKED_EXPERTS_ATTR
from .layouts import expert_layout
from .quantized import QuantizedExperts

__all__ = ["ExpertStream", "StreamedExperts", "expert_stream_or_say_why", "experts_left_unread", "plan_expert_stream"]

logger = logging.getLogger(__name__)

HIDDEN_PREFIX = "hf_fsdp_qlora_streamed."  # expert checkpoint keys renamed to this: no module has them
# from_pretrained arguments that change which files or keys are read: the plan could not follow them.
_NOT_STREAMED_WITH = (
    "key_mapping",
    "state_dict",
    "gguf_file",
    "subfolder",
    "variant",
    "use_safetensors",
    "device_map",
)


@dataclass
class ExpertStream:
    """Where each experts module's weights lie in a local safetensors checkpoint.

    Attributes:
        modules: experts module name -> {parameter name: [slices]} (:class:`~hf_fsdp_qlora.experts.files.ExpertSlice`:
            the file tensor, the expert it holds (None: the whole parameter), and its place in that expert's matrix).
        entries: file tensor name -> where it lies (:class:`~hf_fsdp_qlora.safetensors_io.TensorEntry`).
        key_pattern: a regex matching exactly the file tensors of the experts (hidden from ``from_pretrained``).
        classes: the experts classes (their initialisation is skipped while ``from_pretrained`` runs).
        model_class: the class ``from_pretrained`` builds.
        layer_bytes: the largest layer's 16-bit expert weights, as assembled before packing.
    """

    modules: dict[str, dict[str, list]]
    entries: dict
    key_pattern: str
    classes: tuple
    model_class: type
    layer_bytes: int = 0
    expert_params: list[str] = field(default_factory=list)


def plan_expert_stream(
    source, config, dtype, trust_remote_code: bool, kwargs: dict
) -> tuple[ExpertStream | None, str]:
    """The stream plan of checkpoint `source` (None and why not, when its experts cannot be streamed)."""
    from ..errors import MergeError, MergeUsageError
    from ..safetensors_io import checkpoint_shards, read_header
    from .placement import _meta_model

    blocked = sorted(set(kwargs) & set(_NOT_STREAMED_WITH))
    if blocked:
        return None, f"from_pretrained arguments {blocked} change which weights are read"
    folder = Path(str(source)).expanduser()
    if not folder.is_dir():
        return None, f"{source} is not a local folder"
    try:
        found = checkpoint_shards(folder)
        entries = {k: e for name in (found[0] if found else ()) for k, e in read_header(folder / name)[0].items()}
    except (MergeError, MergeUsageError) as err:
        return None, str(err)
    if not entries:
        return None, "no safetensors checkpoint"
    meta = _meta_model(config, dtype, trust_remote_code)
    modules = {n: m for n, m in meta.named_modules() if expert_layout(m) is not None}
    if not modules:
        return None, "no fused experts"
    wanted = {f"{n}.{p}": tuple(getattr(m, p).shape) for n, m in modules.items() for p in _params(m)}
    slices, reason = _slices(meta, wanted, entries)
    if slices is None:
        return None, reason
    hidden = {s.disk_key for pieces in slices.values() for s in pieces}
    stream = ExpertStream(
        modules={n: {p: slices[f"{n}.{p}"] for p in _params(m)} for n, m in modules.items()},
        entries={k: entries[k] for k in hidden},
        key_pattern=_key_pattern(hidden, set(entries)),
        classes=tuple({type(m) for m in modules.values()}),
        model_class=type(meta),
        expert_params=sorted(wanted),
    )
    _stock_names(stream, modules)
    stream.layer_bytes = max(
        sum(getattr(m, p).numel() * getattr(m, p).element_size() for p in _params(m)) for m in modules.values()
    )
    return stream, ""


def expert_stream_or_say_why(source, config, dtype, trust_remote_code: bool, kwargs: dict) -> ExpertStream | None:
    """:func:`plan_expert_stream`, with one log line saying why the experts load 16-bit first where it cannot follow
    (silent for a model without fused experts)."""
    stream, reason = plan_expert_stream(source, config, dtype, trust_remote_code, kwargs)
    if stream is None and reason != "no fused experts":
        logger.info("hf_fsdp_qlora: the experts load in 16 bits before they are packed: %s", reason)
    return stream


def _stock_names(stream: ExpertStream, modules: dict) -> None:
    """DBRX: ``from_pretrained`` builds the stock ``DbrxExperts`` (fused after it, hf_fsdp_qlora/experts/dbrx.py):
    its weights ``mlp.w1`` / ``v1`` / ``w2`` are the ones left unread and unwritten."""
    from .dbrx import stock_stream_names

    stock = stock_stream_names(modules)
    if stock is not None:
        stream.expert_params, extra = stock
        stream.classes = (*stream.classes, *extra)


def _params(module) -> tuple[str, ...]:
    layout = expert_layout(module)
    return layout.weights + layout.biases


def _slices(meta, wanted: dict, entries: dict) -> tuple[dict | None, str]:
    """{expert parameter: [slices]}, read with transformers' conversion mapping (as the merge reads it)."""
    from ..errors import MergeError
    from .files import ExpertSlice, expert_file_slices

    slices = {k: [ExpertSlice(k)] for k in wanted if k in entries}
    converted = [k for k in wanted if k not in entries]
    if converted:
        try:
            slices.update(expert_file_slices(meta, converted, entries))
        except MergeError as err:
            return None, str(err)
    for key, shape in wanted.items():
        numel = sum(_numel(_piece_shape(entries[s.disk_key].shape, s)) for s in slices[key])
        if numel != _numel(shape):
            return None, f"the checkpoint's tensors for {key} hold {numel} values, the model's {_numel(shape)}"
    return slices, ""


def _piece_shape(shape, piece) -> tuple:
    """The shape of the part of a file tensor `piece` reads (DBRX: a block of rows)."""
    return tuple(shape) if piece.rows is None else (piece.rows[1] - piece.rows[0], *shape[1:])


def _numel(shape) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def _key_pattern(hidden: set[str], every: set[str]) -> str:
    """A regex matching exactly the `hidden` keys among `every` key: their names with each number generalised
    (a few patterns for any number of layers and experts), or the names themselves where that matches more."""
    general = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(k)) for k in hidden})
    pattern = "|".join(general)
    compiled = re.compile(f"^(?:{pattern})$")
    if {k for k in every if compiled.match(k)} == hidden:
        return pattern
    return "|".join(re.escape(k) for k in sorted(hidden))


@contextmanager
def experts_left_unread(stream: ExpertStream | None):
    """Within: ``from_pretrained`` reads no expert tensor of `stream`'s checkpoint and writes no expert weight.

    Yields the ``from_pretrained`` kwargs that hide the experts' file tensors (``{}`` without a stream). The expert
    weights come out of ``from_pretrained`` allocated and untouched (no page of them resident) until
    :meth:`StreamedExperts.quantize` replaces them; transformers' load report does not list them.
    """
    if stream is None:
        yield {}
        return
    from torch.utils import deterministic

    saved = [(c, "_is_hf_initialized", c.__dict__.get("_is_hf_initialized")) for c in stream.classes]
    ignore_missing = [re.escape(k) for k in stream.expert_params]
    ignore_unexpected = [re.escape(HIDDEN_PREFIX)]
    cls = stream.model_class
    for attr in ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected"):
        saved.append((cls, attr, cls.__dict__.get(attr)))
    fill = deterministic.fill_uninitialized_memory
    try:
        for experts_cls in stream.classes:
            experts_cls._is_hf_initialized = True  # transformers' init skips the module: its weights stay unwritten
        cls._keys_to_ignore_on_load_missing = [*(getattr(cls, "_keys_to_ignore_on_load_missing", None) or ()),
                                               *ignore_missing]  # fmt: skip
        cls._keys_to_ignore_on_load_unexpected = [*(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()),
                                                  *ignore_unexpected]  # fmt: skip
        deterministic.fill_uninitialized_memory = False  # deterministic mode would write every new page
        yield {"key_mapping": {f"^({stream.key_pattern})$": HIDDEN_PREFIX + r"\1"}}
    finally:
        deterministic.fill_uninitialized_memory = fill
        for owner, attr, value in saved:
            if value is None:
                if attr in owner.__dict__:
                    delattr(owner, attr)
            else:
                setattr(owner, attr, value)


@dataclass
class StreamedExperts:
    """The experts of one load: read from `stream`'s checkpoint and packed, or stood in for on receiving ranks."""

    stream: ExpertStream
    quant_type: str
    double_quant: bool
    dtype: torch.dtype
    device: object = None  # where the packed experts go (a GPU), default: the CPU

    @torch.no_grad()
    def quantize(self, model: nn.Module) -> list[str]:
        """Replace each experts module of `model` still 16-bit by a :class:`QuantizedExperts` read from the files,
        one layer at a time: that layer's 16-bit weights exist only while it is packed."""
        from safetensors import safe_open

        from .dbrx import fuse_dbrx_experts

        fuse_dbrx_experts(model, copy_weights=False)  # DBRX: the fused modules, filled below from the files
        names = [n for n, m in model.named_modules() if expert_layout(m) is not None]
        handles = {}
        try:
            for name in names:
                pieces = self.stream.modules.get(name)
                if pieces is None:
                    raise RuntimeError(f"hf_fsdp_qlora: the experts module {name} is not in the checkpoint's plan")
                module = model.get_submodule(name)
                for param, slices in pieces.items():
                    weight = self._assemble(getattr(module, param), slices, handles, safe_open)
                    module._parameters[param] = nn.Parameter(weight, requires_grad=False)
                self._swap(model, name, module)
                del module
        finally:
            handles.clear()  # safe_open handles close when released
        if names:
            logger.info("hf_fsdp_qlora: streamed the experts of %d MoE layers from the checkpoint into 4 bits (%s)",
                        len(names), self.quant_type)  # fmt: skip
        return names

    def _assemble(self, like: torch.Tensor, slices: list, handles: dict, safe_open) -> torch.Tensor:
        """One parameter in 16 bits from its file tensors, cast as ``from_pretrained`` casts (to the model's dtype)."""
        out = torch.empty(like.shape, dtype=like.dtype)
        for piece in slices:
            entry = self.stream.entries[piece.disk_key]
            if entry.path not in handles:
                handles[entry.path] = safe_open(str(entry.path), framework="pt", backend="pread")
            found = handles[entry.path].get_slice(piece.disk_key)
            value = (found[...] if piece.rows is None else found[piece.rows[0] : piece.rows[1]]).to(like.dtype)
            value = value.T if piece.transposed else value  # DBRX's w2 holds down_proj transposed
            if piece.reorder is not None:  # stored in another order (Inkling 2's interleaved gate/up rows)
                value = piece.reorder.to_model(value)
            target = out if piece.expert is None else out[piece.expert]
            if piece.dim is not None:
                target = target.narrow(piece.dim, piece.start, piece.stop - piece.start)
            target.copy_(value)
        return out

    def _swap(self, model: nn.Module, name: str, module: nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layout = expert_layout(module)
        quantized = QuantizedExperts(module, layout, quant_type=self.quant_type, double_quant=self.double_quant,
                                     dtype=self.dtype, device=self.device)  # fmt: skip
        setattr(parent, child, quantized)

    @torch.no_grad()
    def stand_in(self, skeleton: nn.Module) -> None:
        """On a rank that receives rank 0's experts: each experts module of the meta `skeleton` becomes a
        :class:`QuantizedExperts` of the same shapes (quantized from zeros, one expert at a time: no checkpoint read),
        whose every tensor the transfer then overwrites with rank 0's bytes."""
        from .dbrx import fuse_dbrx_experts

        fuse_dbrx_experts(skeleton, copy_weights=False)  # DBRX: as rank 0 fuses its experts before packing them
        for name in [n for n, m in skeleton.named_modules() if expert_layout(m) is not None]:
            module = skeleton.get_submodule(name)
            for param in _params(module):
                like = getattr(module, param)
                zero = torch.zeros((), dtype=like.dtype).expand(like.shape)
                module._parameters[param] = nn.Parameter(zero, requires_grad=False)
            self._swap(skeleton, name, module)

    @staticmethod
    def mark_received(model: nn.Module) -> None:
        """The transfer rebuilds each parameter: mark the packed experts again (harmonize_dtypes never casts them)."""
        for module in model.modules():
            if isinstance(module, QuantizedExperts):
                for name in module.layout.weights:
                    setattr(getattr(module, f"{name}_4bit"), PACKED_EXPERTS_ATTR, True)
