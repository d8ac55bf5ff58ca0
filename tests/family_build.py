"""Tiny models of every causal-LM family transformers ships, built from each config class by a generic shrink.

`tiny_config(model_type)` takes the family's default config and overrides only the size fields it has (hidden size,
layers, heads, experts, vocabulary, state and conv sizes), keeping the ratios the modelling code divides by. A family
whose config or model cannot be built this way is listed with the reason (`build_all` returns it beside the paths).
No hub: configs are the classes' defaults, weights are random.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS = 64, 4, 2, 16, 512, 4

# field -> tiny value, applied to every config that already has the field (and is not None there).
SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "n_embed": HIDDEN, "embed_dim": HIDDEN,
    "dim": HIDDEN, "model_dim": HIDDEN, "hidden_dim": HIDDEN, "word_embed_proj_dim": HIDDEN,
    "intermediate_size": 128, "ffn_dim": 128, "ffn_hidden_size": 128, "n_inner": 128, "d_ff": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_intermediate_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "block_size": 32, "moe_ffn_hidden_size": 32,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "num_global_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM, "global_head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": 2, "top_k": 2, "moe_topk": 2, "num_experts_per_token": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    # latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-lite)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2,
    # state-space and convolution mixers
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "d_state": 8, "time_step_rank": 8,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "n_groups": 1, "mamba_num_heads": 8,
    "mamba_head_dim": 16, "mamba_expand": 2, "expand": 2, "mamba_d_conv": 4, "conv_kernel": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_d_ssm": 128, "lru_width": HIDDEN, "conv1d_width": 4, "conv_L_cache": 3, "attention_window_size": 16,
    "max_position_embeddings": 512, "n_positions": 512, "sliding_window": 16,
}  # fmt: skip
MAX_PARAMETERS = 2_000_000
# What the generic rules above cannot know: a family's own ratio or layer pattern, so that it builds tiny.
FAMILY_SIZES = {
    "mamba2": {"num_heads": 8},  # hidden_size * expand == num_heads * head_dim
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one entry per layer
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2},  # an attention layer within the 2
    "recurrent_gemma": {"num_hidden_layers": 3},  # its block pattern: recurrent, recurrent, attention
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default
}
# Parameters a family initialises to zero that gate its linear layers: a trained model has them non-zero (Doge's
# dynamic mask is exp(A * softplus(dt_proj(v))): A = 0 leaves dt_proj, and its LoRA, without effect or gradient).
FAMILY_PARAMS = {"doge": ("self_attn.A",)}
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


def _num_layers(defaults: dict) -> int:
    """2, or enough layers for every distinct entry of the family's own layer pattern to appear once."""
    pattern = defaults.get("layer_types") or defaults.get("layers_block_type") or []
    if not isinstance(pattern, list) or not pattern:
        return 2
    first = {}
    for index, kind in enumerate(pattern):
        first.setdefault(str(kind), index)
    return max(2, max(first.values()) + 1)


def tiny_config(model_type: str):
    """The family's default config with its size fields shrunk (see the module docstring)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    overrides = {key: value for key, value in SIZES.items() if defaults.get(key) is not None}
    layers = _num_layers(defaults)
    overrides.update({key: layers for key in LAYER_FIELDS if defaults.get(key) is not None})
    for key in ("layer_types", "layers_block_type"):
        if isinstance(defaults.get(key), list) and defaults[key]:
            overrides[key] = defaults[key][:layers]
    for key in ("mlp_only_layers",):
        if isinstance(defaults.get(key), list):
            overrides[key] = [i for i in defaults[key] if i < layers]
    if defaults.get("qk_rope_head_dim") is not None and "head_dim" in overrides:
        overrides["head_dim"] = SIZES["qk_rope_head_dim"]  # latent attention: rotary runs on the rope part
    overrides.update(FAMILY_SIZES.get(model_type, {}))
    for key in _TOKEN_IDS:
        value = defaults.get(key)
        if isinstance(value, int) and value >= VOCAB:
            overrides[key] = min(value, VOCAB - 1) if key != "pad_token_id" else 0
        elif isinstance(value, list):
            overrides[key] = [v for v in value if v < VOCAB] or [1]
    return AutoConfig.for_model(model_type, **overrides)


def build(model_type: str, path: Path, seed: int = 0) -> Path:
    """A tiny random `model_type` causal LM saved (bf16, safetensors) to `path`; raises what transformers raises."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    with torch.device("meta"):  # count first: a size field the shrink does not know can leave a huge model
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count:,} parameters after the generic shrink (a size field it does not know)")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases default to zero; make them matter so a lost bias shows in the merge
        for name, param in model.named_parameters():
            if name.endswith(".bias") or name.endswith(FAMILY_PARAMS.get(model_type, ())):
                param.normal_(0.0, 0.1)
    with torch.no_grad():
        model(torch.arange(3, 11).unsqueeze(0), use_cache=False)  # a model that cannot run its forward is not "built"
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def build_error(exc: BaseException) -> str:
    """One line: the exception's type and first line of text, and where in transformers it was raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "transformers" in f.filename]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}{where}"
