"""The foundation, end to end: our trainers (and the callback on a stock Trainer) under real FSDP1 and
FSDP2 on 2 CPU ranks (gloo), launched as users launch - `accelerate launch` with the shipped CPU
configs, and torchrun with FSDP set in TrainingArguments.

For every training scenario: FSDP engaged (FlatParameters / FSDP2 modules and DTensor LoRA weights),
every rank started from the same adapters although no seed was set, the step-0 logits and loss equal
those of the unsharded model on the same batch, and the saved adapter equals the trained weights
gathered independently. The classic FSDP failures reproduce with stock Trainer (upstream error text)
and train, or are refused with a clear error, with ours.
"""

from __future__ import annotations

import sys

import pytest
import torch
from dist_utils import SCRIPTS, check, read_results, torchrun
from tiny_models import ARCHS, build_tiny_model

sys.path.insert(0, str(SCRIPTS))
import train_scenarios as worker  # noqa: E402

pytestmark = pytest.mark.distributed

TRAINING = ["a=llama:ours_loader", "b=qwen2:ours_user", "c=llama_tied:callback", "d=llama:sft", "m=llama:full"]
CLASSIC_FSDP1 = [
    "e=llama:stock_fp32lora", "f=llama:ours_fp32lora",
    "g=llama:stock_kbitprep", "h=llama:ours_kbitprep",
    "i=llama:stock_uint8", "j=llama:ours_uint8",
    "k=llama:stock_int8", "l=llama:ours_int8",
]  # fmt: skip
CLASSIC_FSDP2 = ["k=llama:stock_int8", "l=llama:ours_int8", "n=llama:dupbatches"]


def _specs(scenarios):
    return {key: tuple(spec.split(":")) for key, spec in (s.split("=") for s in scenarios)}


# The accelerate launches run in the suite's shared launches (tests/conftest.py), first, with other modules'
# trainer scenarios after them: scenario "a" must be the first of its launch (see the no-seed test).
SHARED_TRAIN_SCENARIOS = {1: _specs(TRAINING + CLASSIC_FSDP1), 2: _specs(TRAINING + CLASSIC_FSDP2)}
SHARED_TRAIN_ORDER = 0


@pytest.fixture(scope="module")
def models(shared_models):
    for arch in ARCHS:
        build_tiny_model(shared_models / arch, arch)
    return shared_models


def _torchrun(version, scenarios, models, out, fork):
    args = [
        "--models",
        str(models),
        "--out",
        str(out),
        "--fsdp-version",
        str(version),
        "--scenarios",
        ",".join(scenarios),
    ]
    check(torchrun("train_scenarios.py", *args, timeout=600, fork=fork))
    results = read_results(out)
    assert sorted(results) == [0, 1], f"expected results from 2 ranks, got {sorted(results)}"
    return results


def _shared(shared_launch, version):
    _, out, results, _ = shared_launch(version)
    assert sorted(results) == [0, 1], f"expected results from 2 ranks, got {sorted(results)}"
    first = next(iter(results[0]))
    assert first == "a", f"scenario a must run first in its launch, {first!r} did"
    return out, results


@pytest.fixture(scope="module")
def fsdp1_run(models, shared_launch):
    return _shared(shared_launch, 1)


@pytest.fixture(scope="module")
def fsdp2_run(models, shared_launch):
    return _shared(shared_launch, 2)


@pytest.fixture(scope="module")
def torchrun_runs(models, tmp_path_factory):
    runs = {}
    for version in (1, 2):
        out = tmp_path_factory.mktemp(f"torchrun{version}") / "run"
        scenarios = ["a=llama:ours_loader", "c=qwen2:callback", "d=llama:sft"]
        # The real torchrun (a user's path, its elastic agent's environment) once; the FSDP version changes
        # nothing about the launcher, so the FSDP2 run forks its ranks (tests/fork_launch.py).
        runs[version] = (out, _torchrun(version, scenarios, models, out, fork=version == 2))
    return runs


def _oracle(models, arch, init, first_batch):
    """Unsharded single process: same base, rank 0's initial adapters, each rank's first batch."""
    model = worker.load_qlora_model(str(models / arch), lora_config=worker.lora_config(), gradient_checkpointing=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value.to(params[name].dtype))
    model.train()
    ids = torch.tensor(first_batch)
    per_rank = []
    for chunk in ids.split(worker.BATCH):
        out = model(input_ids=chunk, labels=chunk, attention_mask=torch.ones_like(chunk))
        per_rank.append((out.logits.detach().float(), float(out.loss)))
    return per_rank


def _assert_trained_scenario(name, results, out, models, version, arch, exact_loss=True):
    r0, r1 = results[0][name], results[1][name]
    assert r0.get("ok"), r0.get("traceback")
    assert r1.get("ok"), r1.get("traceback")
    # FSDP engaged - accelerate falls back silently on CPU, so a green run alone proves nothing.
    for r in (r0, r1):
        assert r["distributed_type"] == "DistributedType.FSDP"
        eng = r["engagement"]
        if version == 1:
            assert eng["fsdp1_units"] > 0 and eng["flat_params"] > 0, eng
            assert not r["is_fsdp2"]
        else:
            assert eng["fsdp2_modules"] > 0 and eng["dtensor_params"] > 0, eng
            assert r["is_fsdp2"] and r["dtensor_lora"] > 0
        # one dtype per FSDP unit: frozen tensors bf16, an adapter run's trainable ones fp32 (master weights)
        assert r["frozen_dtypes_before_wrap"] in (["torch.bfloat16"], []), r["frozen_dtypes_before_wrap"]
        trainable = ["torch.float32"] if r["adapter_run"] else ["torch.bfloat16"]
        assert r["trainable_dtypes_before_wrap"] == trainable
    # Identical start on every rank, from our broadcast.
    assert r0["init_checksum"] == r1["init_checksum"]
    weights = torch.load(out / name / "weights.pt")
    # Step-0 logits and loss equal the unsharded model's on the same batch.
    if "step0_losses" in r0:
        oracle = _oracle(models, arch, weights["init"], r0["first_batch"])
        for rank, (logits, loss) in enumerate(oracle):
            assert r0["step0_losses"][rank] == pytest.approx(loss, rel=1e-6 if exact_loss else 1e-3)
            logits_path = out / name / f"logits_rank{rank}.pt"
            if logits_path.exists():
                torch.testing.assert_close(torch.load(logits_path), logits, rtol=1e-5, atol=1e-5)
    # The saved adapter loads with peft and equals the trained weights gathered from all ranks.
    _assert_adapter_equals(out / name / "adapter", weights, models / arch)


def _assert_adapter_equals(adapter_dir, weights, base_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (adapter_dir / "adapter_model.safetensors").is_file()
    from hf_fsdp_qlora.experts.dbrx import fuse_dbrx_experts

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.bfloat16)
    fuse_dbrx_experts(base)  # DBRX: its experts as training held them, where the adapter lies (a no-op elsewhere)
    loaded = PeftModel.from_pretrained(base, adapter_dir)
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    trained = {n: v for n, v in weights["trained"].items() if "lora_" in n}
    assert lora and set(lora) == set(trained), (sorted(set(lora) ^ set(trained)))[:6]
    changed = 0
    for name, value in trained.items():
        torch.testing.assert_close(lora[name].float(), value, rtol=0, atol=0)
        changed += not torch.equal(value, weights["init"][name].float())
    assert changed > 0, "training did not change the adapters: the comparison would prove nothing"


@pytest.mark.parametrize("name,arch", [("a", "llama"), ("b", "qwen2"), ("c", "llama_tied"), ("d", "llama")])
def test_fsdp1_trains_saves(fsdp1_run, models, name, arch):
    out, results = fsdp1_run
    _assert_trained_scenario(name, results, out, models, 1, arch)


@pytest.mark.parametrize("name,arch", [("a", "llama"), ("b", "qwen2"), ("c", "llama_tied"), ("d", "llama")])
def test_fsdp2_trains_saves(fsdp2_run, models, name, arch):
    out, results = fsdp2_run
    _assert_trained_scenario(name, results, out, models, 2, arch)


@pytest.mark.parametrize("version", [1, 2])
def test_torchrun_with_fsdp_in_training_arguments(torchrun_runs, models, version):
    out, results = torchrun_runs[version]
    _assert_trained_scenario("a", results, out, models, version, "llama")
    _assert_trained_scenario("c", results, out, models, version, "qwen2")
    _assert_trained_scenario("d", results, out, models, version, "llama")  # FSDPQLoRASFTTrainer


def test_adapters_identical_without_a_seed(fsdp1_run, fsdp2_run):
    """The first scenario of a launch runs before anything seeds the ranks: LoRA initialised differently
    on each rank (so this test can fail), and identical once our trainer is built."""
    for _, results in (fsdp1_run, fsdp2_run):
        r0, r1 = results[0]["a"], results[1]["a"]
        assert r0["checksum_before_trainer"] != r1["checksum_before_trainer"]
        assert r0["init_checksum"] == r1["init_checksum"] == r0["checksum_before_trainer"]


# The classic failures (exact upstream error text, reproduced by the stock runs here), stock vs ours.
@pytest.mark.parametrize(
    "stock,ours,upstream_text,our_error",
    [
        ("e", "f", "expected m1 and m2 to have the same dtype", None),
        ("g", "h", "Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32", None),
        ("i", "j", "Cannot flatten integer dtype tensors", None),  # ours views the uint8 bytes as bf16
        (
            "k",
            "l",
            "Cannot flatten integer dtype tensors",
            None,
        ),  # ours holds the int8 bytes as bf16 (tests/test_int8.py)
    ],
)
def test_fsdp1_classic_failures(fsdp1_run, stock, ours, upstream_text, our_error):
    _, results = fsdp1_run
    for rank in (0, 1):
        s, o = results[rank][stock], results[rank][ours]
        assert not s["ok"] and upstream_text in s["error"], s
        if our_error is None:
            assert o["ok"], o.get("traceback")
            assert o["engagement"]["flat_params"] > 0
        else:
            assert not o["ok"] and o["error_type"] == "UnsupportedSetupError", o
            assert our_error in o["error"]


def test_fsdp2_8bit(fsdp2_run):
    _, results = fsdp2_run
    for rank in (0, 1):
        assert not results[rank]["k"]["ok"] and "has no attribute 'CB'" in results[rank]["k"]["error"]
        ours = results[rank]["l"]  # the same load_in_8bit model trains, its int8 bytes sharded (tests/test_int8.py)
        assert ours["ok"], ours.get("traceback")
        assert ours["packed_dtensor"] == ours["packed_count"] == 14
        assert ours["packed_local_bytes"] * 2 == ours["packed_full_bytes"]


def _assert_full_finetune(results, out, models, version):
    """Full fine-tune (no quantization, no adapter) through the same trainer and configs."""
    from transformers import AutoModelForCausalLM

    r0, r1 = results[0]["m"], results[1]["m"]
    assert r0.get("ok"), r0.get("traceback")
    assert r1.get("ok"), r1.get("traceback")
    eng = r0["engagement"]
    assert (eng["flat_params"] > 0) if version == 1 else (eng["fsdp2_modules"] > 0 and eng["dtensor_params"] > 0)
    weights = torch.load(out / "m" / "weights.pt")
    oracle = AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.bfloat16)
    oracle.train()
    ids = torch.tensor(r0["first_batch"])
    for rank, chunk in enumerate(ids.split(worker.BATCH)):
        logits = oracle(input_ids=chunk, attention_mask=torch.ones_like(chunk)).logits.detach().float()
        torch.testing.assert_close(torch.load(out / "m" / f"logits_rank{rank}.pt"), logits, rtol=1e-5, atol=1e-5)
    # save_model wrote a whole model that from_pretrained loads, equal to the trained weights.
    saved = AutoModelForCausalLM.from_pretrained(out / "m" / "adapter", dtype=torch.bfloat16)
    params = dict(saved.named_parameters())
    assert weights["trained"] and set(weights["trained"]) <= set(params)
    changed = 0
    for name, value in weights["trained"].items():
        torch.testing.assert_close(params[name].float(), value, rtol=0, atol=0)
        changed += not torch.equal(value, weights["init"][name])
    assert changed > 0


@pytest.mark.parametrize("version", [1, 2])
def test_full_finetune(fsdp1_run, fsdp2_run, models, version):
    out, results = fsdp1_run if version == 1 else fsdp2_run
    _assert_full_finetune(results, out, models, version)


def test_duplicate_batches_fail_fast(fsdp2_run):
    """A dataloader without a DistributedSampler feeds every rank the same data: caught in the first steps."""
    _, results = fsdp2_run
    for rank in (0, 1):
        found = results[rank]["n"]
        assert not found["ok"] and found["error_type"] == "DuplicateBatchesError", found
        assert "DistributedSampler" in found["error"]


def test_memory_and_throughput_logged(fsdp2_run):
    _, results = fsdp2_run
    history = results[0]["a"]["memory_throughput"]
    assert history and len(history) == 3  # logging_steps=1, 3 steps
    for record in history:
        assert record["tokens_per_second"] > 0
        assert 0.05 < record["peak_memory_gb_rank0"] < 16 and 0.05 < record["peak_memory_gb_rank1"] < 16


@pytest.mark.parametrize("version", [1, 2])
def test_merge_while_sharded_is_refused_clearly(fsdp1_run, fsdp2_run, version):
    _, results = fsdp1_run if version == 1 else fsdp2_run
    for rank in (0, 1):
        message = results[rank]["a"]["merge_while_sharded"]
        assert message.startswith("UnsupportedSetupError") and "merge-adapters --base" in message, message
