"""Every adapter peft saves for a model we train merges (issue 13 item 6, issue 12 item 3, merge side).

Adapters are written by peft's own `save_pretrained`; the oracle is peft's own `merge_and_unload` on the
16-bit base prepared the same way (resized, or loaded with the task class).
"""

from __future__ import annotations

import json

import torch
from test_merge import read_output
from tiny_models import build_tiny_model, build_tokenizer

from hf_fsdp_qlora.merge.pipeline import merge_adapters

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 256, 257]])  # the last two are the added tokens


def _perturb(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)


def test_resized_embeddings_adapter_merges_like_peft(tmp_path):
    """ChatML tokens added, embeddings resized: peft saves embed_tokens and lm_head whole beside the LoRA."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path / "base", "llama")

    def resized(seed):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        tok = build_tokenizer(256)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tok))
        return model, tok

    model, tok = resized(seed=3)
    with torch.no_grad():  # training moved the new tokens' rows
        model.get_input_embeddings().weight[256:] += 0.1
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    _perturb(peft_model, 1)
    peft_model.save_pretrained(tmp_path / "ad")
    tok.save_pretrained(tmp_path / "ad")
    with safe_keys(tmp_path / "ad") as keys:  # peft's "auto" saved the resized layers whole
        assert "base_model.model.model.embed_tokens.weight" in keys and "base_model.model.lm_head.weight" in keys

    out = merge_adapters(base, tmp_path / "ad", tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 258
    oracle_base, _ = resized(seed=99)  # resized the same way; its new rows are overwritten by the adapter's
    oracle = PeftModel.from_pretrained(oracle_base, tmp_path / "ad").merge_and_unload()
    ref, ours = oracle.state_dict(), read_output(out)
    assert ours["model.embed_tokens.weight"].shape == (258, 64)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(merged(IDS).logits, oracle(IDS).logits)


def test_reward_model_adapter_merges_like_peft(tmp_path):
    """A reward model: LoRA plus the `score` head (modules_to_save) on the causal LM base it was trained on."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification

    base = build_tiny_model(tmp_path / "base", "llama")

    def reward_model():
        return AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.bfloat16)

    torch.manual_seed(0)
    peft_model = get_peft_model(reward_model(), LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"]))
    _perturb(peft_model, 2)
    peft_model.save_pretrained(tmp_path / "ad")
    with safe_keys(tmp_path / "ad") as keys:
        assert "base_model.model.score.weight" in keys

    out = merge_adapters(base, tmp_path / "ad", tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    ours = read_output(out)
    assert "lm_head.weight" not in ours and ours["score.weight"].shape == (1, 64)
    oracle = PeftModel.from_pretrained(reward_model(), tmp_path / "ad").merge_and_unload()
    ref = oracle.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    merged = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(merged(IDS[:, :6]).logits, oracle(IDS[:, :6]).logits)


class safe_keys:  # a context manager, named like one
    def __init__(self, folder):
        from safetensors import safe_open

        self._fh = safe_open(str(folder / "adapter_model.safetensors"), "pt")

    def __enter__(self):
        return set(self._fh.keys())

    def __exit__(self, *exc):
        return False


def test_trainable_token_indices_merge_like_peft(tmp_path):
    """trainable_token_indices: only the listed rows are trained and saved (plus the whole embedding when the
    vocabulary was resized); on a tied base the output head shares them."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    for arch, resize in (("llama", True), ("llama_tied", False)):
        base = build_tiny_model(tmp_path / arch, arch)

        def prepared(seed, base=base, resize=resize):
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            if resize:
                torch.manual_seed(seed)
                model.resize_token_embeddings(258)
            return model

        rows = [256, 257, 7] if resize else [5, 17, 42]
        config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=rows)
        peft_model = get_peft_model(prepared(3), config)
        _perturb(peft_model, 4)
        peft_model.save_pretrained(tmp_path / f"ad_{arch}")
        with safe_keys(tmp_path / f"ad_{arch}") as keys:
            assert any("token_adapter.trainable_tokens_delta" in k for k in keys), keys

        out = merge_adapters(base, tmp_path / f"ad_{arch}", tmp_path / f"out_{arch}", progress=False)
        oracle = PeftModel.from_pretrained(prepared(99), tmp_path / f"ad_{arch}").merge_and_unload()
        ref, ours = oracle.state_dict(), read_output(out)
        ref = {k: v for k, v in ref.items() if k in ours or not oracle.config.tie_word_embeddings}
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours), arch
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        ids = IDS if resize else IDS[:, :6]
        with torch.no_grad():
            assert torch.equal(merged(ids).logits, oracle(ids).logits), arch
