"""Evaluation must not change training (issue 12 item 1).

bitsandbytes repacks a ``Linear4bit`` weight in place for its CPU kernel at the first no-grad eval forward
on CPUs with AVX512-BF16 (see hf_fsdp_qlora/_bnb_cpu.py). Single process here: gradients still reach every
adapter after an evaluate(), and a model repacked before it reached us is restored. The 2-rank FSDP1/FSDP2
check (losses with eval_steps=1 equal losses without eval) is in test_semantics_dist.py.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", "llama")


def _has_avx512bf16() -> bool:
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def _batch():
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def _repacked(model) -> int:
    return sum(
        bool(getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False)) for p in model.parameters()
    )


def _lora_grads(model, batch):
    model.train()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_gradients_reach_4bit_adapters_after_evaluate(llama, tmp_path):
    """After trainer.evaluate(), every adapter's gradient equals that of a model that never evaluated."""
    from transformers import TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRATrainer, load_qlora_model
    from hf_fsdp_qlora.loading.qlora import default_lora_config

    batch = _batch()
    config = default_lora_config(lora_dropout=0.0)  # no randomness: gradients compare bit for bit
    torch.manual_seed(0)
    untouched = load_qlora_model(str(llama), gradient_checkpointing=False, lora_config=config)
    torch.manual_seed(0)
    model = load_qlora_model(str(llama), gradient_checkpointing=False, lora_config=config)
    data = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    packed = {
        n: p.detach().view(torch.uint8).clone()
        for n, p in model.named_parameters()
        if type(p).__name__ == "Params4bit"
    }
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0
    assert _repacked(model) == 0
    for name, param in model.named_parameters():  # the packed bytes are untouched
        if name in packed:
            assert torch.equal(param.detach().view(torch.uint8), packed[name]), name
    expected, got = _lora_grads(untouched, batch), _lora_grads(model, batch)
    assert set(got) == set(expected) and len(got) == 28  # lora_A and lora_B of the 14 4-bit layers
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), (name, (got[name] - grad).abs().max())
    # lora_B starts at zero, so lora_A's first gradient is zero; every lora_B gradient is not (with the
    # repack, 10 of the 14 were zero too).
    assert all(g.abs().sum() > 0 for n, g in got.items() if "lora_B" in n)


def test_model_repacked_before_loading_is_restored(llama):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp_qlora._bnb_cpu import disable_cpu_repack_in_model

    if not _has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(llama), quantization_config=config, dtype=torch.bfloat16)
    ids = _batch()["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    for module in model.modules():  # as a model built before hf_fsdp_qlora was imported
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = True
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert _repacked(model) > 0
    restored = disable_cpu_repack_in_model(model)
    assert restored > 0 and _repacked(model) == 0
    with torch.no_grad():
        model(input_ids=ids)  # would repack again if the switch were still on
    assert _repacked(model) == 0
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, expected, atol=0.05)


def test_upstream_bitsandbytes_still_repacks():
    """Fails when bitsandbytes stops repacking in place: then hf_fsdp_qlora/_bnb_cpu.py can go."""
    import bitsandbytes as bnb

    if not _has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")  # quantizes
    import hf_fsdp_qlora  # noqa: F401  (installs the prevention for layers built from now on)

    layer.support_avx512bf16_for_cpu = True  # bitsandbytes' own default on this CPU
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    assert layer.weight.quant_state.packing_format_for_cpu is True
    fresh = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    assert fresh.support_avx512bf16_for_cpu is False
