"""An adapter reloads as trained where peft 0.21 would rename its keys as if from the family's original checkpoint.

peft runs every saved adapter's keys through transformers' renamings of the original checkpoint names, and some of
them also match the model's own names: Laguna's ``mlp.shared_expert.`` (an unescaped dot) turns
``mlp.shared_experts.gate_proj`` into ``mlp.shared_experts..gate_proj``, so the shared-expert LoRA loaded nowhere
through ``load_qlora_model(adapter=...)`` (silently; stock ``PeftModel.from_pretrained`` on the 16-bit base does the
same). The oracle: the trained model's own logits and LoRA tensors.

Single-process, real bitsandbytes 4-bit and real peft, a tiny model built from the family's config; no hub.
"""

from __future__ import annotations

import torch
from family_build import build
from family_sweep import _lora_config, _move_adapter


def _lora(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_a_laguna_adapter_reloads_its_shared_expert_lora(tmp_path):
    from hf_fsdp_qlora.loading.qlora import load_qlora_model

    path = build("laguna", tmp_path / "m")
    ids = torch.arange(3, 11).unsqueeze(0)
    trained = load_qlora_model(path, dtype=torch.bfloat16, lora_config=_lora_config())
    _move_adapter(trained)  # as after training: every LoRA tensor off its start
    with torch.no_grad():  # load_qlora_model(adapter=) reads the adapter into bf16 LoRA layers first: bf16 values
        for name, param in trained.named_parameters():
            if "lora_" in name:
                param.copy_(param.to(torch.bfloat16))
    trained.eval()
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
    want = _lora(trained)
    assert any(".shared_experts." in n for n in want)
    trained.save_pretrained(tmp_path / "adapter")

    reloaded = load_qlora_model(path, dtype=torch.bfloat16, adapter=tmp_path / "adapter")
    got = _lora(reloaded)
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


def test_stock_peft_renames_laguna_shared_expert_keys(tmp_path):
    """The canary (hf_fsdp_qlora/_compat/peft.py, peft_adapter_key_renames): stock peft on the 16-bit base saves the
    shared-expert LoRA and loads it nowhere. When this fails, peft keeps the keys: remove keep_adapter_keys."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    path = build("laguna", tmp_path / "m")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj"], init_lora_weights=False)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
    trained.save_pretrained(tmp_path / "adapter")
    want = {n: p for n, p in _lora(trained).items() if ".shared_experts." in n}
    assert want
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    got = _lora(PeftModel.from_pretrained(base, tmp_path / "adapter"))
    assert all(not torch.equal(got[n], want[n]) for n in want)  # left at their fresh initial values
