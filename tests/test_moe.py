"""Mixture of experts: 4-bit experts at load time (hf_fsdp_qlora/loading/experts.py), their forward, FSDP sharding.

Single process: tiny Qwen3-MoE, Mixtral and gpt-oss (transposed experts with biases) built locally. Oracle: the
family's own 16-bit experts module holding the dequantized weights. Two ranks: a tiny Qwen3-MoE with attention LoRA
trained under FSDP1 and FSDP2 in the suite's shared launches (tests/scripts/train_scenarios.py).
"""

from __future__ import annotations

import pytest
import torch
from test_trainer_fsdp import _assert_trained_scenario
from tiny_models import MOE_ARCHS, build_tiny_model

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.errors import UnsupportedSetupError
from hf_fsdp_qlora.loading.experts import QuantizedExperts, quantize_experts

# The 2-rank part runs in the suite's shared FSDP1/FSDP2 launches: scenario key -> (tiny model, worker kind).
_SCENARIOS = {"moe": ("qwen3_moe", "ours_loader"), "moe_lowram": ("qwen3_moe", "lowram")}
SHARED_TRAIN_SCENARIOS = {1: _SCENARIOS, 2: _SCENARIOS}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ATTENTION, **kw})


@pytest.fixture(scope="module")
def moe_models(shared_models):
    return {arch: build_tiny_model(shared_models / arch, arch) for arch in MOE_ARCHS}


def _load(path, **kw):
    return load_qlora_model(str(path), lora_config=_lora(), gradient_checkpointing=False, **kw)


def _experts(model, cls=None):
    found = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert found and (cls is None or all(isinstance(m, cls) for _, m in found)), [type(m) for _, m in found]
    return found


def _bytes(module):
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def _oracle_from(quantized, stock):
    """`stock` (the 16-bit load) with every expert weight replaced by the 4-bit model's dequantized weight."""
    for (_, q), (_, s) in zip(_experts(quantized, QuantizedExperts), _experts(stock)):
        for name in q.layout.weights:
            weight = torch.stack([q.dequantize_expert(name, e) for e in range(q.num_experts)])
            assert weight.shape == getattr(s, name).shape
            getattr(s, name).copy_(weight)
        for name in q.layout.biases:
            torch.testing.assert_close(getattr(s, name), getattr(q, name), rtol=0, atol=0)
    return stock


def _set_experts_impl(model, impl):
    for _, module in _experts(model):
        module.config._experts_implementation = impl


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_4bit_bytes_and_opt_out(moe_models, arch):
    ours = _load(moe_models[arch])
    stock = _load(moe_models[arch], quantize_experts=False)  # opt-out: the family's own 16-bit experts
    q_experts, s_experts = _experts(ours, QuantizedExperts), _experts(stock)
    assert not any(isinstance(m, QuantizedExperts) for _, m in s_experts)
    assert {p.dtype for _, m in s_experts for p in m.parameters()} == {torch.bfloat16}
    assert all(p.dim() == 3 for _, m in s_experts for p in m.parameters() if p.dim() > 2)
    # Packed bytes are a frozen parameter in the one storage dtype (FSDP flattens/shards it), quant states buffers.
    for _, m in q_experts:
        packed = [p for n, p in m.named_parameters() if n.endswith("_4bit")]
        assert len(packed) == 2 and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in packed)
        assert all(p.shape[0] == m.num_experts for p in packed)
    # Every byte the experts hold (packed weights, absmax, nested absmax, codes, 16-bit biases) against bf16.
    ratio = sum(_bytes(m) for _, m in s_experts) / sum(_bytes(m) for _, m in q_experts)
    print(f"{arch}: expert bytes bf16 / 4-bit = {ratio:.2f}")
    assert ratio >= 3.5, ratio
    # Dequantized weights are the model's weights up to NF4 rounding (not garbage): mean relative error.
    oracle = _oracle_from(ours, _load(moe_models[arch], quantize_experts=False))
    for (_, o), (_, s) in zip(_experts(oracle), s_experts):
        err = (o.gate_up_proj.float() - s.gate_up_proj.float()).abs().mean() / s.gate_up_proj.float().abs().mean()
        assert 0 < err < 0.15, err


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_forward_and_gradients_match_dequantized_oracle(moe_models, arch):
    ours = _load(moe_models[arch])
    oracle = _oracle_from(ours, _load(moe_models[arch], quantize_experts=False))
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, 16))
    outputs = {}
    for name, model, impl in [("ours", ours, None), ("eager", oracle, "eager"), ("grouped", oracle, "grouped_mm")]:
        if impl:
            _set_experts_impl(model, impl)
        model.train()
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = model(inputs_embeds=embeds, labels=ids)
        out.loss.backward()
        outputs[name] = (out.logits.detach().float(), float(out.loss.detach()), embeds.grad.float())
        if name == "ours":  # the base stays frozen; LoRA gets gradients
            assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
            lora_grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
            assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
        model.zero_grad(set_to_none=True)
    logits, loss, grad = outputs["ours"]
    assert grad.abs().sum() > 0
    # Same math as the family's eager experts on the dequantized weights: equal to the last bit.
    torch.testing.assert_close(logits, outputs["eager"][0], rtol=0, atol=0)
    torch.testing.assert_close(grad, outputs["eager"][2], rtol=0, atol=0)
    # transformers' default grouped_mm sums in another order: bf16 rounding only (stated tolerance 2e-2).
    torch.testing.assert_close(logits, outputs["grouped"][0], rtol=2e-2, atol=2e-2)
    assert loss == pytest.approx(outputs["grouped"][1], rel=1e-3)


def test_expert_lora_is_refused_clearly(moe_models):
    config = _lora(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with pytest.raises(UnsupportedSetupError, match="not supported on 4-bit experts yet.*quantize_experts=False"):
        load_qlora_model(str(moe_models["qwen3_moe"]), lora_config=config, gradient_checkpointing=False)


def test_unknown_expert_layout_is_a_clear_error():
    class OddExperts(torch.nn.Module):  # 3-D expert weights in a layout not in EXPERT_LAYOUTS
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.zeros(4, 8, 8))

    model = torch.nn.Sequential(OddExperts())
    with pytest.raises(UnsupportedSetupError, match=r"OddExperts at '0' .*\['w_in'\].*quantize_experts=False"):
        quantize_experts(model)
    assert isinstance(model[0].w_in, torch.nn.Parameter) and model[0].w_in.dim() == 3


# --- two ranks: FSDP1 and FSDP2 (the suite's shared launches) ---------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("name", ["moe", "moe_lowram"])  # load_qlora_model(), and with low_cpu_ram=True
def test_fsdp_shards_4bit_experts_and_trains(moe_models, shared_launch, version, name):
    models, out, results, _ = shared_launch(version)
    r0, r1 = results[0][name], results[1][name]
    # FSDP engaged, one dtype per unit, equal start, step-0 loss/logits equal the single-process run on the same
    # global batch (rel 1e-6, logits 1e-5), adapter saved in peft's format and equal to the trained weights.
    _assert_trained_scenario(name, results, out, models, version, "qwen3_moe")
    # The packed expert bytes came through wrapping and training bit for bit (never cast), equal on both ranks.
    assert r0["expert_digest_before_wrap"] == r1["expert_digest_before_wrap"] is not None
    assert r0["expert_digest_after_training"] == r1["expert_digest_after_training"] == r0["expert_digest_before_wrap"]
    full = r0["expert_bytes_before_wrap"]
    assert full > 0 and r1["expert_bytes_before_wrap"] == full
    # Sharded, not replicated: each rank holds a part of the packed expert bytes, together exactly all of them.
    local = [r0["expert_bytes_local"], r1["expert_bytes_local"]]
    print(f"FSDP{version} {name}: expert bytes per rank {local} of {full}")
    assert sum(local) == full and all(0 < b < full for b in local), local
    if version == 2:  # sharded on the expert dimension: exactly half each
        assert local == [full // 2, full // 2] and r0["expert_bytes_dtensor"] == local[0]
    else:  # FSDP1 halves each layer's FlatParameter (attention + experts + norms); the cut falls inside the experts
        assert all(0.4 * full <= b <= 0.6 * full for b in local), local


def test_router_aux_loss_kept_by_the_chunked_loss(moe_models, tmp_path):
    """output_router_logits=True: our chunked loss adds the router's load-balancing loss as transformers' does."""
    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments

    model = _load(moe_models["qwen3_moe"])
    model.config.output_router_logits = True
    model.train()
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    losses = {}
    for chunked in (False, True):
        args = FSDPQLoRATrainingArguments(
            output_dir=str(tmp_path / f"c{chunked}"), use_cpu=True, report_to=[], chunked_loss=chunked,
            check_distinct_batches=0, log_memory_throughput=False,
        )  # fmt: skip
        trainer = FSDPQLoRATrainer(model=model, args=args)
        for num_items in (None, torch.tensor(37)):
            losses[chunked, num_items is None] = trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items)
    aux = model(**batch).aux_loss
    assert float(aux.detach()) > 0
    for by_mean in (True, False):
        torch.testing.assert_close(losses[True, by_mean], losses[False, by_mean], rtol=1e-5, atol=1e-6)
