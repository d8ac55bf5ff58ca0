"""Float32 master weights (hf_fsdp_qlora.train.precision): adapters learn under FSDP1 and FSDP2 as under stock peft.

Scenarios (tests/scripts/precision_scenarios.py) run in the suite's shared launches (2 ranks, gloo, the shipped CPU
rehearsal configs): the tiny Llama, NF4, LoRA r=4 on q/v, 8 steps in bf16 at a constant learning rate, through our
trainer and through a stock Trainer + FSDPQLoRACallback. The oracle is stock peft in one process (fp32 adapters,
``autocast_adapter_dtype=True``, ``Trainer(bf16=True)``) from the same adapters on the same micro-batches (2 per
step, gradient accumulation 2 = 2 ranks x 1).

Measured on this machine: the update of every lora_A / lora_B equals the oracle's bit for bit (relative difference
0.0) under FSDP1 and FSDP2, at lr 1e-5 and 2e-4. With bf16 adapters (today's behaviour, ``adapter_dtype="bfloat16"``)
lora_A's update differed by 0.986 (1e-5) / 0.75 (2e-4) and as few as 1.2% of a tensor's elements moved. Against
one micro-batch of 4 instead of 2 x 2 the stock run itself differs by 0.060 (the floor any batch split adds).

FSDP's own activation checkpointing (``fsdp_activation_checkpointing: true``) must recompute each layer with the
forward's dropout masks: with ``lora_dropout=0.1`` the first step's LoRA gradients with it on equal those with it
off bit for bit (measured 0.0); accelerate 1.15's FSDP2 wrappers (``preserve_rng_state=False``) gave gradients that
differed by up to 2.65x their norm (median 1.2x over the 28 LoRA tensors) while the loss was the same.

The third route, trl's own ``sft.py`` through ``-m hf_fsdp_qlora.run`` (trl's defaults, ``--dtype bfloat16``, LoRA
r=16), is tests/test_precision_trl.py's: its update equals trl's SFTTrainer with stock peft's fp32 adapters on the
recorded micro-batches bit for bit too (0.0 under FSDP1 and FSDP2, at 1e-5 and 2e-4).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import SCRIPTS
from tiny_models import build_tiny_model

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[1]

# Relative difference of an update from the oracle's: measured 0.0 (bit-equal); this leaves room for a reordered
# reduction on another machine, and stays far below bf16 adapters' 0.75-0.99.
TOL = 1e-3
MOVED = 0.99  # fraction of each lora_A tensor's elements that must change (bf16 adapters at 1e-5: 1.2% in one)

_COMMON = {
    "prec_ours_lo": ("llama", "precision_ours_float32_1e-5"),
    "prec_ours_hi": ("llama", "precision_ours_float32_2e-4"),
    "prec_cb_lo": ("llama", "precision_callback_float32_1e-5"),
    "prec_cb_hi": ("llama", "precision_callback_float32_2e-4"),
    # gradient accumulation 2 on each rank (the same micro-batches in STEPS / 2 steps), bf16 on and off (issue 49)
    "prec_ours_hi_ga2bf16": ("llama", "precision_ours_float32_2e-4_ga2_bf16"),
    "prec_ours_hi_ga2fp32": ("llama", "precision_ours_float32_2e-4_ga2_fp32"),
    "prec_ours_hi_fp32": ("llama", "precision_ours_float32_2e-4_fp32"),
}
SHARED_TRAIN_SCENARIOS = {
    # FSDP1's opt-out: what the masters really are where accelerate upcasts trainable FlatParameters (the doctor's plan)
    1: {**{f"{k}_1": v for k, v in _COMMON.items()}, "prec_bf16_lo_1": ("llama", "precision_ours_bfloat16_1e-5")},
    # the opt-out, once: pure bf16 adapters lose the small updates (so the comparison above can fail)
    2: {
        **{f"{k}_2": v for k, v in _COMMON.items()},
        "prec_bf16_lo_2": ("llama", "precision_ours_bfloat16_1e-5"),
        # FSDP's activation checkpointing with LoRA dropout: one step with it on and off (tests/scripts/ac_rng_scenarios)
        "acrng_on_2": ("llama", "acrng_on"),
        "acrng_off_2": ("llama", "acrng_off"),
    },
}


@pytest.fixture(scope="module")
def models(shared_models):
    build_tiny_model(shared_models / "llama", "llama")
    return shared_models


def _stock_peft(model_dir, init, lr, tmp_path, accumulation=1, bf16=True):
    """One process, stock peft (fp32 adapters) and a stock Trainer(bf16=bf16): the oracle. `accumulation`: the runs'
    gradient accumulation on each rank (the oracle accumulates both ranks' micro-batches: 2 x that)."""
    import precision_scenarios as scenarios
    from accelerate.state import AcceleratorState, GradientState
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16)
    model = get_peft_model(base, scenarios.lora_config())
    params = dict(model.named_parameters())
    assert {params[n].dtype for n in init} == {torch.float32}, "stock peft's adapters are fp32"
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=scenarios.BATCH,
        gradient_accumulation_steps=2 * accumulation, max_steps=scenarios.STEPS // accumulation, learning_rate=lr,
        lr_scheduler_type="constant", train_sampling_strategy="sequential", bf16=bf16, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1,
    )  # fmt: skip
    try:
        Trainer(model=model, args=args, train_dataset=scenarios.OrderedTokens()).train()
    finally:
        AcceleratorState._reset_state()
        GradientState._reset_state()
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def launches(models, shared_launch):
    return {version: shared_launch(version) for version in (1, 2)}


@pytest.fixture(scope="module")
def oracle(models, launches, tmp_path_factory):
    """`get(lr, accumulation, bf16)`: stock peft's (initial, trained) adapters, from the adapters the 2-rank runs
    started from, once per distinct setting."""
    _, out, _, _ = launches[2]
    init = torch.load(out / "prec_ours_lo_2" / "weights.pt")["init"]
    done = {}

    def get(lr, accumulation=1, bf16=True):
        key = (lr, accumulation, bf16)
        if key not in done:
            folder = tmp_path_factory.mktemp(f"stock{lr}")
            done[key] = (init, _stock_peft(models / "llama", init, float(lr), folder, accumulation, bf16))
        return done[key]

    return get


def _updates(weights, stock_init, stock_trained, kind):
    names = sorted(n for n in stock_init if kind in n)
    ours = {n: weights["trained"][n] - weights["init"][n] for n in names}
    theirs = {n: stock_trained[n] - stock_init[n] for n in names}
    return names, ours, theirs


def _check(version, key, launches, oracle, expect_equal=True):
    _, out, results, _ = launches[version]
    name = f"{key}_{version}"
    for rank in (0, 1):
        r = results[rank][name]
        assert r.get("ok"), r.get("traceback")
        assert r["distributed_type"] == "DistributedType.FSDP"
        eng = r["engagement"]
        engaged = eng["fsdp1_units"] > 0 and eng["flat_params"] > 0 if version == 1 else eng["fsdp2_modules"] > 0
        assert engaged, eng
        assert r["packed_dtypes"] == ["torch.bfloat16"], "the packed 4-bit bytes stay in their storage dtype"
        assert r["mp_param_dtype"] == "torch.bfloat16", "compute stays bf16"
    assert results[0][name]["init_checksum"] == results[1][name]["init_checksum"]
    lr = "1e-5" if name.split("_")[2] == "lo" else "2e-4"
    accumulation = 2 if "_ga2" in key else 1
    stock_init, stock_trained = oracle(lr, accumulation, bf16="fp32" not in key)
    weights = torch.load(out / name / "weights.pt")
    for n, value in stock_init.items():  # the same start as the oracle's (an exact copy)
        assert torch.equal(weights["init"][n], value), n
    report = {}
    for kind in ("lora_A", "lora_B"):
        names, ours, theirs = _updates(weights, stock_init, stock_trained, kind)
        assert names
        flat_ours = torch.cat([ours[n].flatten() for n in names])
        flat_theirs = torch.cat([theirs[n].flatten() for n in names])
        report[kind] = float((flat_ours - flat_theirs).norm() / flat_theirs.norm())
        report[f"{kind}_moved"] = min(float((ours[n] != 0).float().mean()) for n in names)
    print(f"FSDP{version} {key} lr {lr}: {report}")  # the table (pytest -s)
    if expect_equal:
        assert report["lora_A"] <= TOL and report["lora_B"] <= TOL, report
        assert report["lora_A_moved"] >= MOVED, report
    return results[0][name], report


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("key", ["prec_ours_lo", "prec_ours_hi", "prec_cb_lo", "prec_cb_hi"])
def test_adapter_update_equals_stock_peft(version, key, launches, oracle):
    r, _ = _check(version, key, launches, oracle)
    assert r["trainable_dtypes_before_wrap"] == ["torch.float32"]
    assert r["trainable_dtypes"] == r["optimizer_state_dtypes"] == ["torch.float32"]
    assert r["mp_reduce_dtype"] == "torch.float32"


@pytest.mark.parametrize("version", [1, 2])
def test_gradient_accumulation_update_equals_stock_peft(version, launches, oracle):
    """Gradient accumulation 2 on each rank in bf16, against stock peft accumulating both ranks' micro-batches in one
    process (4 per step). FSDP2 gathered every unit once for it (the no-sync post-backward needs them; see
    train/fsdp.py), FSDP1 reduces each micro-batch (its no-sync accumulation is bf16: 1.9e-3 in the peft recipe)."""
    r, _ = _check(version, "prec_ours_hi_ga2bf16", launches, oracle)
    assert r["gradient_accumulation_steps"] == 2 and r["bf16"]
    assert r["trainable_dtypes"] == r["optimizer_state_dtypes"] == ["torch.float32"]


# bf16=False: the adapters are gathered and computed in the bf16 storage dtype (FSDP's param_dtype), where stock
# peft computes them in float32 (its input cast to lora_A's dtype). Measured under FSDP1 and FSDP2 alike: lora_A
# 0.070 (accumulation 1) and 0.087 (accumulation 2) relative to stock's update, lora_B 0.021 / 0.032: not a matter
# of gradient accumulation (issue 49's sweep). Strict: this flips when the bf16=False compute follows stock.
BF16_OFF = pytest.mark.xfail(strict=True, reason="bf16=False computes the adapters in bf16; stock peft in float32")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("key", ["prec_ours_hi_ga2fp32", "prec_ours_hi_fp32"])
def test_bf16_off_trains_with_float32_masters(version, key, launches, oracle):
    r, report = _check(version, key, launches, oracle, expect_equal=False)
    assert r["gradient_accumulation_steps"] == (2 if "ga2" in key else 1) and not r["bf16"]
    assert r["trainable_dtypes"] == r["optimizer_state_dtypes"] == ["torch.float32"]
    assert report["lora_A_moved"] >= MOVED, report


@BF16_OFF
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("key", ["prec_ours_hi_ga2fp32", "prec_ours_hi_fp32"])
def test_bf16_off_update_equals_stock_peft(version, key, launches, oracle):
    _check(version, key, launches, oracle)


def test_bf16_opt_out_keeps_pure_bf16_adapters(launches, oracle):
    """adapter_dtype="bfloat16": what torchtune does, and what this package did before - measurably less learning."""
    r, report = _check(2, "prec_bf16_lo", launches, oracle, expect_equal=False)
    assert r["trainable_dtypes"] == r["optimizer_state_dtypes"] == ["torch.bfloat16"]
    assert r["dtypes_before_wrap"] == ["torch.bfloat16"]
    assert report["lora_A"] > 0.5, report  # measured 0.986: the comparison above would catch bf16 adapters
    assert report["lora_A_moved"] < MOVED, report


def test_fsdp1_bf16_opt_out_masters_are_what_the_doctor_plans(launches):
    """FSDP1, bf16=True, adapter_dtype="bfloat16": accelerate upcasts the trainable FlatParameters to float32 and our
    trainer casts them back, so the masters and the optimizer states are bf16 - the doctor's plan (was: float32
    masters, twice the adapter, gradient and optimizer bytes). A stock Trainer keeps accelerate's float32."""
    from hf_fsdp_qlora.doctor import diagnose
    from hf_fsdp_qlora.doctor.plan_context import plan_context

    _, _, results, _ = launches[1]
    r = results[0]["prec_bf16_lo_1"]
    assert r.get("ok"), r.get("traceback")
    assert r["engagement"]["fsdp1_units"] > 0 and r["mp_param_dtype"] == "torch.bfloat16"
    assert r["trainable_dtypes"] == r["optimizer_state_dtypes"] == ["torch.bfloat16"], r
    config = REPO / "tests" / "data" / "llama3_1_8b_config.json"
    for trainer, master in (("hf_fsdp_qlora", torch.bfloat16), ("transformers", torch.float32)):
        d = diagnose(config, accelerate_config="fsdp1_qlora", quantization="4bit", quant_storage="bfloat16",
                     adapter_dtype="bfloat16", mixed_precision="bf16", trainer=trainer)  # fmt: skip
        assert plan_context(d.shape, d.setup).master_b == master.itemsize, trainer


def test_adapter_dtype_argument_is_checked():
    from hf_fsdp_qlora import FSDPQLoRATrainingArguments
    from hf_fsdp_qlora.train.precision import adapter_dtype_for

    args = FSDPQLoRATrainingArguments(output_dir="unused", adapter_dtype="bf16", use_cpu=True, report_to=[])
    assert args.adapter_dtype == "bfloat16"
    assert adapter_dtype_for(args, torch.bfloat16) == torch.bfloat16
    assert adapter_dtype_for(None, torch.bfloat16) == torch.float32  # stock TrainingArguments: the default
    with pytest.raises(ValueError, match="adapter_dtype='int8' is not supported"):
        FSDPQLoRATrainingArguments(output_dir="unused", adapter_dtype="int8", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="Use adapter_dtype='float32'"):
        adapter_dtype_for(args, torch.float16)


def test_fsdp2_checkpointing_recomputes_with_the_forward_dropout_masks(launches):
    """FSDP2, float32, lora_dropout=0.1, the same adapters, batches and seed: the first step's LoRA gradients (gathered
    whole) with FSDP's activation checkpointing equal those without it. accelerate 1.15 wraps each layer with
    ``checkpoint_wrapper(preserve_rng_state=False)``: the backward's recomputation drew new dropout masks and the
    gradients differed by up to 2.65x their norm (the loss, computed in the forward, did not change)."""
    _, out, results, _ = launches[2]
    for rank in (0, 1):
        on, off = results[rank]["acrng_on_2"], results[rank]["acrng_off_2"]
        for r in (on, off):
            assert r.get("ok"), r.get("traceback")
            assert r["distributed_type"] == "DistributedType.FSDP" and r["engagement"]["fsdp2_modules"] > 0, r
            assert r["engagement"]["dtensor_params"] > 0 and r["dropout"] == [0.1], r
        assert on["plugin_checkpointing"] and on["checkpointed"] > 0, on
        assert not off["plugin_checkpointing"] and off["checkpointed"] == 0, off
        assert on["losses"] == off["losses"], (on["losses"], off["losses"])
    with_ckpt, without = torch.load(out / "acrng_on_2" / "grads.pt"), torch.load(out / "acrng_off_2" / "grads.pt")
    assert sorted(with_ckpt) == sorted(without) and any("lora_A" in n for n in without)
    for name, grad in without.items():
        assert grad.abs().max() > 0, name  # init_lora_weights=False: every adapter gets a gradient
        torch.testing.assert_close(with_ckpt[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert results[0]["acrng_on_2"]["preserve_rng_state"] == ["True"]


def test_checkpoint_wrappers_made_to_preserve_the_rng_state():
    """preserve_checkpoint_rng_state on accelerate's FSDP2 wrapping (one process, no FSDP needed): the wrapper's
    gradient with dropout equals the unwrapped module's; keywords kept; a custom checkpoint function left alone."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from hf_fsdp_qlora.train.accelerator_setup import preserve_checkpoint_rng_state

    def grad(model):
        torch.manual_seed(3)
        x = torch.ones(4, 8, requires_grad=True)
        model(x).sum().backward()
        return x.grad

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    plain = grad(layer)
    model = torch.nn.Sequential(checkpoint_wrapper(layer, preserve_rng_state=False))  # as accelerate's fsdp2_apply_ac
    assert not torch.equal(grad(model), plain), "new masks in the recomputation: the bug this guards against"
    custom = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(8, 8), checkpoint_fn=lambda f, *a, **k: f(*a)))
    assert preserve_checkpoint_rng_state(torch.nn.Sequential(model, custom)) == 1
    fn = model[0].checkpoint_fn
    assert isinstance(fn, functools.partial) and fn.keywords == {"use_reentrant": False, "preserve_rng_state": True}
    assert torch.equal(grad(model), plain)
    assert preserve_checkpoint_rng_state(model) == 0  # already preserved (and FSDP1's wrappers: torch's default)
