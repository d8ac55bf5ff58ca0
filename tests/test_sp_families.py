"""docs/long-context.md lists the families whose default config the sequence-parallel rule refuses (sliding-window,
linear, chunked or other local attention layers): the list equals what the rule says of every causal-LM family
transformers ships (tests/family_sweep.py's families), and the doctor refuses a listed one from its config alone.
The router aux loss rule (hf_fsdp_qlora.sp_rules.router_aux_problem) is the trainer's and the doctor's alike."""

from __future__ import annotations

import re

from dist_utils import REPO
from family_sweep import families

PAGE = REPO / "docs" / "long-context.md"


def _listed() -> set[str]:
    text = PAGE.read_text()
    found = re.search(r"<!-- sp-refused-families -->(.*?)<!-- /sp-refused-families -->", text, flags=re.S)
    assert found, "docs/long-context.md lost its sp-refused-families list"
    return {name.strip() for name in found.group(1).replace("\n", " ").split(",") if name.strip()}


def _text_config(family: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    try:
        return config.get_text_config(decoder=True)
    except ValueError:  # several text configs (an encoder-decoder): the model's own attributes
        return config


def _refused_by_default() -> dict[str, tuple[str, ...]]:
    from hf_fsdp_qlora.sp_rules import local_attention_kinds

    refused = {}
    for family in families():
        try:
            kinds = local_attention_kinds(_text_config(family))
        except Exception:  # noqa: BLE001 - a config class that cannot be built with its defaults: not claimed
            continue
        if kinds:
            refused[family] = kinds
    return refused


def test_listed_families_are_what_the_rule_refuses():
    refused = _refused_by_default()
    # The page names a family once: its `_text` config (and an `_assistant` one) follows it, and is refused alike.
    collapsed = {f for f in refused if not re.search(r"_(text|assistant)$", f) or f.rsplit("_", 1)[0] not in refused}
    assert _listed() == collapsed, (sorted(_listed() - collapsed), sorted(collapsed - _listed()))
    for family in ("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "granite"):  # the page says these are accepted
        assert family not in refused, (family, refused[family])


def test_doctor_refuses_a_listed_family_from_its_config(tmp_path):
    """Mistral's default config (a `sliding_window`, no `layer_types`): the doctor says what the trainer would."""
    from hf_fsdp_qlora.doctor import diagnose

    _text_config("mistral").save_pretrained(tmp_path)
    found = diagnose(tmp_path / "config.json", accelerate_config="fsdp2_qlora", quantization="4bit",
                     gpu_memory=80 * 2**30, seq_len=8192, sp_size=2, num_gpus=2)  # fmt: skip
    refused = [f for f in found.findings if f.id == "sequence-parallel-refused"]
    assert len(refused) == 1 and refused[0].severity == "error", found.findings
    assert "sliding_attention layers (sliding_window=4096)" in refused[0].problem, refused[0]


def _doge_with_router_logits():
    from transformers import DogeConfig

    return DogeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, is_moe=True, num_experts=16, num_experts_per_tok=2,
                      output_router_logits=True)  # fmt: skip


def test_router_aux_loss_rule_is_the_trainers_and_the_doctors(tmp_path):
    """Issue 49, row 3: under sp_size the router aux loss is recomputed over the whole sequence with transformers'
    load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask) (tests/test_sequence_parallel.py proves
    it exact for Qwen3-MoE). A family whose function takes other parameters (Doge) is refused by name, before the first
    step by the trainer and before launch by the doctor; a family that computes no aux loss (Llama) is not."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM

    from hf_fsdp_qlora.doctor import diagnose
    from hf_fsdp_qlora.errors import UnsupportedSetupError
    from hf_fsdp_qlora.sp_rules import router_aux_kind
    from hf_fsdp_qlora.train.sp_outputs import check_router_aux

    assert [router_aux_kind(k) for k in (LlamaForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM)] == [
        None, "balancing", "balancing"
    ]  # fmt: skip
    config = _doge_with_router_logits()
    with torch.device("meta"):
        doge = AutoModelForCausalLM.from_config(config)
    message = r"sp_size=2\) with output_router_logits=True: DogeForCausalLM computes its router aux loss with a "
    with pytest.raises(UnsupportedSetupError, match=message + ".*Set output_router_logits=False"):
        check_router_aux(doge, "FSDPQLoRATrainingArguments(sp_size=2)")
    config.save_pretrained(tmp_path)
    found = diagnose(tmp_path / "config.json", accelerate_config="fsdp2_qlora", quantization="4bit",
                     gpu_memory=80 * 2**30, seq_len=8192, sp_size=2, num_gpus=2)  # fmt: skip
    refused = [f for f in found.findings if f.id == "sequence-parallel-refused"]
    assert len(refused) == 1 and refused[0].severity == "error", found.findings
    assert "output_router_logits=True: 'doge' computes its router aux loss" in refused[0].problem, refused[0]
    assert "output_router_logits=False" in refused[0].value
    config.output_router_logits = False  # not asked: nothing to refuse
    config.save_pretrained(tmp_path)
    found = diagnose(tmp_path / "config.json", accelerate_config="fsdp2_qlora", quantization="4bit",
                     gpu_memory=80 * 2**30, seq_len=8192, sp_size=2, num_gpus=2)  # fmt: skip
    assert not [f for f in found.findings if f.id == "sequence-parallel-refused"], found.findings
