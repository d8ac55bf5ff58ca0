"""Tiny models of every causal-LM family transformers ships, built from each config class by a generic shrink.

`tiny_config(model_type)` takes the family's default config and overrides only the size fields it has (hidden size,
layers, heads, experts, vocabulary, state and conv sizes), keeping the ratios the modelling code divides by; nested
sub-configs (text, vision, audio towers) and per-layer lists and configs are shrunk alike. What the generic rules
cannot know (a size field None by default, a family's own ratio or layer pattern) is in FAMILY_SIZES, one entry per
family; NOT_BUILT lists the families no rule builds, with the reason. No hub: configs are the classes' defaults,
weights are random.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS = 64, 4, 2, 16, 512, 4

# field -> tiny value, applied to every config that already has the field (and is not None there).
SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "n_embed": HIDDEN, "embed_dim": HIDDEN,
    "dim": HIDDEN, "model_dim": HIDDEN, "emb_dim": HIDDEN, "hidden_dim": HIDDEN, "word_embed_proj_dim": HIDDEN,
    "intermediate_size": 128, "ffn_dim": 128, "ffn_hidden_size": 128, "n_inner": 128, "d_ff": 128,
    "dim_ff": 128, "dff": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_intermediate_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "expert_intermediate_size": 32,
    "block_size": 32, "moe_ffn_hidden_size": 32, "expert_ffn_hidden_size": 32,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "num_global_key_value_heads": KV_HEADS,
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS, "swa_head_dim": HEAD_DIM,
    "head_dim": HEAD_DIM, "dim_head": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    "global_head_dim": HEAD_DIM,
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": 2, "top_k": 2, "moe_topk": 2, "num_experts_per_token": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_expert_group": 1,
    # latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-lite)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2,
    # state-space and convolution mixers
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "d_state": 8, "time_step_rank": 8,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "n_groups": 1, "mamba_num_heads": 8,
    "mamba_head_dim": 16, "mamba_expand": 2, "expand": 2, "mamba_d_conv": 4, "conv_kernel": 4,
    "linear_num_heads": HEADS, "linear_head_dim": HEAD_DIM,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_d_ssm": 128, "lru_width": HIDDEN, "conv1d_width": 4, "conv_L_cache": 3, "attention_window_size": 16,
    "rotary_dim": 8,  # GPT-J, CodeGen: rotary on part of the head
    "max_position_embeddings": 512, "n_positions": 512, "sliding_window": 16,
}  # fmt: skip
MAX_PARAMETERS = 2_000_000
# Qwen4-Exp: its sparse-attention indexer's sizes (None by default; the head must hold the rotary part), the
# hyper-connections' low rank and the hashed n-gram table (20,000,000 rows)
_QWEN4 = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "head_dim": HEAD_DIM,
          "indexer_budget": 8, "indexer_compress_ratio": 2, "hc_lowrank": 16, "ngram_vocab_size_base": 256,
          "make_ngram_vocab_size_divisible_by": 8}  # fmt: skip
# Gemma 3n: its last layers reuse the cache of the last earlier layer of their kind (both kinds must come first)
_GEMMA3N = {"num_hidden_layers": 7, "num_kv_shared_layers": 2, "layer_types": ["sliding_attention"] * 4
            + ["full_attention", "sliding_attention", "full_attention"]}  # fmt: skip
# What the generic rules above cannot know: a family's own ratio or layer pattern, so that it builds tiny.
FAMILY_SIZES = {
    "mamba2": {"num_heads": 8},  # hidden_size * expand == num_heads * head_dim
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one entry per layer
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2},  # an attention layer within the 2
    "recurrent_gemma": {"num_hidden_layers": 3},  # its block pattern: recurrent, recurrent, attention
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default
    # three dense layers first (first_k_dense_replace): two layers cut from the pattern would have no MoE
    "deepseek_v32": {"first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"]},
    "glm_moe_dsa": {"first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"]},
    # its rotary parameters per layer type, none by default (the released checkpoint's config names them)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "roc_bert": {
        "shape_vocab_size": 64,
        "shape_embed_dim": 32,
        "pronunciation_vocab_size": 64,
        "pronunciation_embed_dim": 32,
    },  # its glyph-shape and pronunciation tables
    "longcat_flash": {"zero_expert_num": 2},  # 256 identity ("zero") experts beside the routed ones
    # grouped low-rank output projection; compression windows the sweep's 8 tokens fill (4 and 128 by default: the
    # heavily compressed attention's compressor, and its LoRA, would see no complete window, so no gradient)
    "deepseek_v4": {
        "o_lora_rank": 16,
        "o_groups": 2,
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    },
    # Size fields None by default (the modelling code reads them; a released config.json sets them)
    "hunyuan_v1_dense": {"head_dim": HEAD_DIM},
    "hunyuan_v1_moe": {"head_dim": HEAD_DIM},
    "ministral": {"head_dim": HEAD_DIM},
    "nemotron": {"num_key_value_heads": KV_HEADS},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # read by the model but not fields of its attention config (DBRX-Instruct sets them: 500000 and 8)
    "dbrx": {"attn_config": {"rope_theta": 5e5, "clip_qkv": 8.0}},
    "zaya": {"num_experts_per_tok": 1},  # its only supported routing
    "xmod": {"default_language": "en_XX"},  # its per-language adapters need one to run
    # its LM head requires is_decoder; axial position tables: dims summing to the width, shape to the positions
    "reformer": {
        "is_decoder": True,
        "axial_pos_embds_dim": [32, 32],
        "axial_pos_shape": [2, 4],
        "attention_head_size": HEAD_DIM,
    },
    # two hybrid layers sharing one attention block (one alone has nothing to tie to); attention twice as wide
    "zamba": {"num_hidden_layers": 8, "attention_hidden_size": 2 * HIDDEN, "mamba_dt_rank": 8},
    # its sliding-window layers' head is the latent attention's nope and rope parts together
    "dots3_note_text": {"head_dim": 16},
    "dots3_note": {
        "text_config": {"head_dim": 16},  # and its towers' adapters: from their width to the text's
        "vision_config": {"adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN},
        "audio_config": {
            "adapter_input_size": HIDDEN,
            "adapter_out_dim": HIDDEN,
            "downsample_hidden_size": 32,
            "conv_output_size": 512,
        },
    },
    "gemma3n_text": _GEMMA3N,
    # towers' own width fields
    "got_ocr2": {"vision_config": {"output_channels": 32, "mlp_dim": 128, "image_size": 256}},
    "phi4_multimodal": {
        "audio_config": {
            "num_blocks": 2,
            "ext_pw_out_channel": HIDDEN,
            "nemo_conv_channels": HIDDEN,
            "depthwise_separable_out_channel": HIDDEN,
        }
    },
    "qwen4_exp_text": _QWEN4,
    "qwen4_exp": {"text_config": _QWEN4},
    # BLT: byte n-gram hash tables of 500,002 rows each; the local models' view of the global model's width
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_config": {"hidden_size_global": HIDDEN},
        "decoder_config": {"hidden_size_global": HIDDEN},
    },
}
# Families no size rule builds, each with the reason a user reads in docs/families.md.
_DRAFTER = (
    "a speculative-decoding drafter: its forward takes the main model's input embeddings and key/value "
    "states (shared_kv_states), not token ids, so it is not fine-tuned as a causal LM"
)
NOT_BUILT = {
    "gemma3n": "its vision tower is a timm model (TimmWrapperModel) and timm is not installed here; "
    "gemma3n_text, its language model alone, is built",
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "musicgen": "transformers maps it to MusicgenForCausalLM, which takes the decoder's config "
    "(MusicgenDecoderConfig), not the text-to-audio composite's a musicgen checkpoint ships",
    "musicgen_melody": "transformers maps it to MusicgenMelodyForCausalLM, which takes the decoder's config "
    "(MusicgenMelodyDecoderConfig), not the composite's a musicgen_melody checkpoint ships",
}


class NotBuilt(Exception):
    """A family on the NOT_BUILT list: its reason is the whole message."""


# Parameters a family initialises to zero that gate its linear layers: a trained model has them non-zero (Doge's
# dynamic mask is exp(A * softplus(dt_proj(v))): A = 0 leaves dt_proj, and its LoRA, without effect or gradient).
# Gemma 3n's AltUp scales the corrected stream by correct_output_scale (zero at init) before the per-layer-input gate:
# at zero, per_layer_input_gate / per_layer_projection / per_layer_model_projection and their LoRA do nothing.
# ZAYA's QK norm scales the keys by a per-head `temp` (zero at init): every key is zero, the attention uniform, and
# the CCA projection's q_proj / k_proj (and their LoRA) get no gradient.
FAMILY_PARAMS = {
    "doge": ("self_attn.A",),
    "gemma3n_text": ("altup.correct_output_scale",),
    "zaya": ("qk_norm.temp",),
}
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


def _num_layers(defaults: dict, rules: dict) -> int:
    """The family's own count where its rules give one; else 2, or enough layers for every distinct entry of the
    family's layer pattern to appear once."""
    for key in LAYER_FIELDS:
        if isinstance(rules.get(key), int):
            return rules[key]
    pattern = defaults.get("layer_types") or defaults.get("layers_block_type") or []
    if not isinstance(pattern, list) or not pattern:
        return 2
    first = {}
    for index, kind in enumerate(pattern):
        first.setdefault(str(kind), index)
    return max(2, max(first.values()) + 1)


def _per_layer(defaults: dict, overrides: dict, layers: int) -> None:
    """Per-layer lists (layer patterns, per-layer widths or sparsities) cut to `layers` entries, a shrunk size
    given to each; lists of layer indices keep those below `layers`."""
    count = next((defaults[k] for k in LAYER_FIELDS if isinstance(defaults.get(k), int)), None)
    for key, value in defaults.items():
        if not isinstance(value, list) or not value or key in ("architectures",):
            continue
        if key in SIZES:
            overrides[key] = [SIZES[key]] * layers
        elif len(value) == count or key in ("layer_types", "layers_block_type", "mlp_layer_types"):
            overrides[key] = value[:layers]
    for key in ("mlp_only_layers",):
        if isinstance(defaults.get(key), list):
            overrides[key] = [i for i in defaults[key] if i < layers]


def _nested(defaults: dict, overrides: dict, rules: dict, layers: int) -> None:
    """Sub-configs (a dict with its own model_type: text, vision, audio ...) and Gemma 4's / dots3's per-layer
    configs ({layer index or layer type: that layer's own sizes}) shrunk like the config itself."""
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:
            overrides[key] = {**value, **_shrunk(value, rules.get(key) or {})}
    per_layer = defaults.get("per_layer_config")
    if isinstance(per_layer, dict):
        kept = {k: v for k, v in per_layer.items() if not str(k).isdigit() or int(k) < layers}
        kinds = rules.get("per_layer_config") or {}
        overrides["per_layer_config"] = {k: {**v, **_shrunk(v, kinds.get(k) or {})} for k, v in kept.items()}


def _shrunk(defaults: dict, rules: dict) -> dict:
    """Overrides of the size fields `defaults` has, then the family's `rules` (nested dicts: a sub-config's)."""
    overrides = {key: value for key, value in SIZES.items() if defaults.get(key) is not None}
    layers = _num_layers(defaults, rules)
    overrides.update({key: layers for key in LAYER_FIELDS if defaults.get(key) is not None})
    _per_layer(defaults, overrides, layers)
    if defaults.get("qk_rope_head_dim") is not None and "head_dim" in overrides:
        overrides["head_dim"] = SIZES["qk_rope_head_dim"]  # latent attention: rotary runs on the rope part
    if defaults.get("kv_lora_rank") and defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        overrides["num_key_value_heads"] = HEADS  # latent attention expands its keys to every head
    for key in _TOKEN_IDS:
        value = defaults.get(key)
        if isinstance(value, int) and value >= VOCAB:
            overrides[key] = min(value, VOCAB - 1) if key != "pad_token_id" else 0
        elif isinstance(value, list):
            overrides[key] = [v for v in value if v < VOCAB] or [1]
    _nested(defaults, overrides, rules, layers)
    return _merged(overrides, rules)


def _merged(base: dict, rules: dict) -> dict:
    """`base` with `rules` applied, a nested dict merged into the dict it names."""
    out = dict(base)
    for key, value in rules.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if nested else value
    return out


def tiny_config(model_type: str):
    """The family's default config with its size fields shrunk (see the module docstring)."""
    from transformers import AutoConfig

    rules = FAMILY_SIZES.get(model_type, {})
    defaults = AutoConfig.for_model(model_type).to_dict()
    return AutoConfig.for_model(model_type, **_shrunk(defaults, rules))


def build(model_type: str, path: Path, seed: int = 0) -> Path:
    """A tiny random `model_type` causal LM saved (bf16, safetensors) to `path`; raises what transformers raises."""
    from transformers import AutoModelForCausalLM

    if model_type in NOT_BUILT:
        raise NotBuilt(NOT_BUILT[model_type])
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    with torch.device("meta"):  # count first: a size field the shrink does not know can leave a huge model
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count:,} parameters after the generic shrink (a size field it does not know)")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases default to zero; make them matter so a lost bias shows in the merge
        for name, param in model.named_parameters():
            if name.endswith((".bias", *FAMILY_PARAMS.get(model_type, ()))):
                param.normal_(0.0, 0.1)
    with torch.no_grad():
        model(torch.arange(3, 11).unsqueeze(0), use_cache=False)  # a model that cannot run its forward is not "built"
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def build_error(exc: BaseException) -> str:
    """One line: the exception's type and first line of text, and where in transformers it was raised."""
    if isinstance(exc, NotBuilt):
        return str(exc)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "transformers" in f.filename]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}{where}"
