"""Mixture of experts: 4-bit experts at load time (hf_fsdp_qlora/experts/quantized.py), their forward, FSDP sharding.

Single process: tiny Qwen3-MoE, Mixtral and gpt-oss (transposed experts with biases) built locally. Oracle: the
family's own 16-bit experts module holding the dequantized weights. Two ranks: a tiny Qwen3-MoE with attention LoRA
trained under FSDP1 and FSDP2 in the suite's shared launches (tests/scripts/train_scenarios.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_trainer_fsdp import _assert_trained_scenario
from tiny_models import MOE_ARCHS, build_tiny_model

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.error_index import find_known_errors, is_certain
from hf_fsdp_qlora.errors import UnsupportedSetupError
from hf_fsdp_qlora.experts.quantized import QuantizedExperts, quantize_experts

# The 2-rank part runs in the suite's shared FSDP1/FSDP2 launches: scenario key -> (tiny model, worker kind).
_SCENARIOS = {
    "moe": ("qwen3_moe", "ours_loader"),
    "moe_lowram": ("qwen3_moe", "lowram"),
    "moe_expertlora": ("qwen3_moe", "expertlora"),  # LoRA on the 4-bit experts too
    "moe_expertcb": ("qwen3_moe", "expertlora_callback"),  # ... trained by a stock Trainer + FSDPQLoRACallback
    "moe_resume": ("qwen3_moe", "expertresume"),  # ... checkpointed at step 2 and resumed
}
# Stock peft's expert LoRA (16-bit experts) under FSDP1, with a stock Trainer: the error-index entry's text.
SHARED_TRAIN_SCENARIOS = {1: {**_SCENARIOS, "moe_stock16": ("qwen3_moe", "stock_expertlora16")}, 2: _SCENARIOS}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ATTENTION, **kw})


@pytest.fixture(scope="module")
def moe_models(shared_models):
    return {arch: build_tiny_model(shared_models / arch, arch) for arch in MOE_ARCHS}


def _load(path, **kw):
    return load_qlora_model(str(path), **{"lora_config": _lora(), "gradient_checkpointing": False, **kw})


def _experts(model, cls=None):
    found = [
        (n, getattr(m, "get_base_layer", lambda m=m: m)())
        for n, m in model.named_modules()
        if n.endswith("mlp.experts")
    ]
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


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@torch.no_grad()
def _copy_lora(src, dst):
    params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        if "lora_" in name:
            params[name].copy_(p)


@pytest.mark.parametrize("compute", ["grouped", "loop"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_lora_equals_peft_on_the_dequantized_base(moe_models, arch, compute, tmp_path):
    """LoRA on 4-bit experts (grouped, and the per-expert loop) vs peft's own LoRA (same LoraConfig) on the 16-bit
    model holding the dequantized expert weights: same adapter keys and shapes, same logits and LoRA gradients
    (fp32: stated tolerance 1e-5)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    config = _lora(target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS, init_lora_weights=False)
    ours = _load(moe_models[arch], lora_config=config, dtype=torch.float32)
    _set_compute(ours, compute)
    stock = _load(moe_models[arch], lora_config=config, dtype=torch.float32, quantize_experts=False)
    _experts(ours, QuantizedExperts)
    ours_sd, stock_sd = get_peft_model_state_dict(ours), get_peft_model_state_dict(stock)
    assert {k: v.shape for k, v in ours_sd.items()} == {k: v.shape for k, v in stock_sd.items()}
    assert sum(".experts." in k for k in ours_sd) == 8  # 2 layers x 2 weights x (lora_A, lora_B)
    with torch.no_grad():  # the oracle: stock's experts hold our dequantized weights, both hold our adapters
        for name, q in _experts(ours, QuantizedExperts):
            s = stock.get_submodule(name).get_base_layer()
            for w in q.layout.weights:
                getattr(s, w).copy_(torch.stack([q.dequantize_expert(w, e) for e in range(q.num_experts)]))
    _copy_lora(ours, stock)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    found = {}
    for name, model in (("ours", ours), ("stock", stock)):
        model.train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad(), model.disable_adapter():
            plain = model(input_ids=ids).logits
        found[name] = out.logits.detach(), grads, plain
    torch.testing.assert_close(found["ours"][0], found["stock"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(found["ours"][2], found["stock"][2], rtol=1e-5, atol=1e-5)
    assert (found["ours"][0] - found["ours"][2]).abs().max() > 1e-3  # the expert adapters do change the output
    assert set(found["ours"][1]) == set(found["stock"][1])
    for name, grad in found["ours"][1].items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, found["stock"][1][name], rtol=1e-4, atol=1e-7)
    # The saved adapter is peft's own: PeftModel.from_pretrained on the 16-bit base loads every tensor.
    ours.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(str(moe_models[arch]), dtype=torch.float32)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, tmp_path / "adapter"))
    assert set(loaded) == set(ours_sd)
    for key, value in ours_sd.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


def test_expert_lora_in_bf16_within_rounding(moe_models):
    """The run's dtype: bf16 logits within one bf16 step of peft's on the dequantized base (stated: 8e-3)."""
    config = _lora(target_parameters=EXPERT_TARGETS, init_lora_weights=False)
    ours = _load(moe_models["qwen3_moe"], lora_config=config)
    stock = _oracle_from(ours, _load(moe_models["qwen3_moe"], lora_config=config, quantize_experts=False))
    _copy_lora(ours, stock)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(input_ids=ids).logits.float() for m in (ours, stock)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=8e-3)
    # Merging into the packed 4-bit experts is refused clearly (the 16-bit model merges as peft does).
    with pytest.raises(UnsupportedSetupError, match="cannot be merged into the packed 4-bit expert weights"):
        ours.merge_and_unload()


def _set_compute(model, compute):
    for _, module in _experts(model, QuantizedExperts):
        module.compute = compute


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach().float(), embeds.grad.float(), grads


# Grouped vs the loop (CPU, torch 2.13), as max |difference| / max |value|. Measured here (top 2): bf16 equal to the
# last bit (logits, input and LoRA gradients); fp32 at most 2.8e-7 (sums met in another order). Grouped adds a
# token's k expert outputs with one rounding (one index_add_, as stock's grouped_mm sums: equal to it), the loop
# rounds after each expert: at top 8 (tests/test_moe_benchmark.py) they differ by a few bf16 steps. Stated: 2**-6
# of the largest value in bf16, 1e-5 in fp32.
GROUPED_TOLERANCE = {torch.bfloat16: {"rtol": 2**-6, "atol": 2**-6}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_grouped_equals_loop_with_expert_lora(moe_models, arch, dtype, monkeypatch):
    """The grouped path (one dequantization and one grouped_mm per projection, LoRA grouped too) against the
    per-expert loop on the same model: logits, input gradients and every LoRA gradient (experts' and attention's)."""
    from hf_fsdp_qlora.experts import grouped as _grouped

    config = _lora(target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS, init_lora_weights=False)
    model = _load(moe_models[arch], lora_config=config, dtype=dtype)
    model.train()
    ran = []
    monkeypatch.setattr(_grouped, "grouped_forward", lambda *a: ran.append(1) or GROUPED_FORWARD(*a))
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    _set_compute(model, "loop")
    loop = _forward_backward(model, ids)
    assert not ran
    _set_compute(model, "grouped")
    grouped = _forward_backward(model, ids)
    assert len(ran) == 2  # both layers' experts ran grouped
    tolerance = GROUPED_TOLERANCE[dtype]
    scale = {"logits": loop[0].abs().max(), "input grad": loop[1].abs().max()}
    for i, what in enumerate(scale):
        torch.testing.assert_close(grouped[i] / scale[what], loop[i] / scale[what], **tolerance, msg=what)
    assert set(grouped[2]) == set(loop[2]) and sum(".experts." in n for n in loop[2]) == 8  # 2 layers x 2 x (A, B)
    worst = {what: float(((grouped[i] - loop[i]).abs().max() / scale[what])) for i, what in enumerate(scale)}
    worst["lora grads"] = max(float((grouped[2][n] - g).abs().max() / g.abs().max()) for n, g in loop[2].items())
    print(f"{arch} {dtype}: grouped vs loop, max |difference| / max |value|: {worst}")
    for name, grad in loop[2].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grouped[2][name] / grad.abs().max(), grad / grad.abs().max(), **tolerance, msg=name)


GROUPED_FORWARD = None


@pytest.fixture(autouse=True, scope="module")
def _grouped_forward():
    global GROUPED_FORWARD
    from hf_fsdp_qlora.experts import grouped as _grouped

    GROUPED_FORWARD = _grouped.grouped_forward


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "nodq"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routed_experts_dequantize_in_one_step(moe_models, arch, double_quant, monkeypatch):
    """One bitsandbytes call per weight for the routed experts, bit for bit the per-expert dequantization. Where an
    expert's weight does not fill whole (nested) blocks each expert fills its slice instead: counted here."""
    import bitsandbytes.functional as bnbf

    from hf_fsdp_qlora.experts.grouped import dequantize_routed

    model = load_qlora_model(str(moe_models[arch]), lora_config=None, double_quant=double_quant)
    (_, module), *_ = _experts(model, QuantizedExperts)
    calls = []
    original = bnbf.dequantize_4bit
    monkeypatch.setattr(bnbf, "dequantize_4bit", lambda *a, **k: calls.append(1) or original(*a, **k))
    for routed in (torch.tensor([0, 3, 4, 7]), torch.arange(module.num_experts)):  # some; all (the rows as stored)
        for name in module.layout.weights:
            shape, blocksize, nested = module.quant_meta(name)
            numel = math.prod(shape)
            one_step = numel % blocksize == 0 and (nested is None or numel // blocksize % nested == 0)
            calls.clear()
            together = dequantize_routed(module, name, routed)
            assert len(calls) == (1 if one_step else len(routed)), (name, shape, calls)
            alone = torch.stack([module.dequantize_expert(name, e) for e in routed.tolist()])
            assert together.dtype == module.dtype and torch.equal(together, alone), name


def test_grouped_falls_back_to_the_loop_and_says_so(moe_models, monkeypatch, caplog):
    """Without grouped_mm (older torch) or on a dtype/device it does not run, the loop runs and one line says why;
    compute='grouped' then is a clear error."""
    import logging

    from hf_fsdp_qlora.experts import grouped as _grouped

    model = _load(moe_models["qwen3_moe"])
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    monkeypatch.setattr(_grouped, "grouped_mm_function", lambda: None)
    monkeypatch.setattr(_grouped, "_logged", set())
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"), torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=2**-7, atol=2**-7)
    said = [r.getMessage() for r in caplog.records if "4-bit experts" in r.getMessage()]
    assert said == ["hf_fsdp_qlora: 4-bit experts (Qwen3MoeExperts) compute one routed expert at a time: torch "
                    f"{torch.__version__} has no grouped_mm"], said  # fmt: skip
    _set_compute(model, "grouped")
    with pytest.raises(UnsupportedSetupError, match="cannot compute grouped: torch .* has no grouped_mm"):
        model(input_ids=ids)
    monkeypatch.undo()
    (_, module), *_ = _experts(model, QuantizedExperts)
    for dtype, device, reason in [(torch.float64, "cpu", "not known to run torch.float64 on cpu"),
                                  (torch.bfloat16, "meta", "not known to run torch.bfloat16 on meta")]:  # fmt: skip
        monkeypatch.setattr(module, "dtype", dtype)
        assert reason in _grouped.unavailable_reason(module, torch.device(device))


@pytest.mark.parametrize(
    ("targets", "match"),
    [
        (["mlp.experts.up_proj"], r"'mlp.experts.up_proj' matches no parameter.*mlp.experts.gate_up_proj"),
        (["mlp.experts.gate_up_proj_4bit"], r"packed 4-bit bytes.*target_parameters=\['mlp.experts.gate_up_proj'\]"),
    ],
)
def test_bad_expert_targets_are_clear_errors(moe_models, targets, match):
    config = _lora(target_parameters=["mlp.experts.down_proj", *targets])
    with pytest.raises(UnsupportedSetupError, match=match):
        _load(moe_models["qwen3_moe"], lora_config=config)


def test_unknown_expert_layout_is_a_clear_error():
    class OddExperts(torch.nn.Module):  # 3-D expert weights, no declared layout, no named entry
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.zeros(4, 8, 8))

    model = torch.nn.Sequential(OddExperts())
    with pytest.raises(UnsupportedSetupError, match=r"OddExperts at '0' .*w_in \[4, 8, 8\].*quantize_experts=False"):
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
    # ... and equal to today's path in one process (from_pretrained with 16-bit experts, then packed): the experts
    # were streamed from the files (with low_cpu_ram: by rank 0, rank 1 received the packed bytes) to the same bits.
    assert r0["expert_digest_before_wrap"] == _todays_expert_digest(moe_models["qwen3_moe"])
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


def _todays_expert_digest(path) -> str:
    """sha256 of the packed expert bytes, sorted by name, as tests/scripts/train_scenarios.py's expert_digest hashes
    them, of the load before streaming: from_pretrained (every expert 16-bit) + quantize_experts."""
    import hashlib

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=torch.bfloat16)
    quantize_experts(model, dtype=torch.bfloat16)
    packed = {n: p for n, p in model.named_parameters() if n.endswith("_proj_4bit")}
    sha = hashlib.sha256()
    for name in sorted(packed):
        sha.update(packed[name].detach().clone().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


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


def test_stock_peft_param_wrapper_contract(moe_models, monkeypatch):
    """Canary (hf_fsdp_qlora/_compat/peft.py `peft_expert_param_wrapper`): what experts/lora.py relies on in stock peft.

    peft matches `target_parameters` against registered parameters only (a 4-bit experts module without our
    stand-ins matches nothing), its wrapper is a class named ParamWrapper whose forward adapts the weight through
    parametrize, and its factors are lora_A [r*E, in] and lora_B [out, r*E]."""
    import inspect

    from peft import get_peft_model
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTuner

    model = load_qlora_model(str(moe_models["qwen3_moe"]), lora_config=None, gradient_checkpointing=False).unload()
    # Stock peft: without the injection hook that 4-bit experts install (experts/lora.py peft_adapts_4bit_experts).
    monkeypatch.setattr(BaseTuner, "inject_adapter", inspect.unwrap(BaseTuner.inject_adapter))
    with pytest.raises(ValueError, match="no `target_parameters` found|no parameter was matched"):
        get_peft_model(model, _lora(target_modules=[], target_parameters=EXPERT_TARGETS))
    assert "register_parametrization" in inspect.getsource(ParamWrapper._activate_lora)
    assert "_activate_lora" in inspect.getsource(ParamWrapper.forward)
    stock = _load(moe_models["qwen3_moe"], lora_config=_lora(target_parameters=EXPERT_TARGETS), quantize_experts=False)
    (_, experts), *_ = _experts(stock)
    wrapper = stock.get_submodule("base_model.model.model.layers.0.mlp.experts")
    # Nesting order, not the key, names the weight: the outer wrapper adapts down_proj, its base_layer gate_up_proj.
    assert type(wrapper).__name__ == "ParamWrapper" and wrapper.parameter_name == "down_proj"
    assert wrapper.base_layer.parameter_name == "gate_up_proj"
    num, out, inp = experts.down_proj.shape
    assert wrapper.lora_A["default"].weight.shape == (4 * num, inp)
    assert wrapper.lora_B["default"].weight.shape == (out, 4 * num)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["moe_expertlora", "moe_expertcb"])  # FSDPQLoRATrainer; stock Trainer + callback
@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_trains_lora_on_4bit_experts(moe_models, shared_launch, version, name):
    """LoRA on the 4-bit experts under FSDP1 (stock peft fails there: "shape '[8, -1, 2048]' is invalid") and FSDP2:
    FSDP engaged, experts 4-bit and sharded, step-0 loss and logits equal the single-process run on the same global
    batch (loss rel 1e-6, logits 1e-5), the expert adapters trained and saved in peft's format (equal to the
    gathered weights)."""
    import train_scenarios as worker
    from test_trainer_fsdp import _assert_adapter_equals

    models, out, results, _ = shared_launch(version)
    r0, r1 = results[0][name], results[1][name]
    for r in (r0, r1):
        assert r.get("ok"), r.get("traceback")
        assert r["distributed_type"] == "DistributedType.FSDP"
        engaged = r["engagement"]
        assert engaged["flat_params"] > 0 if version == 1 else engaged["dtensor_params"] > 0, engaged
        assert r["frozen_dtypes_before_wrap"] == ["torch.bfloat16"]
        assert r["trainable_dtypes_before_wrap"] == ["torch.float32"]  # float32 master weights (train/precision.py)
    assert r0["init_checksum"] == r1["init_checksum"]
    full, local = r0["expert_bytes_before_wrap"], [r0["expert_bytes_local"], r1["expert_bytes_local"]]
    assert sum(local) == full and all(0 < b < full for b in local), local
    assert r0["expert_digest_after_training"] == r0["expert_digest_before_wrap"] is not None
    weights = torch.load(out / name / "weights.pt")
    experts_lora = [k for k in weights["init"] if ".experts." in k]
    assert len(experts_lora) == 8, sorted(weights["init"])[:10]  # 2 layers x 2 weights x (lora_A, lora_B)
    model = load_qlora_model(
        str(models / "qwen3_moe"), lora_config=worker.expert_lora_config(), gradient_checkpointing=False
    )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in weights["init"].items():
            params[key].copy_(value.to(params[key].dtype))
    model.train()
    for rank, chunk in enumerate(torch.tensor(r0["first_batch"]).split(worker.BATCH)):
        out_ = model(input_ids=chunk, labels=chunk, attention_mask=torch.ones_like(chunk))
        assert r0["step0_losses"][rank] == pytest.approx(float(out_.loss), rel=1e-6)
        logits = torch.load(out / name / f"logits_rank{rank}.pt")
        torch.testing.assert_close(logits, out_.logits.detach().float(), rtol=1e-5, atol=1e-5)
    moved = [k for k in experts_lora if "lora_B" in k and weights["trained"][k].abs().sum() > 0]
    assert len(moved) == 4, moved  # every expert lora_B left zero: the expert adapters trained
    _assert_adapter_equals(out / name / "adapter", weights, models / "qwen3_moe")


def test_launcher_switch_quantizes_experts_before_peft(moe_models, monkeypatch):
    """`-m hf_fsdp_qlora.run`'s hooks: a 4-bit from_pretrained (as trl's --load_in_4bit does) streams the experts into
    4 bits before it returns (hf_fsdp_qlora/experts/script_stream.py); a load the stream cannot follow keeps them
    16-bit and get_peft_model quantizes them, before FSDP; HF_FSDP_QLORA_QUANTIZE_EXPERTS=0 leaves them 16-bit."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTuner
    from train_scenarios import bnb_config
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from hf_fsdp_qlora.experts.lora import quantize_experts_before_peft
    from hf_fsdp_qlora.train.launcher import QUANTIZE_EXPERTS_ENV, quantize_experts_from_env

    assert quantize_experts_from_env({}) and quantize_experts_from_env({QUANTIZE_EXPERTS_ENV: "1"})
    assert not any(quantize_experts_from_env({QUANTIZE_EXPERTS_ENV: v}) for v in ("0", " False ", "no"))

    # Both hooks are restored after the test (monkeypatch keeps the classmethod itself for a class attribute).
    monkeypatch.setattr(BaseTuner, "inject_adapter", BaseTuner.inject_adapter)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", PreTrainedModel.__dict__["from_pretrained"])
    config = _lora(target_modules=["q_proj"], target_parameters=EXPERT_TARGETS)
    path = str(moe_models["qwen3_moe"])
    found = {}
    for quantize, extra in ((True, {}), (True, {"use_safetensors": True}), (False, {})):
        quantize_experts_before_peft(QUANTIZE_EXPERTS_ENV, quantize=quantize)
        base = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(), dtype=torch.bfloat16,
                                                    **extra)  # fmt: skip
        loaded = {type(m).__name__ for _, m in _experts(base)}
        model = get_peft_model(base, config)
        found[(quantize, *extra)] = (loaded, {type(m).__name__ for _, m in _experts(model)})
        ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert found == {
        (True,): ({"QuantizedExperts"}, {"QuantizedExperts"}),  # streamed by from_pretrained
        (True, "use_safetensors"): (
            {"Qwen3MoeExperts"},
            {"QuantizedExperts"},
        ),  # not followed: packed by the peft hook
        (False,): ({"Qwen3MoeExperts"}, {"Qwen3MoeExperts"}),
    }, found
    with pytest.raises(UnsupportedSetupError, match="'mlp.experts.w1' matches no parameter"):
        get_peft_model(AutoModelForCausalLM.from_pretrained(path), _lora(target_parameters=["mlp.experts.w1"]))


@pytest.mark.distributed
def test_trl_sft_script_trains_lora_on_4bit_experts(moe_models, tmp_path):
    """The issue's goal: trl's sft.py, unchanged, `--use_peft --load_in_4bit --lora_dropout 0
    --lora_target_parameters ...` on a Qwen3-MoE checkpoint, through `-m hf_fsdp_qlora.run` under FSDP1 and FSDP2:
    FSDP engaged, the experts streamed from the shards into 4 bits by trl's own from_pretrained (never 16-bit) and
    sharded, computed grouped, the adapter trained, in peft's own format, and merged by merge-adapters equal to peft.
    The ranks are forked with the launch's environment (dist_utils.launch_via_run): the real `accelerate launch -m
    hf_fsdp_qlora.run` of trl's sft.py is test_recipes' to prove (and test_readme's); what is MoE's here runs in the
    ranks, the same either way (~15 CPU-s of launcher and rank imports spared per launch)."""
    import json
    import re
    import shutil

    import trl.scripts.sft
    from dist_utils import check, launch_via_run
    from peft import PeftModel, get_peft_model_state_dict
    from recipe_fixtures import build_chat_dataset, build_recipe_model
    from test_merge_moe import _assert_equals_peft
    from test_recipes import _adapter, _script_args
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    model = shutil.copytree(moe_models["qwen3_moe"], tmp_path / "qwen3_moe")
    AutoTokenizer.from_pretrained(build_recipe_model(tmp_path / "recipe")).save_pretrained(model)
    data = build_chat_dataset(tmp_path / "chat", n_train=8, n_test=2)
    lora = ["--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj", "--lora_target_parameters"]
    for version in (1, 2):
        out = tmp_path / f"sft_fsdp{version}"
        args = _script_args(
            model, data, out, *lora, *EXPERT_TARGETS, "--max_steps", "2"
        )  # eval + checkpoint at step 2
        proc = launch_via_run(f"cpu_fsdp{version}_rehearsal.yaml", trl.scripts.sft.__file__, *args)
        check(proc)
        text = proc.stdout + proc.stderr
        assert f"FSDP{version} engaged on 2 rank(s)" in text
        held = [tuple(map(int, m)) for m in re.findall(r"4-bit experts: this rank holds (\d+) of (\d+) packed", text)]
        assert len(held) == 1, text[-3000:]  # rank 0's line: it holds a part of the packed expert bytes
        assert 0 < held[0][0] < held[0][1] and (version == 1 or held[0][0] * 2 == held[0][1]), held
        # trl's own from_pretrained never held the 16-bit experts: transformers left them unread and they streamed
        # from the shards into 4 bits (the peft hook's 16-bit packing, "quantized the experts ...", never ran) ...
        assert "Qwen3MoeForCausalLM.from_pretrained leaves the experts of 2 MoE layers unread" in text, text[-3000:]
        assert text.count("streamed the experts of 2 MoE layers from the checkpoint into 4 bits (nf4)") == 1
        assert "quantized the experts of 2 MoE layers" not in text and "load in 16 bits before" not in text
        # ... and the routed experts computed grouped (said once per process; INFO lines come from rank 0).
        assert text.count("4-bit experts (Qwen3MoeExperts) compute grouped") == 1, text[-3000:]
        assert "compute one routed expert at a time" not in text
        log = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
        assert any("eval_loss" in e for e in log), log  # trl's defaults: evaluation and checkpoints on
        adapter = _adapter(out)
        experts = {k: v for k, v in adapter.items() if ".experts." in k}
        assert len(experts) == 8 and all(v.abs().sum() > 0 for k, v in experts.items() if "lora_B" in k)
        # peft's own format: PeftModel.from_pretrained on the 16-bit base loads every tensor as saved.
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model)), str(out))
        state = get_peft_model_state_dict(loaded)
        assert set(state) == set(adapter)
        assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in adapter.items())
    # ... and merges with merge-adapters into the 16-bit base equal to peft's merge_and_unload (bit-equal to peft's
    # float32 merge rounded once to bf16; within two bf16 roundings of peft's bf16 merge).
    merged = merge_adapters(model, out, tmp_path / "merged", progress=False)
    _assert_equals_peft(model, out, merged, ["experts.gate_up_proj", "experts.down_proj", "q_proj.weight"])


@pytest.mark.distributed
def test_stock_peft_expert_lora_fails_under_fsdp1(shared_launch):
    """Upstream alone (peft's expert LoRA on 16-bit experts, a stock Trainer) under FSDP1: peft reshapes lora_A.weight
    while it is a flat shard. If this starts passing, upstream fixed it: see hf_fsdp_qlora/_compat/peft.py
    `peft_expert_param_wrapper` (our 4-bit experts read the adapters inside their own units)."""
    _, _, results, _ = shared_launch(1)
    for rank in (0, 1):
        stock = results[rank]["moe_stock16"]
        assert not stock["ok"]
        assert re.fullmatch(r"shape '\[8, -1, \d+\]' is invalid for input of size \d+", stock["error"]), stock["error"]
        assert stock["error_type"] == "RuntimeError" and "get_delta_" in stock["traceback"], stock["traceback"]
    # `hf-fsdp-qlora explain` names it, certain of the cause from peft's frames in the real traceback.
    log = stock["traceback"] + f"RuntimeError: {stock['error']}"
    found = [e for e in find_known_errors(log) if is_certain(e, log)]
    assert [e.id for e in found] == ["expert-lora-fsdp1-reshape"], found


@pytest.mark.distributed
@pytest.mark.parametrize("version", [1, 2])
def test_expert_lora_checkpoint_resumes_exactly(shared_launch, version):
    """4 steps == 2 steps + checkpoint + resume + 2 steps, bit for bit (losses and every adapter, experts' too);
    the checkpoint holds the whole expert adapters gathered from both ranks, in peft's format."""
    from safetensors.torch import load_file

    _, out, results, _ = shared_launch(version)
    r0 = results[0]["moe_resume"]
    assert r0.get("ok") and results[1]["moe_resume"].get("ok"), r0.get("traceback")
    assert len(r0["A_losses"]) == 4 and r0["B_losses"] == r0["A_losses"][2:], (r0["A_losses"], r0["B_losses"])
    weights = torch.load(out / "moe_resume" / "weights.pt")
    assert set(weights["A"]) == set(weights["B"]) and sum(".experts." in k for k in weights["A"]) == 8
    for key, value in weights["A"].items():
        torch.testing.assert_close(weights["B"][key], value, rtol=0, atol=0)
    saved = load_file(str(out / "moe_resume" / "A" / "checkpoint-2" / "adapter_model.safetensors"))
    experts = {k: v.shape for k, v in saved.items() if ".experts." in k}
    assert len(experts) == 8, sorted(saved)
    trained = {k.replace(".default", ""): v.shape for k, v in weights["A"].items() if ".experts." in k}
    assert {k.removeprefix("base_model.model."): s for k, s in experts.items()} == {
        k.removeprefix("base_model.model."): s for k, s in trained.items()
    }  # whole [r*E, in] / [out, r*E] tensors, not one rank's shard
