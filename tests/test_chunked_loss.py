"""The chunked causal-LM loss (hf_fsdp_qlora.train.loss) against transformers' stock loss.

Single process: the head-and-cross-entropy kernel, then our trainer with ``chunked_loss`` on and off on the same model
and batches (-100 positions, a batch with every position masked, ``num_items_in_batch`` with gradient accumulation,
evaluation and predict). Distributed: one 2-rank launch per FSDP version (tests/scripts/chunked_loss_scenarios.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_fsdp_qlora.loss_paths import DEFAULT_LOSS_CHUNK_SIZE
from hf_fsdp_qlora.train.loss import head_loss

# Measured: float32 losses agree to 2e-7 relative, gradients to 1e-6 (only the summation order differs).
RTOL, ATOL = 1e-5, 1e-6


def _stock(logits, labels, num_items=None):
    # transformers' ForCausalLMLoss, written out: shift, float32, sum or mean over labelled tokens.
    shift = F.pad(labels[..., 1:], (0, 1), value=-100)
    total = F.cross_entropy(logits.float().flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum")
    return total / num_items if num_items is not None else total / shift.ne(-100).sum()


@pytest.mark.parametrize("path", ["linear", "recompute"])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_head_loss_equals_full_logits_loss_and_gradients(chunk, path):
    """Both kernels: gradients computed in the forward (a plain nn.Linear head) and chunks recomputed in the backward
    under checkpoint (any other head: here a Sequential around the Linear, as a LoRA or 4-bit head would be)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 50, bias=True)
    head = linear if path == "linear" else torch.nn.Sequential(linear)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :4] = -100
    labels[1, 7] = -100
    expected = _stock(head(hidden), labels) * 0.5  # a remaining factor, as gradient accumulation applies
    expected.backward()
    want = [t.grad.clone() for t in (hidden, linear.weight, linear.bias)]
    hidden.grad = linear.weight.grad = linear.bias.grad = None
    shift = F.pad(labels[..., 1:], (0, 1), value=-100)
    count = int(shift.ne(-100).sum())
    loss, counted = head_loss(head.forward, hidden, shift, chunk, scale=1.0 / count)
    assert int(counted) == count
    (loss * 0.5).backward()
    torch.testing.assert_close(loss * 0.5, expected, rtol=RTOL, atol=ATOL)
    for got, ref in zip((hidden.grad, linear.weight.grad, linear.bias.grad), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("path", ["linear", "recompute"])
def test_all_positions_masked_gives_zero_connected_loss(path):
    linear = torch.nn.Linear(8, 20)
    head = linear if path == "linear" else torch.nn.Sequential(linear)
    hidden = torch.randn(1, 5, 8, requires_grad=True)
    loss, count = head_loss(head.forward, hidden, torch.full((1, 5), -100), 2)
    assert float(loss.detach()) == 0.0 and int(count) == 0
    loss.backward()  # connected: under FSDP every rank must run the same backward collectives
    assert torch.count_nonzero(hidden.grad) == 0 and linear.weight.grad is not None


def _tiny(vocab=96):
    from tiny_models import tiny_config

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab), dtype=torch.float32)


class _Data(torch.utils.data.Dataset):
    """Samples with prompts masked (-100) of different lengths, and one sample with no labelled token at all."""

    def __init__(self, n=8, seq=12, vocab=96):
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, vocab, (n, seq), generator=gen)
        self.prompt = [int(i) for i in torch.randint(0, seq - 2, (n,), generator=gen)]
        self.prompt[3] = seq  # every position masked

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: self.prompt[i]] = -100
        return {"input_ids": self.ids[i], "labels": labels, "attention_mask": torch.ones_like(self.ids[i])}


def _trainer(tmp_path, model, chunked, **kw):
    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments

    args = FSDPQLoRATrainingArguments(
        output_dir=str(tmp_path / f"c{chunked}"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        chunked_loss=chunked, loss_chunk_size=5, check_distinct_batches=0, log_memory_throughput=False, **kw,
    )  # fmt: skip
    return FSDPQLoRATrainer(model=model, args=args, train_dataset=_Data(), eval_dataset=_Data())


def test_trainer_chunked_loss_equals_stock_with_gradient_accumulation(tmp_path):
    """Two optimizer steps of 2 micro-batches each (num_items_in_batch normalisation, a fully masked sample), then
    evaluate() and predict(): equal losses, equal trained weights (SGD: weights move with the gradients, where Adam
    would magnify rounding in near-zero gradients), and predict() still returns the logits."""
    model = _tiny()
    runs = {}
    for chunked in (False, True):
        trainer = _trainer(tmp_path, copy.deepcopy(model), chunked, gradient_accumulation_steps=2, optim="sgd")
        from hf_fsdp_qlora.train.loss import trainer_loss_path

        assert trainer_loss_path(trainer) == ("ours" if chunked else "stock")
        trainer.train()
        runs[chunked] = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
            "eval": trainer.evaluate()["eval_loss"],
            "predict": trainer.predict(_Data()),
        }
    stock, ours = runs[False], runs[True]
    assert len(ours["losses"]) == 2
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours["grad_norm"], stock["grad_norm"], rtol=1e-4, atol=1e-6)
    for name, value in stock["weights"].items():
        torch.testing.assert_close(ours["weights"][name], value, rtol=1e-4, atol=1e-6)
    assert ours["eval"] == pytest.approx(stock["eval"], rel=RTOL)
    assert ours["predict"].predictions.shape == (8, 12, 96)  # logits, as with the stock loss
    torch.testing.assert_close(ours["predict"].predictions, stock["predict"].predictions)


def test_compute_loss_num_items_and_all_masked(tmp_path):
    """compute_loss itself: mean without num_items_in_batch, sum / num_items_in_batch with it, and a micro-batch whose
    positions are all masked (the stock mean is NaN; ours is 0 with zero gradients)."""
    model = _tiny()
    stock, ours = _trainer(tmp_path, copy.deepcopy(model), False), _trainer(tmp_path, copy.deepcopy(model), True)
    data = _Data()
    batch = {k: torch.stack([data[i][k] for i in (0, 1)]) for k in ("input_ids", "labels", "attention_mask")}
    for num_items in (None, torch.tensor(37)):
        expected = stock.compute_loss(stock.model, dict(batch), num_items_in_batch=num_items)
        got = ours.compute_loss(ours.model, dict(batch), num_items_in_batch=num_items)
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        expected.backward()
        got.backward()
        for (name, a), (_, b) in zip(stock.model.named_parameters(), ours.model.named_parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
        stock.model.zero_grad()
        ours.model.zero_grad()
    masked = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    assert torch.isnan(stock.compute_loss(stock.model, dict(masked)))
    zero = ours.compute_loss(ours.model, dict(masked))
    assert float(zero) == 0.0
    zero.backward()
    assert all(p.grad is None or not p.grad.any() for p in ours.model.parameters())
    with_items = ours.compute_loss(ours.model, dict(masked), num_items_in_batch=torch.tensor(5))
    assert float(with_items) == float(
        stock.compute_loss(stock.model, dict(masked), num_items_in_batch=torch.tensor(5))
    )
    assert "lm_head" in dict(ours.model.named_modules()) and "forward" not in vars(ours.model.lm_head)  # restored


def test_loss_chunk_size_must_be_positive(tmp_path):
    from hf_fsdp_qlora import FSDPQLoRATrainingArguments

    with pytest.raises(ValueError, match="loss_chunk_size=0"):
        FSDPQLoRATrainingArguments(output_dir=str(tmp_path), loss_chunk_size=0, use_cpu=True, report_to=[])


def _tiny_from(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _mixtral():
    from transformers import MixtralConfig

    return _tiny_from(MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=1.0,
    ))  # fmt: skip


def _recurrent_gemma(cap=2.0):
    from transformers import RecurrentGemmaConfig

    return _tiny_from(RecurrentGemmaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=16, logits_soft_cap=cap,
    ))  # fmt: skip


def _batch():
    data = _Data()
    return {k: torch.stack([data[i][k] for i in (0, 1)]) for k in ("input_ids", "labels", "attention_mask")}


def _assert_same_loss_and_grads(stock, ours, batch, num_items=None):
    expected = stock.compute_loss(stock.model, dict(batch), num_items_in_batch=num_items)
    got = ours.compute_loss(ours.model, dict(batch), num_items_in_batch=num_items)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    if stock.model.training:
        expected.backward()
        got.backward()
        for (name, a), (_, b) in zip(stock.model.named_parameters(), ours.model.named_parameters(), strict=True):
            if a.grad is not None or b.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
        stock.model.zero_grad()
        ours.model.zero_grad()
    return float(expected.detach())


def test_moe_router_aux_loss_equals_stock(tmp_path):
    """Issue 25.1: a mixture of experts with output_router_logits adds router_aux_loss_coef * aux_loss to the stock
    loss; the chunked loss adds it too (the model's own code does), with and without num_items_in_batch, and the
    gradients (router included) are the stock ones. Here (coefficient 1.0) stock 6.605; before the fix ours was
    4.599 (the aux term lost), now 6.605."""
    from hf_fsdp_qlora.train.loss import trainer_loss_path

    model = _mixtral()
    stock, ours = _trainer(tmp_path, copy.deepcopy(model), False), _trainer(tmp_path, copy.deepcopy(model), True)
    batch = _batch()
    with torch.no_grad():
        aux = model(**{k: v for k, v in batch.items() if k != "labels"}).aux_loss
    assert float(aux) > 1.0  # the term the chunked loss used to drop is not negligible here
    for num_items in (None, torch.tensor(37)):
        _assert_same_loss_and_grads(stock, ours, batch, num_items)
    assert trainer_loss_path(ours) == "ours"


@pytest.mark.parametrize("by_name", [True, False], ids=["config-name", "generic-probe"])
def test_logit_transform_keeps_stock_loss(tmp_path, monkeypatch, by_name):
    """Issue 25.2: RecurrentGemma soft-caps its logits (`logits_soft_cap`, 2 here) after the head. Our trainer keeps
    the stock loss, in training and in evaluation: known by the config's name, and without the name list at all (the
    one-time probe sees the logits change between the head and the loss function). Here stock 4.763; before the fix
    ours was 1.966 (tanh of the loss), now 4.763."""
    from hf_fsdp_qlora import loss_paths
    from hf_fsdp_qlora.train.loss import trainer_loss_path

    if not by_name:
        monkeypatch.setattr(loss_paths, "LOGIT_TRANSFORMS", ())
    model = _recurrent_gemma()
    stock, ours = _trainer(tmp_path, copy.deepcopy(model), False), _trainer(tmp_path, copy.deepcopy(model), True)
    batch = _batch()
    for training in (True, False):
        stock.model.train(training)
        ours.model.train(training)
        _assert_same_loss_and_grads(stock, ours, batch)
    assert trainer_loss_path(ours) == "stock"
    decided = ours.__dict__["_hf_fsdp_qlora_loss"]
    assert (decided["static"][0] == "stock") == by_name
    assert by_name or decided[("probe", True)] and decided[("probe", False)]


def test_stock_fallback_decided_and_logged_once(tmp_path, monkeypatch):
    """Issue 25.5: the trainer decides its loss path once (settings and config once, the probe once per mode), and
    says once why it keeps the stock loss; a trainer on the chunked path says nothing."""
    import logging

    from hf_fsdp_qlora import loss_paths
    from hf_fsdp_qlora.train import loss

    monkeypatch.setattr(loss_paths, "LOGIT_TRANSFORMS", ())  # found by the probe
    calls = {"facts": 0, "probe": 0}
    for name in calls:
        original = getattr(loss, f"_{name}")

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(loss, f"_{name}", counted)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_fsdp_qlora.train.loss").addHandler(handler)
    try:
        trainer = _trainer(tmp_path, _recurrent_gemma(), True)
        for _ in range(3):
            trainer.compute_loss(trainer.model, _batch())
        chunked = _trainer(tmp_path, _tiny(), True)
        for _ in range(2):
            chunked.compute_loss(chunked.model, _batch())
    finally:
        logging.getLogger("hf_fsdp_qlora.train.loss").removeHandler(handler)
    assert calls == {"facts": 2, "probe": 2}  # once per trainer (one mode each)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "stock" in records[0].getMessage() and "transforms its logits" in records[0].getMessage()


# --- under FSDP1 and FSDP2: one 2-rank launch each ---------------------------------------------------------------


def _build_mixtral(path):
    """A tiny Mixtral (vocab 256, as the launch's data) whose loss includes the router's auxiliary loss."""
    from transformers import MixtralConfig

    config = MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=1.0,
    )  # fmt: skip
    _tiny_from(config).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def fsdp_runs(request, tmp_path_factory):
    from dist_utils import accelerate_launch, check, read_results
    from tiny_models import build_tiny_model

    version = request.param
    models = tmp_path_factory.mktemp("models")
    build_tiny_model(models / "llama", "llama")
    _build_mixtral(models / "mixtral")
    out = tmp_path_factory.mktemp(f"chunked_fsdp{version}") / "run"
    proc = accelerate_launch(f"cpu_fsdp{version}_rehearsal.yaml", "chunked_loss_scenarios.py", "--models", str(models),
                             "--out", str(out), "--fsdp-version", str(version), timeout=600)  # fmt: skip
    check(proc)
    results = read_results(out)
    for rank in (0, 1):
        errors = {k: v["error"] for k, v in results[rank].items() if "error" in v}
        assert not errors, errors
    return version, out, results


def test_fsdp_chunked_loss_and_gradients_equal_stock(fsdp_runs):
    """FSDP engaged; with gradient accumulation and masked prompts the chunked loss (several chunks per micro-batch),
    its gradient shards and the eval loss equal the stock loss's, QLoRA (frozen head), full fine-tune (trained head)
    and a mixture of experts whose loss includes the router's auxiliary loss (issue 25.1) alike, and chunking adds no
    all-gather beyond the one-time probe."""
    version, out, results = fsdp_runs
    for rank in (0, 1):
        r = results[rank]
        for name in ("stock", "chunked", "full_stock", "full_chunked", "moe_stock", "moe_chunked"):
            assert r[name]["distributed_type"] == "DistributedType.FSDP"
            engaged = r[name]["engaged"]
            assert engaged.get("flat_params") if version == 1 else engaged.get("fsdp2_modules"), engaged
        assert r["stock"]["path"] == "stock" and r["chunked"]["path"] == "ours"
        assert len(r["stock"]["losses"]) == 2
        assert r["full_stock"]["path"] == "stock" and r["full_chunked"]["path"] == "ours"
        assert r["moe_stock"]["path"] == "stock" and r["moe_chunked"]["path"] == "ours"
        for name, oracle in (("chunked", "stock"), ("full_chunked", "full_stock"), ("moe_chunked", "moe_stock")):
            # full fine-tune: the bf16 head, updated from gradients one bf16 ulp apart, moves the later losses ~1e-5
            rtol = RTOL if name == "chunked" else 1e-4
            torch.testing.assert_close(r[name]["losses"], r[oracle]["losses"], rtol=rtol, atol=ATOL)
            assert r[name]["eval_loss"] == pytest.approx(r[oracle]["eval_loss"], rel=rtol)
            stock = torch.load(out / f"grads_{oracle}_rank{rank}.pt")
            got = torch.load(out / f"grads_{name}_rank{rank}.pt")
            assert stock and got.keys() == stock.keys()
            for key, value in stock.items():
                # A trained bf16 head's gradient: ours sums the chunks in float32 and rounds once, the stock matmul rounds
                # differently; bf16 rounding of each micro-batch's gradient: up to 2 ulp of its largest entries.
                head = "lm_head" in key
                atol = 1e-2 * float(value.abs().max()) if head else 1e-5
                torch.testing.assert_close(got[key], value, rtol=8e-3 if head else 1e-3, atol=atol, msg=key)
        # One unshard of the head for all its chunks: the run with several chunks per micro-batch issues exactly the
        # all-gathers of the stock run, which calls the head once. The one-time probe's forward is counted apart; a
        # gather it made can spare one of the run (FSDP1's first-forward gather, FSDP2's head unit kept unsharded:
        # measured 360 vs 361 and 39 vs 41), never add one.
        for name, oracle in (("chunked", "stock"), ("full_chunked", "full_stock"), ("moe_chunked", "moe_stock")):
            ours, probe, stock = r[name]["gathers_train"], r[name]["probe_gathers"], r[oracle]["gathers_train"]
            assert stock - probe <= ours <= stock and probe > 0 and r[oracle]["probe_gathers"] == 0, (name, ours)
    # the trained head's gradient was compared (its shard lives on one of the ranks under FSDP1)
    assert any("lm_head" in key for rank in (0, 1) for key in torch.load(out / f"grads_full_stock_rank{rank}.pt"))


def test_fsdp_trl_fused_head_equals_unfused_loss(fsdp_runs):
    """trl's SFTTrainer keeps its own fused LM head under our FSDP route, and its loss equals the unfused loss from
    the full logits of the same inputs and weights at every micro-batch."""
    _, _, results = fsdp_runs
    for rank in (0, 1):
        sft = results[rank]["sft"]
        assert sft["distributed_type"] == "DistributedType.FSDP" and sft["path"] == "sft"
        assert len(sft["fused"]) == 6  # 2 steps x 2 micro-batches, then 2 evaluation batches
        torch.testing.assert_close(sft["fused"], sft["unfused"], rtol=1e-4, atol=1e-5)


# --- the doctor plans the loss path the run takes ----------------------------------------------------------------

GIB = 2**30
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
    "vocab_size": 152064, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}  # fmt: skip


def _plans(model, **settings):
    from hf_fsdp_qlora.doctor import diagnose

    return {path: diagnose(model, loss_path=path, **settings).plan for path in ("stock", "ours", "sft", "dpo")}


def test_doctor_qwen2_7b_plan_drops_by_the_logits_term(tmp_path):
    """The issue's case: Qwen2-7B QLoRA, FSDP2, 2 x 24 GB, 8192 tokens. The stock loss path plans 25.7 GiB (13.92 GiB
    of logits; 25.6 before the adapters trained as float32 master weights, 4+4+8 bytes per adapter parameter); ours
    drops by exactly the logits it no longer holds and fits."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))
    plans = _plans(tmp_path, accelerate_config="fsdp2_qlora", quantization="4bit", seq_len=8192, num_gpus=2,
                   gpu_memory=24 * GIB)  # fmt: skip
    stock, ours = plans["stock"], plans["ours"]
    assert round(stock.parts["logits_loss"] / GIB, 2) == 13.92 and round(stock.total / GIB, 1) == 25.7
    assert stock.verdict == "does_not_fit" and ours.verdict == "fits"
    # one chunk: 512 tokens x 152064 x 12 bytes per logit, plus the labelled tokens' bf16 hidden states and their
    # gradient (the head is frozen: no weight gradient)
    assert ours.parts["logits_loss"] == DEFAULT_LOSS_CHUNK_SIZE * 152064 * 12 + 2 * 8192 * 3584 * 2
    assert stock.total - ours.total == stock.parts["logits_loss"] - ours.parts["logits_loss"]
    assert plans["sft"].parts["logits_loss"] == 4096 * 32768 * (2 + 4) + 8192 * 16  # one tile of trl's fused head
    # DPO: chosen + rejected, twice the activations of the same batch
    assert plans["dpo"].parts["activations"] > 1.9 * plans["sft"].parts["activations"]


def test_doctor_seed_002_llamaguard_full_finetune_replanned():
    """Seed 002: Llama Guard 3 1B full fine-tune on one 24 GB GPU at 4096 tokens (the shipped config)."""
    from pathlib import Path

    guard = Path(__file__).parent / "data" / "llamaguard3_1b_config.json"
    plans = _plans(guard, accelerate_config="llamaguard3_1b_1x24gb", full_finetune=True, seq_len=4096,
                   gpu_memory=24 * GIB)  # fmt: skip
    stock, ours = plans["stock"], plans["ours"]
    assert stock.parts["logits_loss"] == 4096 * 128256 * 12  # 5.87 GiB
    # one chunk (0.73 GiB), the hidden states and their gradient, the trained head's fp32 gradient (1.0 GiB) and
    # one chunk's bf16 product before it is added in (0.5 GiB)
    assert ours.parts["logits_loss"] == 512 * 128256 * 12 + 2 * 4096 * 2048 * 2 + 128256 * 2048 * (4 + 2)
    assert stock.total - ours.total == stock.parts["logits_loss"] - ours.parts["logits_loss"]
    assert ours.verdict == stock.verdict == "fits"


def test_doctor_cli_loss_path_changes_the_plan(capsys):
    import json
    from pathlib import Path

    from hf_fsdp_qlora.cli.main import main

    guard = str(Path(__file__).parent / "data" / "llamaguard3_1b_config.json")
    found = {}
    options = ([], ["--loss-path", "stock"], ["--trainer", "transformers"], ["--loss-path", "sft"],
               ["--trainer-class", "SFTTrainer"], ["--loss-chunk-size", "1024"])  # fmt: skip
    for option in options:
        args = ["doctor", "--accelerate-config", "llamaguard3_1b_1x24gb", "--model", guard, "--full-finetune",
                "--seq-len", "4096", "--gpu-memory", "24GB", "--json", *option]  # fmt: skip
        assert main(args) in (0, None)
        doc = json.loads(capsys.readouterr().out)
        found[" ".join(option)] = (doc["setup"]["loss_path"], doc["memory"]["per_gpu"]["logits_loss"])
    assert found[""][0] == "ours" and found["--trainer transformers"][0] == "stock"
    stock, ours, sft = (found[k][1] for k in ("--loss-path stock", "", "--loss-path sft"))
    assert stock == found["--trainer transformers"][1] == 4096 * 128256 * 12
    # a full fine-tune: ours holds the trained head's gradient (1.5 GiB of its 2.23 GiB)
    assert ours < stock / 2 and sft < stock / 7 and len({stock, ours, sft}) == 3
    # trl's sft.py under `python -m hf_fsdp_qlora.run`: its SFTTrainer's loss, not ours
    assert found["--trainer-class SFTTrainer"] == ("sft", sft)
    # the chunk size planned is the run's: 512 more tokens x vocab x 12 bytes
    assert found["--loss-chunk-size 1024"] == ("ours", ours + 512 * 128256 * 12)
    with pytest.raises(SystemExit) as err:
        main(["doctor", "--accelerate-config", "fsdp2_qlora", "--model", guard, "--loss-path", "fused"])
    assert err.value.code == 2


GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42,
    "vocab_size": 256000, "intermediate_size": 14336, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
}  # fmt: skip


def test_doctor_plans_the_stock_loss_a_softcapped_model_takes(tmp_path):
    """Issue 25.3: Gemma-2-9B (final_logit_softcapping), fsdp2_qlora, 2 x 24 GB, 8192 tokens. The run keeps the stock
    loss, so the default plan is the stock one (35.49 GiB with float32 adapter master weights - 35.28 with bf16 ones -
    does not fit) and says why. Before: "ours", 13.37 GiB, fits."""
    import json

    from hf_fsdp_qlora.doctor import diagnose

    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_9B))
    settings = dict(accelerate_config="fsdp2_qlora", quantization="4bit", seq_len=8192, num_gpus=2,  # noqa: C408
                    gpu_memory=24 * GIB)  # fmt: skip
    default = diagnose(tmp_path, **settings)
    stock = diagnose(tmp_path, loss_path="stock", **settings).plan
    assert default.plan.loss_path == "stock" and default.plan.total == stock.total
    assert round(stock.total / GIB, 2) == 35.49 and default.plan.verdict == "does_not_fit"
    assert any("final_logit_softcapping" in note for note in default.plan.notes)
    # trl's sft.py under `python -m hf_fsdp_qlora.run`: SFTTrainer's own loss runs
    assert diagnose(tmp_path, trainer_class="SFTTrainer", **settings).plan.loss_path == "sft"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_doctor_plans_the_path_the_trainer_takes(tmp_path, arch):
    """Issue 25.3: one predicate (hf_fsdp_qlora.loss_paths.loss_path): for the same config the doctor plans the path
    a live trainer takes; a soft-capped Gemma 2 keeps the stock loss, a Llama takes ours."""
    from tiny_models import tiny_config
    from transformers import Gemma2Config

    from hf_fsdp_qlora.doctor import diagnose
    from hf_fsdp_qlora.train.loss import trainer_loss_path

    if arch == "llama":
        config = tiny_config("llama", vocab_size=96)
    else:
        config = Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0)  # fmt: skip
    config.save_pretrained(tmp_path / "model")
    trainer = _trainer(tmp_path, _tiny_from(config), True)
    planned = diagnose(tmp_path / "model", accelerate_config="fsdp2_qlora", quantization="4bit").plan.loss_path
    assert trainer_loss_path(trainer) == planned == ("ours" if arch == "llama" else "stock")


def _peak_bytes(fn):
    """Peak bytes malloc holds (glibc's mallinfo2) above the level before `fn`, sampled after every aten op."""
    import ctypes

    from torch.utils._python_dispatch import TorchDispatchMode

    fields = (
        "arena",
        "ordblks",
        "smblks",
        "hblks",
        "hblkhd",
        "usmblks",
        "fsmblks",
        "uordblks",
        "fordblks",
        "keepcost",
    )

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in fields]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2")
    mallinfo2.restype = Info

    def in_use():
        info = mallinfo2()
        return info.uordblks + info.hblkhd  # heap blocks in use + mmapped blocks

    class Peak(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use() - self.base)
            return out

    mode = Peak()
    mode.base, mode.peak = in_use(), 0
    with mode:
        fn()
    return mode.peak


@pytest.mark.parametrize("trained", [True, False], ids=["full-finetune", "frozen-head"])
def test_plan_covers_what_the_chunked_loss_holds(trained):
    """Issue 25.4: the plan's `ours` logits term against the measured peak of the loss's forward (float32 head of
    8192 x 256, 512 tokens, chunks of 64, the chunk size the plan is given; float32: bf16 matmuls are emulated on
    CPUs without avx512_bf16). A trained head's fp32 weight gradient is held from the forward to the backward:
    measured 19.0 MiB, planned 23.0 MiB (before: 6.5 MiB; and the doctor planned the default chunk size whatever
    loss_chunk_size was)."""
    from hf_fsdp_qlora.loss_paths import logits_bytes

    vocab, hidden, tokens, chunk = 8192, 256, 512, 64
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(trained)
    states = torch.randn(1, tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))

    def run():
        head_loss(head.forward, states, labels, chunk, scale=1.0 / tokens)

    run()  # the first call allocates the matmul kernels' one-time state
    measured = _peak_bytes(run)
    planned = logits_bytes("ours", tokens, vocab, 4, hidden, chunk, head_trained=trained)
    assert measured <= planned <= 1.5 * measured, (measured / 2**20, planned / 2**20)
