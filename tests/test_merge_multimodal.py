"""Issue 48: ``merge-adapters`` merges a stock peft adapter trained on a multimodal checkpoint, whichever class it was
trained on: the composite class (``MllamaForConditionalGeneration``, ``Llama4ForConditionalGeneration``: the class
trl's loader picks) or the text-only class ``AutoModelForCausalLM`` maps the family to (``MllamaForCausalLM``,
``Llama4ForCausalLM``).

Before: "the adapter changes N tensor(s) the base does not have ... Pass the model it was trained on as `base`",
with `base_model_name_or_path` equal to that base: the merge read key conversions off the text-only class only, and
the checkpoint stores the language model under ``language_model.model.`` (the composite class loads it as
``model.language_model.``, the text-only class as ``model.``).

Oracle: peft's own ``merge_and_unload`` on the class the adapter was trained on (float32). Tiny models built locally
from the config classes; untouched tensors (the vision tower's) must come out byte-identical.
"""

from __future__ import annotations

import pytest
import torch

TEXT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def _mllama():
    from transformers import MllamaConfig, MllamaForCausalLM, MllamaForConditionalGeneration

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 16, "vision_output_dim": 64,
              "intermediate_layers_indices": [0]}  # fmt: skip
    config = MllamaConfig(text_config={**TEXT, "cross_attention_layers": [1]}, vision_config=vision)
    return config, MllamaForConditionalGeneration, MllamaForCausalLM


def _llama4():
    from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration

    text = {**TEXT, "intermediate_size_mlp": 128, "head_dim": 16, "num_local_experts": 2, "moe_layers": [1],
            "layer_types": ["full_attention"] * 2, "no_rope_layers": [1, 1], "attention_chunk_size": 64}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 16, "vision_output_dim": 64, "projector_input_dim": 64,
              "projector_output_dim": 64}  # fmt: skip
    return Llama4Config(text_config=text, vision_config=vision), Llama4ForConditionalGeneration, Llama4ForCausalLM


FAMILIES = {"mllama": _mllama, "llama4": _llama4}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            config, composite, text_only = FAMILIES[family]()
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(family) / "base"
            composite(config).to(torch.float32).save_pretrained(path)
            made[family] = (path, composite, text_only)
        return made[family]

    return get


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("which", ["composite", "text_only"])
def test_merge_a_stock_adapter_of_either_class(bases, family, which, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    from hf_fsdp_qlora.merge import merge_adapters

    base, composite, text_only = bases(family)
    cls = composite if which == "composite" else text_only
    # LoRA on the language model's self-attention (not the vision tower, not Mllama's cross-attention)
    targets = r".*language_model.*self_attn\.(q_proj|v_proj)" if which == "composite" else r".*self_attn\.[qv]_proj"
    model = cls.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)
    adapter = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    assert not [n for n, _ in adapter.named_modules() if "vision" in n and "lora_A" in n]
    adapter.save_pretrained(tmp_path / "adapter")

    out = merge_adapters(base, tmp_path / "adapter", tmp_path / "merged", progress=False)
    oracle = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), str(tmp_path / "adapter"))
    oracle = oracle.merge_and_unload().state_dict()
    merged = cls.from_pretrained(out, dtype=torch.float32).state_dict()
    assert merged.keys() == oracle.keys()
    for key, value in oracle.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)
    # written in the base's own layout: the composite class loads it, every untouched tensor byte-identical
    before, after = _tensors(base), _tensors(out)
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("language_model" in k and "self_attn" in k for k in changed), sorted(changed)
    assert not [k for k in changed if "vision" in k]
    composite.from_pretrained(out, dtype=torch.float32)
