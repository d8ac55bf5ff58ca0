"""evaluate() / predict() / generate() under FSDP1 and FSDP2 with the sharded 4-bit base, and
SampleGenerationsCallback: one 2-rank accelerate launch per FSDP version (tests/scripts/eval_generate_scenarios.py),
compared here with the unsharded model (no torch.distributed at all) loaded with the adapters the ranks saved.
"""

from __future__ import annotations

import sys

import pytest
import torch
from dist_utils import SCRIPTS, accelerate_launch, check, read_results
from tiny_models import build_tiny_model

sys.path.insert(0, str(SCRIPTS))
import eval_generate_scenarios as worker

SCENARIOS = "fresh,stock_fresh,callback_fresh,during,plain,fresh8"
UPSTREAM_FSDP2_ERROR = "When using FSDP2, a model and optimizer must be passed together to `Accelerator.prepare()`"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", "llama").parent


def _launch(version, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"eval_fsdp{version}") / "run"
    proc = accelerate_launch(
        f"cpu_fsdp{version}_rehearsal.yaml", "eval_generate_scenarios.py",
        "--models", str(model_dir), "--out", str(out), "--fsdp-version", str(version), "--scenarios", SCENARIOS,
        timeout=300,
    )  # fmt: skip
    check(proc)
    results = read_results(out)
    assert sorted(results) == [0, 1], f"expected results from 2 ranks, got {sorted(results)}"
    for rank, found in results.items():
        for name, res in found.items():
            assert res["ok"], f"rank {rank} scenario {name}: {res.get('error')}\n{res.get('traceback')}"
    return out, results, proc


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def run(request, model_dir, tmp_path_factory):
    out, results, proc = _launch(request.param, model_dir, tmp_path_factory)
    return request.param, out, results, proc


def _oracle(model_dir, bits):
    """The unsharded model in this process; `load(adapter)` sets the adapter weights a rank saved.

    The ranks keep float32 adapters, but FSDP's mixed precision gathers them cast to bf16 for every forward: the
    oracle computes with the saved weights cast to bf16 (adapter_dtype=bf16), not with fp32 LoRA matmuls."""
    import bitsandbytes as bnb

    from hf_fsdp_qlora import load_qlora_model

    model = load_qlora_model(
        str(model_dir / "llama"), bits=bits, lora_config=worker.lora_config(), gradient_checkpointing=False,
        adapter_dtype=torch.bfloat16,
    )  # fmt: skip
    for module in model.modules():  # the CPU repack trap, as in the worker: compare unrepacked weights
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    model.eval()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def load(path):
        weights = torch.load(path, weights_only=True)
        assert set(weights) == set(params), sorted(set(weights) ^ set(params))[:5]
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value.to(params[name].dtype))
        return model

    return load


@pytest.fixture(scope="module")
def oracle(model_dir):
    return _oracle(model_dir, bits=4)


@pytest.fixture(scope="module")
def oracle8(model_dir):
    return _oracle(model_dir, bits=8)


def _expected_eval(model):
    """Trainer's eval loss: per-device batches of 2 in order ([0,1] on rank 0, [2,3] on rank 1, ...), averaged."""
    ids = worker.TokenDataset().ids
    losses, logits = [], []
    with torch.no_grad():
        for chunk in ids.split(2):
            res = model(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk)
            losses.append(float(res.loss))
            logits.append(res.logits.float())
    return sum(losses) / len(losses), torch.cat(logits)


def _greedy(model, prompt, new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
        )  # fmt: skip
    return out[0].tolist()


def _engaged(version, res):
    assert res["distributed_type"] == "DistributedType.FSDP"
    if version == 1:
        assert res["model_type"] == "FullyShardedDataParallel" and res["engagement"]["flat_params"] > 1
    else:  # every 4-bit base weight is a DTensor shard
        assert res["packed_dtensor"] == res["packed_count"] == 14, res


def _losses(res):
    return [e["loss"] for e in res["log_history"] if "loss" in e]


@pytest.mark.parametrize("scenario", ["fresh", "fresh8"])  # fresh8: an 8-bit base (load_qlora_model(bits=8))
def test_evaluate_predict_generate_before_training(run, oracle, oracle8, scenario):
    version, out, results, _ = run
    for rank in (0, 1):
        res = results[rank][scenario]
        _engaged(version, res)
        if version == 1:  # wrapped as train() wraps it: LoRA layers in their own units too (31, not 3)
            assert res["engagement"] == results[rank]["plain"]["engagement"]
        model = (oracle8 if scenario == "fresh8" else oracle)(out / scenario / "adapter_init.pt")
        loss, logits = _expected_eval(model)
        assert res["before_evaluate"]["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=0)
        assert res["before_predict_metrics"]["test_loss"] == pytest.approx(loss, rel=1e-6, abs=0)
        if rank == 0:
            got = torch.load(out / scenario / "before_predictions.pt")
            assert torch.equal(got, logits), (got - logits).abs().max()
        # each rank its own prompt and number of new tokens: the shorter one kept stepping with the other
        assert res["before_generate"] == _greedy(model, worker.PROMPTS[rank], worker.MAX_NEW[rank])
        assert res["before_mode_after"] is False  # generate restored eval mode (evaluate left it there)
        # evaluating and generating first changed nothing in training: the 3-step run's first 2 losses
        assert scenario == "fresh8" or res["train_losses"] == _losses(results[rank]["plain"])[:2]
        assert len(res["train_losses"]) == 2


def test_stock_trainer_evaluate_before_training_is_the_upstream_bug(run):
    version, _, results, _ = run
    for rank in (0, 1):
        res = results[rank]["stock_fresh"]
        if version == 2:  # huggingface/transformers#39961, #48841 - our trainers go through prepare_for_evaluation
            assert UPSTREAM_FSDP2_ERROR in res["error"]
        else:
            # FSDP1: before train(), nothing installs peft's wrap policy (each trainable leaf a unit of its own), so
            # the float32 adapters (as stock peft's) share a decoder layer's FlatParameter with its bf16 base.
            assert "Must flatten tensors with uniform dtype" in res["error"], res
        # The callback alone gives a stock Trainer our evaluation_loop (hf_fsdp_qlora.train.trainer_hook).
        assert "eval_loss" in results[rank]["callback_fresh"]["evaluate"], results[rank]["callback_fresh"]


def test_evaluate_and_sample_generations_during_training(run, oracle):
    version, out, results, proc = run
    plain0 = torch.load(out / "plain" / "adapter_step3.pt")
    during0 = torch.load(out / "during" / "adapter_step3.pt")
    assert all(torch.equal(plain0[k], during0[k]) for k in plain0)  # training unchanged, bit for bit
    for rank in (0, 1):
        res = results[rank]["during"]
        _engaged(version, res)
        assert _losses(res) == _losses(results[rank]["plain"]) and len(_losses(res)) == 3
        assert res["modes_after_step"] == [True, True, True]
        evals = [e for e in res["log_history"] if "eval_loss" in e]
        assert [e["step"] for e in evals] == [1, 2, 3, 3]  # eval_steps=1, then the evaluate() after training
        for step in (1, 2, 3):
            model = oracle(out / "during" / f"adapter_step{step}.pt")
            loss, logits = _expected_eval(model)
            assert evals[step - 1]["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=0), step
            sample = res["sample_history"][step - 1]
            assert sample["step"] == step
            expected = [_greedy(model, p, worker.SAMPLE_NEW)[len(p) :] for p in worker.SAMPLE_PROMPTS]
            assert sample["sample_generations"] == expected, step
        assert res["after_evaluate"]["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=0)
        assert res["after_generate"] == _greedy(model, worker.PROMPTS[rank], worker.MAX_NEW[rank])
        if rank == 0:
            got = torch.load(out / "during" / "after_predictions.pt")
            assert torch.equal(got, logits), (got - logits).abs().max()
        logged = [e for e in res["log_history"] if "sample_generations" in e]
        assert len(logged) == (3 if rank == 0 else 0)  # the main process logs
    assert proc.stderr.count("hf_fsdp_qlora: sample generations at step") == 3


def test_sample_generations_callback_bad_input():
    from hf_fsdp_qlora import SampleGenerationsCallback

    with pytest.raises(ValueError, match="non-empty list"):
        SampleGenerationsCallback("one prompt")
    with pytest.raises(ValueError, match="at least 1"):
        SampleGenerationsCallback([[1, 2]], every_n_steps=0)
    with pytest.raises(ValueError, match="need a tokenizer"):
        SampleGenerationsCallback(["hello"])._encode("hello", None)
