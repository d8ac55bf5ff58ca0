"""What the merge needs to know about the base model, read from its files (never by loading it).

Its tensors (names, dtypes, shapes, byte ranges across the safetensors shards), its tied weights, and the
weights bitsandbytes would quantize when QLoRA loads it; and whether the adapter says it was trained on it.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import torch

from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.safetensors_io import INDEX_NAME, TensorEntry, checkpoint_shards, read_header

__all__ = [
    "INDEX_NAME",
    "base_entries",
    "check_base_name",
    "conv1d_modules",
    "meta_model",
    "meta_model_or_none",
    "quantized_keys",
    "tied_map",
]

_INDEX = INDEX_NAME  # short local name


def base_entries(base: Path) -> dict[str, TensorEntry]:
    """Every tensor of the base, from the safetensors headers only: name -> entry, shard by shard in file order.

    Raises:
        MergeError: no safetensors weights, a shard the index lists is missing, or a header is corrupted.
    """
    found = checkpoint_shards(base)
    if found is None:
        raise MergeError(
            f"{base} has no safetensors weights (model.safetensors or {_INDEX}). Re-save the base with "
            "AutoModelForCausalLM.from_pretrained(BASE).save_pretrained(NEW_BASE) and pass that as `base`."
        )
    files, weight_map = found
    entries: dict[str, TensorEntry] = {}
    for name in files:
        if not (base / name).is_file():
            raise MergeError(f"{base / _INDEX} lists {name}, which is missing: the base download is incomplete")
        for key, entry in read_header(base / name)[0].items():
            if key in entries:
                raise MergeError(f"tensor {key} is stored twice in {base} ({entries[key].path.name} and {name})")
            entries[key] = entry
    if weight_map is not None and set(weight_map) - set(entries):
        missing = sorted(set(weight_map) - set(entries))[:3]
        raise MergeError(
            f"{base / _INDEX} lists tensors its shards do not hold (e.g. {missing}): the base is incomplete; "
            "save or download it again"
        )
    if weight_map is not None and set(entries) - set(weight_map):
        unlisted = sorted(set(entries) - set(weight_map))[:3]
        raise MergeError(
            f"the shards of {base} hold tensors {base / _INDEX} does not list (e.g. {unlisted}): the index does not "
            "belong to these shards; save or download the base model again"
        )
    _check_not_packed(base, entries)
    return entries


# bitsandbytes' serialized quant state sits beside each packed 4-bit or 8-bit weight.
_PACKED = re.compile(r"\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.bitsandbytes__\w+|SCB)$")


def _check_not_packed(base: Path, entries: dict[str, TensorEntry]) -> None:
    packed = next((k for k in entries if _PACKED.search(k)), None)
    if packed is not None:
        raise MergeError(
            f"{base} holds bitsandbytes-quantized weights (e.g. {packed}), though its config.json has no "
            "quantization_config: it is a saved 4-bit/8-bit model, not a 16-bit base. Pass the 16-bit model it was "
            "quantized from as `base` (and `dequantize='nf4'` to match QLoRA)."
        )


def tied_map(base: Path, config: dict, keys) -> dict[str, str]:
    """{tied name: stored name} for the base's tied weights (e.g. lm_head.weight -> model.embed_tokens.weight)."""
    tie = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings"))
    if tie is None:  # left out of config.json when equal to the class default: ask transformers
        from transformers import AutoConfig

        tie = getattr(AutoConfig.from_pretrained(base), "tie_word_embeddings", False)
    if not tie:
        return {}
    mapping, cls = {}, None
    try:
        import transformers

        cls = getattr(transformers, (config.get("architectures") or [""])[0], None)
        mapping = dict(getattr(cls, "_tied_weights_keys", None) or {})
    except (ImportError, TypeError, ValueError):
        mapping = {}
    if cls is not None and not getattr(cls, "_tied_weights_keys", None):
        # a known class that ties nothing, whatever its config says (BigBirdPegasusForCausalLM stores lm_head apart)
        return {}
    if not mapping:  # unknown architecture: the output head is tied to the one input embedding
        embeds = [
            k for k in keys if re.search(r"(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings)\.weight$", k)
        ]
        mapping = {"lm_head.weight": embeds[0]} if len(embeds) == 1 else {}
    return {alias: source for alias, source in mapping.items() if source in keys}


def meta_model(base: Path):
    """The base's causal-LM class built from its config.json on the meta device (nothing is allocated); built
    once per config, as several steps of a merge ask (a 48-layer, 128-expert model takes seconds). A composite
    checkpoint ``AutoModelForCausalLM`` does not map (Inkling 2's ``Inkling2ForConditionalGeneration``): the first
    class config.json's ``architectures`` names that builds."""
    try:
        return _meta_model(str(Path(base).resolve()), (Path(base) / "config.json").read_text())
    except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel"
        model = next(architecture_meta_models(base), None)
        if model is None:
            raise
        return model


@functools.lru_cache(maxsize=2)
def _meta_model(base: str, config_text: str):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fsdp_qlora.experts.dbrx import fuse_dbrx_experts

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    fuse_dbrx_experts(model)  # the experts' names as training held them (DBRX's in transformers' layout)
    return model


def architecture_meta_models(base: Path):
    """The classes config.json's ``architectures`` names (a multimodal checkpoint's composite class, e.g.
    ``MllamaForConditionalGeneration``, where ``AutoModelForCausalLM`` builds the text-only class), each built on
    the meta device when the caller gets to it; those this transformers lacks or cannot build are left out."""
    names = json.loads((Path(base) / "config.json").read_text()).get("architectures") or []
    for name in names:
        model = _architecture_model(str(Path(base).resolve()), name)
        if model is not None:
            yield model


@functools.lru_cache(maxsize=4)
def _architecture_model(base: str, name: str):
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    cls = getattr(transformers, name, None)
    if cls is None:
        return None
    from hf_fsdp_qlora.experts.dbrx import fuse_dbrx_experts

    try:
        with init_empty_weights():
            model = cls._from_config(AutoConfig.from_pretrained(base))
        fuse_dbrx_experts(model)
        return model
    except Exception:  # noqa: BLE001 - a class that cannot be built from the config says nothing here
        return None


def meta_model_or_none(base: Path):
    """:func:`meta_model`, or None where transformers cannot build the base from its config alone (remote code, a
    class this transformers lacks): the merge then knows no more than the base's files say."""
    try:
        return meta_model(base)
    except Exception:  # noqa: BLE001 - any failure to build only means: no class-level facts
        return None


def conv1d_modules(model) -> set[str]:
    """The GPT-2-style ``Conv1D`` modules of `model` (built on meta; None: none known) (GPT-2, GPT-SW3, OpenAI GPT):
    they store their weight (in, out), the transpose of ``nn.Linear``'s, and bitsandbytes quantizes that transpose
    (transformers transposes it first)."""
    if model is None:
        return set()
    return {name for name, module in model.named_modules() if type(module).__name__ == "Conv1D"}


def quantized_keys(base: Path, experts: bool = True, skip_modules=()) -> set[str]:
    """Weights bitsandbytes quantizes when transformers loads this base in 4 or 8 bits: every nn.Linear (and
    GPT-2's Conv1D) except the modules transformers keeps in 16 bit (output head, tied weights, fp32 modules);
    with `experts`, also the fused expert weights of the MoE families in the experts table (load_qlora_model quantizes
    those, expert by expert), under the model's names (they may be stored per expert: see :mod:`._experts`).
    `skip_modules`: more modules training kept 16-bit (``load_qlora_model(skip_modules=...)``), matched as
    transformers matches them."""
    model = meta_model(base)
    try:
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module

        skip = list(get_keys_to_not_convert(model)) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    except ImportError:  # older transformers: at least keep the output head unquantized, as they all did
        skip, should_convert_module = ["lm_head"], lambda name, pats: not any(name.endswith(p) for p in pats)
    skip = skip + list(skip_modules)
    found = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if (type(module) is torch.nn.Linear or type(module).__name__ == "Conv1D") and should_convert_module(name, skip)
    }
    if experts:  # by the experts table, never by a tensor's rank (a Conv1d's weight is 3-D too)
        from hf_fsdp_qlora.experts.layouts import expert_layout

        for name, module in model.named_modules():
            layout = expert_layout(module)
            if layout is not None:
                found |= {f"{name}.{w}" for w in layout.weights}
    return found


def check_base_name(adapter_config: dict, base: Path, base_config: dict, allow_other: bool = False) -> None:
    """Warn when adapter_config.json names another base model (called after the shapes matched).

    A local copy of a hub model has any folder name, so only a clear mismatch warns: a named folder whose
    config differs from the base's, or a hub id whose last part is not the base folder's name. A named local
    folder of another architecture (e.g. a Mistral adapter on a Llama base of the same shapes) is refused
    unless `allow_other`: the shapes agree, but the merged model would be meaningless.
    """
    name = adapter_config.get("base_model_name_or_path")
    if not name:
        return
    volatile = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
    candidate = Path(name)
    if candidate.is_dir():
        if candidate.resolve() == base.resolve():
            return
        try:
            other = json.loads((candidate / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            other = None
        if other is not None and {k: v for k, v in other.items() if k not in volatile} == {
            k: v for k, v in base_config.items() if k not in volatile
        }:
            return  # a copy of the same model
        theirs = _architecture(other or {})
        if other is not None and theirs != _architecture(base_config) and not allow_other:
            raise MergeError(
                f"adapter_config.json says the adapter was trained on {name}, a {theirs} model, but `base` {base} "
                f"is a {_architecture(base_config)} model. The shapes match, but the merged model would be wrong: "
                f"pass `base={name}`, or `allow_other_base=True` if you really mean to merge it into {base}."
            )
    elif name.rstrip("/").split("/")[-1].lower() in (
        base.resolve().name.lower(),
        str(base_config.get("_name_or_path", "")).rstrip("/").split("/")[-1].lower(),
    ):
        return
    warnings.warn(
        f"adapter_config.json says the adapter was trained on {name!r}, but the base is {base}. The shapes match, so "
        f"merging anyway; if {base} is not that model (or a copy of it), the merged model is wrong: merge into {name} instead.",
        stacklevel=3,
    )


def _architecture(config: dict) -> str:
    """`model_type` (e.g. "llama"), or the first architecture class name."""
    return str(config.get("model_type") or (config.get("architectures") or ["unknown"])[0])


# Input embeddings and output heads: the tensors a tokenizer resize (added tokens) changes in their first dim.
_VOCAB_TENSOR = re.compile(
    r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings|lm_head|embed_out)\.weight$"
)
_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings)\.weight$")
_TASK_MAPPINGS = {  # peft task_type -> the transformers auto mapping of the model class trained
    "SEQ_CLS": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "TOKEN_CLS": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "QUESTION_ANS": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}


def resized_vocab(key: str, replacement_shape: tuple[int, ...], base_shape: tuple[int, ...]) -> bool:
    """Whether a full tensor saved with the adapter is `key` resized for added tokens (only the first dim grew)."""
    return (
        _VOCAB_TENSOR.search(key) is not None
        and len(replacement_shape) == len(base_shape)
        and replacement_shape[1:] == tuple(base_shape[1:])
        and replacement_shape[0] != base_shape[0]
    )


def is_input_embedding(key: str) -> bool:
    return _INPUT_EMBEDDING.search(key) is not None


def task_model(base: Path, config: dict, adapter_config: dict, heads: dict[str, tuple[int, ...]]):
    """The task model an adapter was trained on when it carries a head the base lacks (e.g. a reward model:
    `score` of LlamaForSequenceClassification saved through modules_to_save), else None.

    Args:
        heads: the full tensors of the adapter that the base does not have, name -> shape.

    Returns:
        `(class name, its tensor names, config.json updates)`, from the class built on the meta device.
    """
    mapping_name = _TASK_MAPPINGS.get(str(adapter_config.get("task_type") or "").upper())
    if mapping_name is None or not heads:
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, models

    cls_name = getattr(models.auto.modeling_auto, mapping_name).get(config.get("model_type"))
    if not cls_name:
        return None
    import transformers

    two_d = [shape for shape in heads.values() if len(shape) == 2]
    num_labels = two_d[0][0] if two_d else 2
    task_config = AutoConfig.from_pretrained(base, num_labels=num_labels)
    with init_empty_weights():
        model = getattr(transformers, cls_name)(task_config)
    names = set(model.state_dict())
    if not set(heads) <= names:
        return None
    updates = {
        "architectures": [cls_name],
        "id2label": {str(i): task_config.id2label[i] for i in range(num_labels)},
        "label2id": {task_config.id2label[i]: i for i in range(num_labels)},
    }
    return cls_name, names, updates
