"""What a LoRA adapter does to each base tensor, and the fp32 arithmetic that applies it.

The adapter is read as peft saves it (keys without the adapter name, `base_model.model.` in front):

- `<module>.lora_A.weight` / `.lora_B.weight` (Linear), `.lora_embedding_A` / `_B` (Embedding): the
  low-rank update `scaling * B @ A`, with `scaling = alpha / r` or `alpha / sqrt(r)` (rsLoRA) and r, alpha
  per module from `rank_pattern` / `alpha_pattern`; `fan_in_fan_out` stores the weight transposed.
- `<module>.lora_magnitude_vector`: DoRA, which rescales each output row of the updated weight.
- `<module>.lora_B.bias` (`lora_bias=True`): `scaling * bias` added to the module's bias.
- `<module>.token_adapter.trainable_tokens_delta` (`trainable_token_indices`): the trained rows of an
  embedding, written over the rows the config lists (peft's `index_copy`).
- anything else (`modules_to_save` copies, biases trained with `bias="all"/"lora_only"`, embedding
  layers saved whole, also resized for added tokens): a full tensor that replaces the base tensor of the
  same name, with the `.base_layer` / `.modules_to_save` wrapper parts removed from the key.

LoRA on a fused 3-D experts parameter has factors batched over the experts (``[E, out, r]``, ``[E, r, in]``); such
factors may also update a 2-D tensor of E row blocks, expert e's from its own (DBRX's ``mlp.w1``, experts/dbrx.py).

Each update runs in float32 on one explicit device and is cast once, by the caller.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from hf_fsdp_qlora.errors import MergeError

__all__ = [
    "LoraFactors",
    "TensorUpdate",
    "apply_update",
    "apply_update_into",
    "check_shape",
    "collect_updates",
]

PREFIX = "base_model.model."
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_embedding_A|lora_embedding_B"
    r"|lora_magnitude_vector)$"
)
# LoraConfig fields that switch on a variant whose merge is not `W + scaling * B @ A` (or DoRA), or that
# change which tensors exist; merging those as plain LoRA would silently produce a wrong model.
_UNSUPPORTED = (
    "arrow_config",
    "use_bdlora",
    "alora_invocation_tokens",
    "velora_config",
    "monteclora_config",
    "kasa_config",
    "use_qalora",
    "layer_replication",
)


@dataclass
class LoraFactors:
    """The low-rank update of one weight: `scaling * B @ A` (transposed for embeddings / fan_in_fan_out)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    embedding: bool
    fan_in_fan_out: bool
    magnitude: torch.Tensor | None  # DoRA
    module: str


@dataclass
class TensorUpdate:
    """Everything the adapter does to one base tensor, applied in this order."""

    replacement: torch.Tensor | None = None
    lora: LoraFactors | None = None
    lora_bias: tuple[torch.Tensor, float] | None = None
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (row indices, their trained values)
    sources: list[str] = field(default_factory=list)  # adapter keys, for messages


def _pattern_value(patterns: dict | None, module: str, default):
    # peft's rule: a pattern key matches the module name as a whole or as a dotted suffix (regex allowed).
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_tensor(key: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta" or tensor.numel() == 0:
        where = "on the meta device" if tensor.device.type == "meta" else f"empty (shape {tuple(tensor.shape)})"
        raise MergeError(
            f"adapter tensor {key} is {where}: it was saved from a sharded or not-yet-materialized model, and "
            "merging it would be a silent no-op. Save the adapter from the gathered full state dict, or convert "
            "the FSDP sharded checkpoint with `hf-fsdp-qlora convert CHECKPOINT --output ADAPTER_DIR`."
        )


def _check_config(config: dict) -> None:
    for name in _UNSUPPORTED:
        if config.get(name):
            raise MergeError(
                f"adapter_config.json sets {name}={config[name]!r}: merge-adapters merges plain LoRA (with rsLoRA, "
                f"rank/alpha patterns, lora_bias, modules_to_save) and DoRA only. Merge this adapter with peft's "
                f"merge_and_unload, or train with {name} unset."
            )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower() == "mica":
        raise MergeError(
            "adapter_config.json sets init_lora_weights='mica', a LoRA variant merge-adapters does not merge"
        )


def _token_indices(config: dict, module: str, key: str, delta: torch.Tensor) -> torch.Tensor:
    """The rows `trainable_token_indices` names for `module`: a list (the input embedding) or {name: list}."""
    spec = config.get("trainable_token_indices")
    indices = (
        spec if isinstance(spec, list) else _pattern_value(spec if isinstance(spec, dict) else None, module, None)
    )
    if indices is None and isinstance(spec, dict) and len(spec) == 1:
        indices = next(iter(spec.values()))  # the tied output head shares the embedding's adapter
    if not isinstance(indices, list) or len(indices) != delta.shape[0]:
        raise MergeError(
            f"adapter tensor {key} holds {delta.shape[0]} trained token rows, but adapter_config.json's "
            f"trainable_token_indices={spec!r} does not list that many for {module}: use the adapter_config.json "
            "saved with these weights"
        )
    return torch.tensor(indices, dtype=torch.long)


def collect_updates(
    config: dict, tensors: dict[str, torch.Tensor], params=None, transposed=None
) -> dict[str, TensorUpdate]:
    """Group the adapter's tensors by the base tensor they change.

    Args:
        config: `adapter_config.json` as a dict.
        tensors: the adapter tensors, keys in peft's saved format.
        params: the base's parameters `target_parameters` names (:func:`~._experts.read_param_targets`); needed
            when the config sets `target_parameters`.
        transposed: the base's modules that store their weight (in, out), GPT-2's ``Conv1D``: their update is
            transposed whatever the config's ``fan_in_fan_out`` says (peft decides it per module when it loads the
            adapter onto the 16-bit model; on a 4-bit base they trained as ``Linear4bit``, unflagged). None: the
            config's ``fan_in_fan_out`` for every module.

    Returns:
        base tensor name (e.g. `model.layers.0.self_attn.q_proj.weight`) -> its update.

    Raises:
        MergeError: an unsupported variant, an empty/meta tensor, half of a LoRA pair, or an unknown key.
    """
    _check_config(config)
    if config.get("target_parameters") and params is None:
        raise MergeError(
            "adapter_config.json sets target_parameters: the LoRA on parameters needs the base's parameters to be "
            "placed; merge with merge_adapters(base, adapter, output)"
        )
    modules, updates = _group_tensors(config, tensors)
    for module, parts in modules.items():
        _add_module_lora(updates, config, module, parts, params, transposed)
    return updates


def _group_tensors(config: dict, tensors: dict) -> tuple[dict, dict[str, TensorUpdate]]:
    """({module: {LoRA part: (key, tensor)}}, the other updates: trainable token rows, replaced tensors)."""
    modules: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    updates: dict[str, TensorUpdate] = {}
    for key, tensor in tensors.items():
        _check_tensor(key, tensor)
        name = key.removeprefix(PREFIX)
        match = _LORA_KEY.match(name)
        if match:
            modules.setdefault(match["module"], {})[match["part"]] = (key, tensor)
        elif name.endswith(".token_adapter.trainable_tokens_delta"):
            module = name.removesuffix(".token_adapter.trainable_tokens_delta")
            update = updates.setdefault(f"{module}.weight", TensorUpdate())
            update.token_rows = (_token_indices(config, module, key, tensor), tensor)
            update.sources = update.sources + [key]
        elif ".lora_" in name or (".token_adapter." in name and ".token_adapter.base_layer." not in name):
            raise MergeError(f"adapter tensor {key} belongs to a LoRA variant merge-adapters does not merge")
        else:
            # A resized embedding under trainable tokens is saved as `<module>.token_adapter.base_layer.weight`.
            target = name.replace(".token_adapter.base_layer.", ".")
            target = target.replace(".base_layer.", ".").replace(".modules_to_save.", ".")
            update = updates.setdefault(target, TensorUpdate())
            if update.replacement is not None:
                raise MergeError(f"adapter tensors {update.sources[0]} and {key} both replace {target}")
            update.replacement, update.sources = tensor, update.sources + [key]
    return modules, updates


def _add_module_lora(updates: dict, config: dict, module: str, parts: dict, params, transposed) -> None:
    """The update of one module's LoRA pair (and its DoRA magnitude and LoRA bias), checked against the config."""
    embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A.weight", "lora_B.weight")
    if a_key not in parts or b_key not in parts:
        have = ", ".join(parts[p][0] for p in parts)
        raise MergeError(
            f"the adapter has {have} but not both LoRA factors of {module}: the adapter file is incomplete, save it again"
        )
    (a_src, a), (b_src, b) = parts[a_key], parts[b_key]
    if params is not None and not embedding and params.names_wrapper(module):
        _add_param_updates(updates, params.updates(module, a, b, config, [a_src, b_src]), [a_src, b_src], module)
        return
    if a.dim() != 2 or b.dim() != 2:
        raise MergeError(f"{a_src} has {a.dim()} dimensions: only LoRA on Linear and Embedding layers can be merged")
    scaling = _scaling(config, module, a_src, a, b)
    magnitude = parts.get("lora_magnitude_vector", (None, None))[1]
    if magnitude is not None and embedding:
        raise MergeError(
            f"{module} uses DoRA on an embedding layer, which merge-adapters does not merge; train it without use_dora"
        )
    if config.get("use_dora") and magnitude is None:
        raise MergeError(
            f"adapter_config.json sets use_dora=true but the adapter has no lora_magnitude_vector for {module}; save it again"
        )
    update = updates.setdefault(f"{module}.weight", TensorUpdate())
    flip = (module in transposed) if transposed is not None else bool(config.get("fan_in_fan_out"))
    update.lora = LoraFactors(a, b, scaling, embedding, flip and not embedding, magnitude, module)
    update.sources += [a_src, b_src]
    if "lora_B.bias" in parts:
        bias_src, bias = parts["lora_B.bias"]
        bias_update = updates.setdefault(f"{module}.bias", TensorUpdate())
        bias_update.lora_bias, bias_update.sources = (bias, scaling), bias_update.sources + [bias_src]


def _scaling(config: dict, module: str, a_src: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """alpha / r (alpha / sqrt(r) under rsLoRA) of `module`, its rank checked against the factors' shapes."""
    rank = _pattern_value(config.get("rank_pattern"), module, config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
    if a.shape[0] != rank or b.shape[1] != rank:
        raise MergeError(
            f"adapter_config.json gives {module} rank {rank} (r / rank_pattern) but {a_src} has shape "
            f"{tuple(a.shape)}: the config does not belong to these weights; use the adapter_config.json saved with them"
        )
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _add_param_updates(updates: dict, found, sources: list[str], module: str) -> None:
    for key, (a, b, scaling) in found:
        update = updates.setdefault(key, TensorUpdate())
        if update.lora is not None:
            raise MergeError(f"adapter tensors {update.sources[0]} and {sources[0]} both hold a LoRA of {key}")
        update.lora = LoraFactors(a, b, scaling, False, False, None, module)
        update.sources += sources


def _row_blocks(shape, f: LoraFactors) -> bool:
    """Whether `f` (batched over experts) updates a 2-D tensor of shape `shape` a block of rows per expert."""
    return f.a.dim() == 3 and len(shape) == 2


def _implied_shapes(key: str, update: TensorUpdate, base_shape=()) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(adapter key, shape it implies for the base tensor, or None, and for DoRA the number of output rows)."""
    found = []
    if update.replacement is not None:
        found.append((update.sources[0], tuple(update.replacement.shape), None))
    if update.lora is not None:
        f = update.lora
        if f.embedding:  # A: (r, num_embeddings), B: (embedding_dim, r)
            found.append((update.sources[-2], (f.a.shape[1], f.b.shape[0]), None))
        else:  # (out, in), after the expert dimension of a fused 3-D tensor
            out_in = (f.b.shape[-2], f.a.shape[-1])
            if _row_blocks(base_shape, f):  # experts' row blocks stacked in one 2-D tensor
                found.append((update.sources[-2], (f.a.shape[0] * out_in[0], out_in[1]), None))
                return found
            found.append(
                (update.sources[-2], (*f.a.shape[:-2], *(out_in[::-1] if f.fan_in_fan_out else out_in)), None)
            )
        if f.magnitude is not None:
            found.append((f"{f.module}.lora_magnitude_vector", None, f.magnitude.numel()))
    if update.lora_bias is not None:
        found.append((update.sources[-1], tuple(update.lora_bias[0].shape), None))
    return found


def _check_token_rows(key: str, update: TensorUpdate, base_shape: tuple[int, ...], base_model) -> None:
    rows, delta = update.token_rows
    if tuple(delta.shape[1:]) != tuple(base_shape[1:]) or int(rows.max()) >= base_shape[0] or int(rows.min()) < 0:
        trained_on = f" (adapter_config.json: base_model_name_or_path={base_model!r})" if base_model else ""
        raise MergeError(
            f"adapter tensor {next(s for s in update.sources if 'token_adapter' in s)} writes rows up to "
            f"{int(rows.max())} of width {tuple(delta.shape[1:])} into {key}, whose shape is {base_shape}: the "
            f"adapter was trained on a different model{trained_on}. Pass the model it was trained on as `base`."
        )


def check_shape(key: str, update: TensorUpdate, base_shape: tuple[int, ...], base_model: str | None) -> None:
    """Raise MergeError when the adapter implies a shape for base tensor `key` that the base does not have."""
    base_shape = tuple(base_shape)
    if update.token_rows is not None:
        _check_token_rows(key, update, base_shape, base_model)
    for source, shape, rows in _implied_shapes(key, update, base_shape):
        out_rows = base_shape[-1] if update.lora is not None and update.lora.fan_in_fan_out else base_shape[0]
        if (shape is not None and shape != base_shape) or (rows is not None and rows != out_rows):
            trained_on = f" (adapter_config.json: base_model_name_or_path={base_model!r})" if base_model else ""
            got = f"shape {shape}" if shape is not None else f"{rows} output rows"
            raise MergeError(
                f"adapter tensor {source} implies {got} for {key}, but the base tensor has shape {base_shape}: "
                f"the adapter was trained on a different model{trained_on}. Pass the model it was trained on as `base`."
            )


def _t(tensor: torch.Tensor, flag: bool) -> torch.Tensor:
    return tensor.T if flag else tensor


def apply_update(
    weight: torch.Tensor | None, update: TensorUpdate, device: torch.device, scratch=None
) -> torch.Tensor:
    """The updated tensor in float32 on `device`; `weight` and the adapter tensors are left untouched.

    Args:
        weight: the base tensor (any dtype/device); may be None when the update replaces it.
        update: what the adapter does to it.
        device: where every tensor of this step is computed.
        scratch: optional `take(name, shape, dtype)` returning reusable buffers (the result lives in one,
            so it is only valid until the next call); None allocates fresh tensors.
    """

    def buffer(name, shape):
        if scratch is None:
            return torch.empty(shape, dtype=torch.float32, device=device)
        return scratch(name, shape, torch.float32)

    source = update.replacement if update.replacement is not None else weight
    w = buffer("w", tuple(source.shape))
    w.copy_(source)  # the one float32 copy every later step updates in place
    if update.lora is not None:
        f = update.lora
        a = f.a.to(device=device, dtype=torch.float32)
        b = f.b.to(device=device, dtype=torch.float32)
        # Same association as peft, transpose(B @ A) * scaling, then added: bit-identical float32 values.
        # Batched over the experts of a fused 3-D tensor: (E, out, r) @ (E, r, in).
        delta = torch.matmul(b, a, out=buffer("delta", (*a.shape[:-2], b.shape[-2], a.shape[-1])))
        delta.mul_(f.scaling)
        target = w.view(delta.shape) if _row_blocks(w.shape, f) else w  # expert e's delta on its rows
        target.add_(_t(delta, f.embedding or f.fan_in_fan_out))
        if f.magnitude is not None:
            # DoRA: each output row of W + dW is rescaled to the trained magnitude; the norm is taken over
            # the input dimension of the (out, in) layout, from the unmerged weight as in training.
            norm = torch.linalg.norm(_t(w, f.fan_in_fan_out), dim=1)
            factor = f.magnitude.to(device=device, dtype=torch.float32) / norm
            w.mul_(_t(factor.view(-1, 1), f.fan_in_fan_out))
    if update.lora_bias is not None:
        bias, scaling = update.lora_bias
        w.add_(bias.to(device=device, dtype=torch.float32) * scaling)
    if update.token_rows is not None:  # after everything else, as peft's TrainableTokensLayer.merge overwrites
        rows, delta = update.token_rows
        w.index_copy_(0, rows.to(device), delta.to(device=device, dtype=torch.float32))
    return w


# Rows per block on CPU: about 1 MiB of float32, so a block's float32 copy, its update and its cast all stay
# in cache; memory traffic is then one read of the base tensor and one write of the result.
_BLOCK_ELEMENTS = 1 << 18


def apply_update_into(
    out: torch.Tensor, weight: torch.Tensor | None, update: TensorUpdate, device: torch.device, scratch=None
) -> torch.Tensor:
    """Write the updated tensor into `out` (the output dtype, on `device`), computed in float32, cast once.

    A plain LoRA update of a 2-D weight on CPU is computed a block of rows at a time
    (`W[rows] + (B[rows] @ A) * scaling`, or the transposed factors for embeddings / fan_in_fan_out):
    the same float32 operations as `apply_update`, without whole-tensor float32 passes.
    Anything else (DoRA, replaced tensors, trained biases, other devices) goes through `apply_update`.
    """
    f = update.lora
    blockwise = (
        device.type == "cpu"
        and f is not None
        and f.magnitude is None
        and update.replacement is None
        and update.lora_bias is None
        and update.token_rows is None
        and weight is not None
        and (weight.dim() == f.a.dim() or _row_blocks(weight.shape, f))
        and weight.dim() in (2, 3)
    )
    if not blockwise:
        return out.copy_(apply_update(weight, update, device, scratch))
    a = f.a.to(device=device, dtype=torch.float32)
    b = f.b.to(device=device, dtype=torch.float32)
    left, right = (a.T, b.T) if (f.embedding or f.fan_in_fan_out) else (b, a)
    result = out
    if _row_blocks(weight.shape, f):  # experts' row blocks of one 2-D tensor: as the 3-D experts tensor they are
        shape = (a.shape[0], b.shape[-2], a.shape[-1])
        weight, out = weight.reshape(shape), out.view(shape)
    if weight.dim() == 3:  # a fused experts tensor: expert by expert, each a 2-D update from its own factors
        for expert in range(weight.shape[0]):
            _blockwise(out[expert], weight[expert], left[expert], right[expert], f.scaling, device, scratch)
        return result
    return _blockwise(out, weight, left, right, f.scaling, device, scratch)


def _blockwise(out, weight, left, right, scaling: float, device, scratch) -> torch.Tensor:
    rows, cols = weight.shape
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    if scratch is None:
        block, delta = (torch.empty((step, cols), dtype=torch.float32, device=device) for _ in range(2))
    else:
        block, delta = (scratch(name, (step, cols), torch.float32) for name in ("block", "block_delta"))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        w, d = block[: stop - start], delta[: stop - start]
        w.copy_(weight[start:stop])
        torch.matmul(left[start:stop], right, out=d)
        d.mul_(scaling)  # (B @ A) * scaling, then added: peft's association
        w.add_(d)
        out[start:stop].copy_(w)
    return out
