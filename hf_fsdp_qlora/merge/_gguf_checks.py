"""What llama.cpp's converters refuse or compute differently, said before they run, and their failures explained.

Every rule here was seen with llama.cpp's converters (llama-cpp-python 0.3.36's vendor/llama.cpp) on tiny models:
see docs/serving.md (llama.cpp and GGUF) for the measured cases.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hf_fsdp_qlora.errors import MergeError, MergeUsageError

__all__ = ["check_adapter", "check_model_folder", "converter_error", "family_notes", "read_model_config"]

MERGE_FIRST = (
    "Merge first (`merge-adapters --base BASE --adapter ADAPTER --output MERGED`) and export the merged model"
)
# Adapter entries convert_lora_to_gguf.py cannot hold; it writes only lora_A/lora_B pairs of 2-D weights.
_EMBEDDING = re.compile(r"\.(embed_tokens|lm_head|wte|word_embeddings)\.")


def read_model_config(model: Path) -> dict:
    config_path = model / "config.json"
    if not config_path.is_file():
        raise MergeUsageError(
            f"{model} has no config.json: pass a Hugging Face model folder (e.g. merge-adapters' --output)"
        )
    try:
        return json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MergeError(f"cannot read {config_path}: {err}") from None


def family_notes(config: dict) -> list[str]:
    """Families llama.cpp runs with different arithmetic than transformers: the GGUF converts, outputs differ."""
    notes = []
    text = config.get("text_config") or config
    if text.get("model_type") == "qwen3_moe" and not text.get("norm_topk_prob", False):
        notes.append(
            "Qwen3-MoE with norm_topk_prob=false: llama.cpp renormalises the top-k router weights whatever the "
            "config says, so its outputs differ from transformers' (they are equal with norm_topk_prob=true)"
        )
    return notes


def check_model_folder(model: Path) -> None:
    """Refuse a model folder whose tokenizer llama.cpp cannot read: it writes the vocabulary into the GGUF."""
    if (model / "tokenizer.model").is_file():
        return  # sentencepiece: the converter's first choice for Llama-like families
    tokenizer_json = model / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise MergeUsageError(
            f"{model} has no tokenizer (tokenizer.model or tokenizer.json): the GGUF carries the vocabulary. "
            "Copy the base model's tokenizer files into it (merge-adapters copies them from the base or adapter folder)"
        )
    kind = _tokenizer_kind(tokenizer_json)
    if kind in ("WordLevel", "WordPiece"):
        raise MergeUsageError(
            f"{tokenizer_json} is a {kind} tokenizer, which llama.cpp cannot read (it knows sentencepiece models and "
            "byte-level BPE): export a model whose base has a tokenizer.model or a BPE tokenizer.json"
        )


def _tokenizer_kind(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("model", {}).get("type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None  # the converter reports what it cannot read


def check_adapter(config: dict, tensors: dict) -> None:
    """Refuse, by name, what convert_lora_to_gguf.py cannot convert or llama.cpp would scale differently."""
    refusals = {
        "target_parameters": "expert LoRA has no GGUF adapter form; llama.cpp's converter stops at the fused "
        "experts ('Unprocessed experts')",
        "use_dora": "DoRA's magnitude vector has no GGUF adapter form",
        "use_rslora": "llama.cpp scales an adapter by lora_alpha / r, rsLoRA by lora_alpha / sqrt(r)",
        "alpha_pattern": "a GGUF adapter carries one lora_alpha for all layers",
        "modules_to_save": "modules_to_save are whole trained layers, not LoRA pairs",
        "lora_bias": "a GGUF adapter carries no LoRA bias",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise MergeUsageError(
                f"the adapter's {key}={config[key]!r} cannot become a GGUF adapter: {why}. {MERGE_FIRST}"
            )
    embedded = sorted({m.group(1) for k in tensors if (m := _EMBEDDING.search(k))})
    if embedded:
        raise MergeUsageError(
            f"the adapter trains {', '.join(embedded)}: llama.cpp's converter refuses LoRA on embeddings and on an "
            f"lm_head it ties to them. {MERGE_FIRST}"
        )


# (a pattern of the converter's output, the cause to tell the user)
_KNOWN_FAILURES = (
    (
        "BPE pre-tokenizer was not recognized",
        (
            "llama.cpp knows a BPE tokenizer by a hash of how it splits a test text, and this tokenizer's is not "
            "in this llama.cpp's list (a tokenizer of a family it has not seen, or one built for this model). A newer "
            "llama.cpp checkout may know it: pass it as `llama_cpp`"
        ),
    ),
    ("cannot find tokenizer merges", "llama.cpp reads only sentencepiece and BPE tokenizers (this one has no merges)"),
    (
        r"Architecture .* not supported|Model \S+ is not supported",
        "this llama.cpp does not convert this architecture: use a newer llama.cpp checkout",
    ),
    ("Unprocessed experts", "llama.cpp cannot convert LoRA on fused experts. " + MERGE_FIRST),
    ("No module named", "the converter needs a package this Python lacks (see the line above)"),
)


def converter_error(script: str, returncode: int, output: str, model: Path) -> MergeError:
    """The converter's failure as one error: the known cause where its output names one, and its last lines."""
    tail = "\n".join(output.strip().splitlines()[-6:])
    for needle, why in _KNOWN_FAILURES:
        if re.search(needle, output):
            return MergeUsageError(f"llama.cpp's {script} refused {model}: {why}.\nIts last lines:\n{tail}")
    return MergeError(f"llama.cpp's {script} failed (exit status {returncode}) on {model}; its last lines:\n{tail}")
