"""Ulysses sequence parallelism (hf_fsdp_qlora.train.sequence_parallel, train/ulysses.py).

Single process: the batch split (labels shifted before it, padding to a multiple of sp_size, global positions),
the packed mask, and the refusals. Distributed: ONE 2-rank FSDP2 launch (gloo) of tests/scripts/
sequence_parallel_scenarios.py with sp_size=2, against the same scenarios run by one process on the whole sequence.

Measured (float32 compute, 4-bit NF4 base, LoRA r=4 on every linear layer, random lora_B): the first-step loss equal
(difference 0), every LoRA gradient within 2.0e-6 of its largest element (summation order only: the attention
runs on the same tokens, the partial gradients of the two ranks are summed by FSDP's reduce-scatter); the 8 logged
losses of the run within 1.7e-7 relative. Asserted with a 10x margin. A second launch runs the plain scenario and the
resume under FSDP1.
The same launch runs issue 49's options one step away (evaluation with a remainder batch, predict(), the router aux
loss, label smoothing, a compute_loss_func, position ids with a gap, LoRA dropout, NEFTune, num_input_tokens_seen):
each equal to the one-process run (dropout and NEFTune: drawn as one process draws them), figures in
docs/long-context.md.

trl's sft.py: ONE forked 2-rank FSDP2 launch of trl's installed script, unchanged (tests/scripts/sequence_parallel_sft.py
runs it by runpy and records), through `-m hf_fsdp_qlora.run` with `parallelism_config_sp_size: 2` in the accelerate
config, against one process running trl's loss in this test process (see the test for the figures). The launcher's
settings and their refusals are checked without a launch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_fsdp_qlora.errors import UnsupportedSetupError
from hf_fsdp_qlora.train.sequence_parallel import check_sequence_parallel, split_batch
from hf_fsdp_qlora.train.ulysses import _packed_mask

LOSS_RTOL = 2e-6
GRAD_TOL = 2e-5  # max |difference| / max |oracle gradient|, per tensor
SCENARIOS = ("plain", "ckpt", "packed", "gqa")


# --- single process ---------------------------------------------------------------------------------------------


def test_split_shifts_labels_before_splitting_and_pads():
    ids = torch.arange(10, 25).unsqueeze(0)  # 15 tokens: padded to 16, split 8 + 8
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    first, positions, count = split_batch(batch, 2, 0)
    second, _, _ = split_batch(batch, 2, 1)
    assert positions is None and int(count) == 12  # labels 3..14 are the targets of tokens 2..13
    assert first["input_ids"].tolist() == [list(range(10, 18))]
    assert second["input_ids"].tolist() == [[*range(18, 25), 0]]
    # the target of the last token of rank 0 (position 7) is the first token of rank 1: not lost at the boundary
    assert int(first["shift_labels"][0, -1]) == 18
    assert second["shift_labels"][0, -2:].tolist() == [-100, -100]  # the last real token and the pad: no target
    assert second["position_ids"].tolist() == [list(range(8, 16))]  # global positions for RoPE
    assert "attention_mask" not in first and torch.equal(first["labels"], first["shift_labels"])


def test_split_keeps_packed_positions_and_refuses_padding():
    ids = torch.arange(8).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    local, packed, _ = split_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, 2, 1)
    assert torch.equal(packed, positions) and local["position_ids"].tolist() == [[1, 0, 1, 2]]
    padded = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1] * 6 + [0] * 2])}
    with pytest.raises(UnsupportedSetupError, match=r"sp_size=2\) with a padded batch"):
        split_batch(padded, 2, 0)
    with pytest.raises(UnsupportedSetupError, match="per-token input 'token_type_ids'"):
        split_batch({"input_ids": ids, "labels": ids, "token_type_ids": ids}, 2, 0)


def test_packed_sequences_follow_transformers_rule():
    """Issue 49, row 5: a new packed sequence starts wherever the position does not step by exactly 1 (a gap, a reset,
    a repeat), as transformers' masking_utils decides; and, as there, only without an attention mask."""
    from transformers.masking_utils import find_packed_sequence_indices

    from hf_fsdp_qlora.train.ulysses import document_ids

    for row in ([*range(8), *range(12, 20)], [0, 1, 2, 0, 1, 2, 3], [3, 4, 5, 6], [0, 1, 1, 2], [0, 2, 1, 2]):
        positions = torch.tensor([row])
        want = find_packed_sequence_indices(positions)
        assert torch.equal(document_ids(positions), torch.zeros_like(positions) if want is None else want), row
    ids = torch.arange(16).unsqueeze(0)
    gaps = torch.cat([torch.arange(8), torch.arange(12, 20)]).unsqueeze(0)
    _, packed, _ = split_batch({"input_ids": ids, "labels": ids, "position_ids": gaps}, 2, 0)
    assert torch.equal(packed, gaps)  # two sequences: the mask keeps them apart
    masked = {"input_ids": ids, "labels": ids, "position_ids": gaps, "attention_mask": torch.ones_like(ids)}
    local, packed, _ = split_batch(masked, 2, 1)
    assert packed is None and local["position_ids"].tolist() == [list(range(12, 20))]  # one causal sequence


def test_evaluation_refusals_name_the_setting():
    """Under sp_size: evaluation batches without labels (the split happens where the loss is computed) and
    eval_use_gather_object=True (evaluation keeps one rank per group of gathered tensors) are refused by name."""
    from types import SimpleNamespace

    from hf_fsdp_qlora.train import sp_outputs, ulysses
    from hf_fsdp_qlora.train.sequence_parallel import _refuse_gather_object

    with pytest.raises(UnsupportedSetupError, match=r"sp_size=2\) with eval_use_gather_object=True.*=False"):
        _refuse_gather_object(SimpleNamespace(eval_use_gather_object=True), 2)
    ulysses.set_active_group(ulysses.UlyssesGroup(sp_size=2, group=None))
    try:
        with pytest.raises(UnsupportedSetupError, match=r"sp_size=2\): evaluate\(\)/predict\(\) on a batch without"):
            sp_outputs.prediction_step(
                SimpleNamespace(label_names=["labels"]), None, None, {"input_ids": torch.ones(1, 4)}, False,
                setting="FSDPQLoRATrainingArguments(sp_size=2)",
            )  # fmt: skip
    finally:
        ulysses.set_active_group(None)


def test_packed_mask_is_causal_within_each_sequence():
    mask = _packed_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def _model():
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")


def test_refusals_name_the_setting():
    model = _model()
    assert check_sequence_parallel(model, 2, 4) == "sdpa"
    with pytest.raises(UnsupportedSetupError, match=r"sp_size=3\) on 4 processes"):
        check_sequence_parallel(model, 3, 4)
    with pytest.raises(UnsupportedSetupError, match="num_attention_heads=4, not divisible"):
        check_sequence_parallel(model, 8, 8)
    model.config._attn_implementation = "eager"
    with pytest.raises(UnsupportedSetupError, match="attn_implementation='eager'"):
        check_sequence_parallel(model, 2, 2)
    from transformers import AutoModelForCausalLM, MistralConfig

    mistral = AutoModelForCausalLM.from_config(
        MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, sliding_window=8),
        attn_implementation="sdpa",
    )  # fmt: skip
    with pytest.raises(UnsupportedSetupError, match="sliding_attention layers"):
        check_sequence_parallel(mistral, 2, 2)


# --- 2 ranks, FSDP2, sp_size=2, against one process on the whole sequence ---------------------------------------


def _build_one_kv_head(path):
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.num_key_value_heads = 1  # fewer key/value heads than sp_size=2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dist_utils import accelerate_launch, check, read_results, run_single
    from tiny_models import build_tiny_model

    models = tmp_path_factory.mktemp("models")
    build_tiny_model(models / "llama")
    build_tiny_model(models / "qwen3_moe", arch="qwen3_moe")
    _build_one_kv_head(models / "llama_kv1")
    out = tmp_path_factory.mktemp("sp") / "run"
    proc = accelerate_launch(
        "cpu_fsdp2_rehearsal.yaml", "sequence_parallel_scenarios.py", "--models", str(models), "--out", str(out),
        timeout=500,
    )  # fmt: skip
    check(proc)
    # The oracle: one plain process, forked from the fork server (dist_utils.run_single: its imports spared).
    check(run_single("sequence_parallel_scenarios.py", "--models", str(models), "--out", str(out), "--single",
                     timeout=400))  # fmt: skip
    import json

    return out, read_results(out), json.loads((out / "single.json").read_text()), models


@pytest.mark.parametrize("name", SCENARIOS)
def test_sp2_under_fsdp2_equals_one_process_on_the_whole_sequence(runs, name):
    out, ranks, single, _ = runs
    assert set(ranks) == {0, 1}
    oracle = single[name]
    assert "error" not in oracle, oracle.get("error")
    for rank, found in ranks.items():
        assert "error" not in found[name], found[name].get("error")
        got = found[name]
        assert got["distributed_type"] == "DistributedType.FSDP" and got["world"] == 2
        assert got["engaged"]["fsdp2_modules"] > 0 and got["dtensor_params"] > 0, got["engaged"]  # FSDP2 engaged
        assert (got["checkpointed"] > 0) == (name == "ckpt"), got["checkpointed"]
        assert (got["offload_packed"] > 0) == (name == "packed"), got["offload_packed"]  # offloading engaged
        assert len(got["losses"]) == 8
        torch.testing.assert_close(got["losses"], oracle["losses"], rtol=LOSS_RTOL, atol=0)
        if name == "plain":  # evaluation after training: the eval dataloader is sharded by group too
            assert got["eval_loss"] == pytest.approx(oracle["eval_loss"], rel=LOSS_RTOL)
    grads = torch.load(out / f"grads_{name}_sp2.pt")
    want = torch.load(out / f"grads_{name}_sp1.pt")
    assert set(grads) == set(want) and len(want) == 2 * 7 * 2  # lora_A and lora_B of 7 linears in 2 layers
    k_out = next(v for k, v in want.items() if "k_proj.lora_B" in k).shape[0]
    assert k_out == (16 if name == "gqa" else 32)  # head_dim 16: the gqa model has 1 key/value head, the others 2
    for key, ref in want.items():
        scale = float(ref.abs().max())
        assert scale > 0, key  # random lora_B at start (init_lora_weights=False): no gradient is trivially 0
        error = float((grads[key] - ref).abs().max())
        assert error <= GRAD_TOL * max(scale, 1e-12), (key, error, scale)


def _assert_engaged(got):
    assert got["distributed_type"] == "DistributedType.FSDP" and got["world"] == 2
    assert got["engaged"]["fsdp2_modules"] > 0 and got["dtensor_params"] > 0, got["engaged"]


def test_sp2_evaluation_and_predict_equal_one_process(runs):
    """Issue 49, rows 1-2: evaluation on 5 samples in batches of 2 (a remainder batch: was 5.599060 against one
    process's 5.563670, one rank's partial loss kept), the same with the predictions (compute_metrics), and predict():
    the stock shapes (were [8, 8, 256] / [8, 16], half-sequences taken for batch rows) and values."""
    out, ranks, single, _ = runs
    oracle = single["plain"]
    for found in ranks.values():
        got = found["plain"]
        assert "error" not in got, got.get("error")
        _assert_engaged(got)
        assert got["eval5_loss"] == pytest.approx(oracle["eval5_loss"], rel=LOSS_RTOL)
        metrics, want = got["eval5_metrics"], oracle["eval5_metrics"]
        assert metrics["eval_rows"] == want["eval_rows"] == 5 and metrics["eval_label_sum"] == want["eval_label_sum"]
        assert metrics["eval_loss"] == pytest.approx(want["eval_loss"], rel=LOSS_RTOL)
        assert metrics["eval_logit_sum"] == pytest.approx(want["eval_logit_sum"], rel=1e-5, abs=1e-2)
        assert got["predict_shapes"] == oracle["predict_shapes"] == [[4, 15, 256], [4, 15]]
        assert got["predict_loss"] == pytest.approx(oracle["predict_loss"], rel=LOSS_RTOL)
        # include_num_input_tokens_seen: a group's shared batches counted once (were counted sp_size times)
        assert got["num_input_tokens_seen"] == oracle["num_input_tokens_seen"] == 8 * 2 * 2 * 15
    got, want = torch.load(out / "predict_plain_sp2.pt"), torch.load(out / "predict_plain_sp1.pt")
    assert torch.equal(got["label_ids"], want["label_ids"])
    torch.testing.assert_close(got["predictions"], want["predictions"], rtol=1e-5, atol=1e-5)


# Issue 49, rows 3-5 (first loss ours vs one process, before the fix): the router aux loss (9.693460 / aux 4.221398 vs
# 7.577868 / 2.105806), label smoothing and a compute_loss_func (labels shifted twice), position ids with a gap.
OPTION_SCENARIOS = ("moe_aux", "smooth", "loss_func", "gaps")


@pytest.mark.parametrize("name", OPTION_SCENARIOS)
def test_sp2_options_equal_one_process(runs, name):
    out, ranks, single, _ = runs
    oracle = single[name]
    assert "error" not in oracle, oracle.get("error")
    for found in ranks.values():
        got = found[name]
        assert "error" not in got, got.get("error")
        _assert_engaged(got)
        assert len(got["losses"]) == 2
        torch.testing.assert_close(got["losses"], oracle["losses"], rtol=LOSS_RTOL, atol=0)
        if name == "moe_aux":
            assert oracle["first_aux"] > 1.0  # coefficient 1.0: the aux loss is a visible part of the loss
            assert got["first_aux"] == pytest.approx(oracle["first_aux"], rel=LOSS_RTOL)
    grads, want = torch.load(out / f"grads_{name}_sp2.pt"), torch.load(out / f"grads_{name}_sp1.pt")
    assert set(grads) == set(want) and want
    for key, ref in want.items():
        scale = float(ref.abs().max())
        assert scale > 0, key
        assert float((grads[key] - ref).abs().max()) <= GRAD_TOL * scale, key


def test_sp2_ranks_draw_their_own_dropout_masks(runs):
    """Issue 49's suspicion, measured: one process draws its dropout masks independently along the whole sequence; the
    two ranks of a group, seeded alike by the Trainer, drew the same mask for their two halves (before the fix: equal,
    element for element). Each rank now draws from a stream of its own: the halves differ, each at the rate asked."""
    _, ranks, single, _ = runs
    assert "error" not in single["dropout"], single["dropout"].get("error")
    whole = torch.tensor(single["dropout"]["first_dropout_mask"])  # [2, 15, 64]: one process, the whole sequence
    halves = [torch.tensor(ranks[r]["dropout"]["first_dropout_mask"]) for r in (0, 1)]  # [2, 8, 64] each
    assert whole.shape == (2, 15, 64) and all(h.shape == (2, 8, 64) for h in halves)
    assert not torch.equal(whole[:, :7], whole[:, 8:15])  # one process: independent along the sequence
    assert not torch.equal(halves[0][:, :7], halves[1][:, :7])  # the group's ranks: independent too
    for mask in (whole, *halves):
        assert 0.05 < mask.float().mean() < 0.15, mask.float().mean()  # lora_dropout=0.1
    for found in ranks.values():
        assert "error" not in found["dropout"], found["dropout"].get("error")
        assert len(found["dropout"]["losses"]) == 2 and all(torch.isfinite(torch.tensor(found["dropout"]["losses"])))


def test_sp2_checkpointing_recomputes_each_rank_own_dropout_masks(runs):
    """LoRA dropout 0.1 under FSDP's activation checkpointing: each rank's recomputation in backward draws the masks
    its forward drew from the rank's own stream (train/sp_random.py), so the gradients equal the same run without
    checkpointing. accelerate 1.15's FSDP2 wrappers (preserve_rng_state=False) recomputed from the shared generator."""
    out, ranks, _, _ = runs
    for found in ranks.values():
        with_ckpt, without = found["dropout_ckpt"], found["dropout"]
        assert "error" not in with_ckpt, with_ckpt.get("error")
        _assert_engaged(with_ckpt)
        assert with_ckpt["checkpointed"] > 0 and without["checkpointed"] == 0
        assert with_ckpt["losses"] == without["losses"]
    grads, want = torch.load(out / "grads_dropout_ckpt_sp2.pt"), torch.load(out / "grads_dropout_sp2.pt")
    assert set(grads) == set(want) and want
    for key, ref in want.items():
        assert float(ref.abs().max()) > 0, key
        torch.testing.assert_close(grads[key], ref, rtol=1e-5, atol=1e-7, msg=key)


def test_sp2_neftune_noise_has_one_process_bound(runs):
    """NEFTune bounds its noise by alpha / sqrt(tokens x hidden) of the embeddings it sees: one process sees 15 tokens,
    each rank 8 (before the fix its noise reached 1.37x one process's bound). The largest of the first forward's
    noise is within one process's bound, and near it (the largest of 1,024 or more uniform draws)."""
    _, ranks, single, _ = runs
    bound = 5.0 / (15 * 64) ** 0.5  # neftune_noise_alpha=5, 15 tokens, hidden size 64
    for found in (single["neftune"], *(r["neftune"] for r in ranks.values())):
        assert "error" not in found, found.get("error")
        assert 0.98 * bound <= found["first_noise_max"] <= bound * (1 + 1e-6), (found["first_noise_max"], bound)


def test_resume_under_sp2_is_bit_exact(runs):
    """A run with sp_size=2 under FSDP2 checkpointed at step 2 (AdamW) and resumed by a fresh trainer: steps 3 and 4
    log the uninterrupted run's losses and end with its adapter, bit for bit. The same after a preemption: SIGUSR1 on
    every rank after step 2, every rank saves checkpoint-3 and stops; the resumed run runs step 4 only."""
    out, ranks, _, _ = runs
    for found in ranks.values():
        got = found["resume"]
        assert "error" not in got, got.get("error")
        # the resumed trainer's history: steps 1-2 read from the checkpoint, steps 3-4 computed after the resume
        assert len(got["whole"]) == 4 and got["resumed"] == got["whole"]
        assert got["whole_steps_run"] == [1, 2, 3, 4] and got["resumed_steps_run"] == [3, 4]  # it did resume
        assert got["preempted_steps_run"] == [1, 2, 3] and got["preempted_checkpoints"] == ["checkpoint-3"]
        assert got["preempt_resumed_steps_run"] == [4] and got["preempt_resumed"] == got["whole"]
    whole = torch.load(out / "resume_whole.pt")
    for resumed in ("resume_resumed.pt", "resume_preempt_resumed.pt"):
        resumed = torch.load(out / resumed)
        assert set(whole) == set(resumed) and whole
        for key, value in whole.items():
            assert torch.equal(resumed[key], value), key


def test_stock_sequence_parallelism_is_deepspeed_only():
    """Canary (_compat ulysses_sequence_parallel): accelerate's ParallelismConfig knows sp_size, but only with the
    DeepSpeed backend; when it accepts another, read whether FSDP2 sequence parallelism can move upstream."""
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match=r"sp_backend must be one of \['deepspeed'\]"):
        ParallelismConfig(sp_size=2, sp_backend="fsdp")


@pytest.mark.parametrize("route", ["ours", "stock", "sft", "own_loss"])
def test_sp_size_is_never_ignored(tmp_path, route):
    """sp_size > 1 works through our trainer mixin's hooks only: a stock Trainer given it adopts the mixin (so the
    setting is honoured or refused, never ignored); trl's SFTTrainer takes it (here refused only for running in one
    process); a trainer with another loss of its own is refused by name."""
    from transformers import Trainer

    from hf_fsdp_qlora import FSDPQLoRASFTTrainer, FSDPQLoRATrainer, FSDPQLoRATrainingArguments

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], sp_size=2)  # noqa: C408
    match = r"sp_size=2\) in a single process"
    if route == "sft":
        from trl import SFTConfig

        args = SFTConfig(**{k: v for k, v in common.items() if k != "sp_size"}, bf16=False)
        args.sp_size = 2
        kind = FSDPQLoRASFTTrainer
    else:
        args = FSDPQLoRATrainingArguments(**common)
        kind = {"ours": FSDPQLoRATrainer, "stock": Trainer}.get(route)
    if route == "own_loss":

        class OwnLoss(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        kind, match = OwnLoss, "with OwnLoss, which computes its own loss"
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8]] * 2})
    with pytest.raises(UnsupportedSetupError, match=match):
        extra = {}
        if route == "sft":
            from tiny_models import build_tokenizer

            extra["processing_class"] = build_tokenizer()
        kind(model=_model(), args=args, train_dataset=data, **extra)


def test_sp2_under_fsdp1_equals_one_process(runs, tmp_path):
    """The same under FSDP1 (FlatParameters, one launch): the plain scenario's 8 losses and evaluations (a remainder
    batch, predict(), the token count) equal the oracle's (measured within 8.6e-8; eval equal), and the sp_size=2
    resume is bit-exact. (FSDP1's gradients are flat shards: the gradients are compared under FSDP2 above.)"""
    from dist_utils import accelerate_launch, check, read_results

    _, _, single, models = runs
    proc = accelerate_launch(
        "cpu_fsdp1_rehearsal.yaml", "sequence_parallel_scenarios.py", "--models", str(models), "--out",
        str(tmp_path / "run"), "--scenarios", "plain", timeout=500,
    )  # fmt: skip
    check(proc)
    for found in read_results(tmp_path / "run").values():
        got, oracle = found["plain"], single["plain"]
        assert "error" not in got, got.get("error")
        assert got["engaged"]["flat_params"] > 0 and got["distributed_type"] == "DistributedType.FSDP"
        torch.testing.assert_close(got["losses"], oracle["losses"], rtol=LOSS_RTOL, atol=0)
        assert got["eval_loss"] == pytest.approx(oracle["eval_loss"], rel=LOSS_RTOL)
        assert got["eval5_loss"] == pytest.approx(oracle["eval5_loss"], rel=LOSS_RTOL)  # a remainder batch
        assert got["predict_shapes"] == oracle["predict_shapes"] and got["predict_loss"] == pytest.approx(
            oracle["predict_loss"], rel=LOSS_RTOL
        )
        assert got["num_input_tokens_seen"] == oracle["num_input_tokens_seen"]
        resume = found["resume"]
        assert resume["resumed"] == resume["whole"] and resume["resumed_steps_run"] == [3, 4], resume
        assert resume["preempt_resumed"] == resume["whole"] and resume["preempt_resumed_steps_run"] == [4], resume


# --- trl's sft.py, unchanged, through `-m hf_fsdp_qlora.run`, sp_size=2 from the accelerate config -----------------

SFT_STEPS = 8
# Measured over the 8 steps (two runs): loss 1.08e-7, entropy 1.05e-7, gradient norm 1.13e-7 relative, token accuracy
# equal, every LoRA gradient within 5.2e-7 of its largest element. Asserted with about a 10x margin.
SFT_RTOL = 1e-6
SFT_GRAD_TOL = 5e-6


def test_launcher_reads_sp_size_by_name():
    """The launcher's two forms (HF_FSDP_QLORA_SP_SIZE, the accelerate config's parallelism_config_sp_size as accelerate
    launch exports it), and each bad value refused by name (hf_fsdp_qlora.run exits 2 with the message)."""
    from hf_fsdp_qlora.train.launcher import hand_over_accelerate_sp_size, sp_size_from_env

    assert sp_size_from_env({}) == (1, None)
    assert sp_size_from_env({"HF_FSDP_QLORA_SP_SIZE": "2"}) == (
        2,
        "HF_FSDP_QLORA_SP_SIZE=2 (read by hf_fsdp_qlora.run)",
    )
    accelerate = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
                  "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "1"}  # fmt: skip
    assert sp_size_from_env(accelerate)[0] == 2
    hand_over_accelerate_sp_size(accelerate)  # ours from here on: accelerate builds no mesh and refuses nothing
    assert (
        accelerate["PARALLELISM_CONFIG_SP_SIZE"] == "1" and accelerate["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"
    )
    hsdp = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
            "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}  # fmt: skip
    hand_over_accelerate_sp_size(hsdp)  # the HSDP mesh stays accelerate's
    assert hsdp["PARALLELISM_CONFIG_SP_SIZE"] == "1" and hsdp["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert sp_size_from_env({"ACCELERATE_USE_DEEPSPEED": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}) == (1, None)
    for env, match in [
        ({"HF_FSDP_QLORA_SP_SIZE": "two"}, r"HF_FSDP_QLORA_SP_SIZE='two': sp_size must be a whole number >= 1"),
        ({"HF_FSDP_QLORA_SP_SIZE": "0"}, r"HF_FSDP_QLORA_SP_SIZE='0'"),
        ({"PARALLELISM_CONFIG_SP_SIZE": "-2"}, r"parallelism_config_sp_size='-2'"),
        ({"HF_FSDP_QLORA_SP_SIZE": "2", "PARALLELISM_CONFIG_SP_SIZE": "4"}, "disagree: set one"),
        ({"PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "2"}, "parallelism_config_cp_size=2"),
        ({"HF_FSDP_QLORA_SP_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, "under a DeepSpeed launch"),
    ]:
        with pytest.raises(ValueError, match=match):
            sp_size_from_env(env)
    proc = subprocess.run(
        [sys.executable, "-m", "hf_fsdp_qlora.run", __file__], env={**_clean_env(), "HF_FSDP_QLORA_SP_SIZE": "x"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "hf_fsdp_qlora.run: HF_FSDP_QLORA_SP_SIZE='x'" in proc.stderr, proc.stderr[-2000:]


def _clean_env():
    from dist_utils import _env

    return _env()


def _sft_args(model, data, out):
    # float32 compute and no LoRA dropout, so one process on the whole sequence is an exact oracle; trl's packing
    # (padding-free rows of up to 81 tokens: three 27-token conversations, so an odd length the split pads); lr 1e-3 so lora_B leaves zero after the first step.
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
        "--use_peft", "--load_in_4bit", "--dtype", "float32", "--bf16", "False", "--lora_dropout", "0",
        "--lora_target_modules", "all-linear", "--packing", "--max_length", "81", "--per_device_train_batch_size", "1",
        "--max_steps", str(SFT_STEPS), "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none",
        "--save_strategy", "no", "--seed", "0",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """One forked 2-rank FSDP2 launch: `-m hf_fsdp_qlora.run` of tests/scripts/sequence_parallel_sft.py (trl's sft.py
    via runpy), the accelerate config being the CPU FSDP2 rehearsal plus `parallelism_config_sp_size: 2`."""
    from dist_utils import CONFIGS, check, launch_via_run
    from recipe_fixtures import build_chat_dataset, build_recipe_model

    root = tmp_path_factory.mktemp("sp_sft")
    model, data = build_recipe_model(root / "model"), build_chat_dataset(root / "chat")
    config = root / "cpu_fsdp2_sp2.yaml"
    config.write_text(
        (CONFIGS / "cpu_fsdp2_rehearsal.yaml").read_text().rstrip("\n")
        + "\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
    )
    out = root / "record"
    proc = launch_via_run(config, "sequence_parallel_sft.py", str(out), *_sft_args(model, data, root / "sft"),
                          timeout=400, fork=True)  # fmt: skip
    check(proc)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    return model, root / "sft", ranks, torch.load(out / "steps.pt"), proc.stdout + proc.stderr


def _sft_oracle(model_dir, steps):
    """One process, no FSDP, no sequence parallelism, trl's own loss path (its fused LM head) on each recorded step:
    the same base (same 4-bit quantization of the same checkpoint), the LoRA weights that step ran with, the whole
    batch. Returns, per step, the loss, entropy and token accuracy as trl computes them, the gradient norm before
    clipping, and the gradients after the Trainer's clipping (max_grad_norm=1.0, trl's default)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import ModelConfig, get_peft_config, get_quantization_config
    from trl.trainer.utils import add_fused_lm_head

    margs = ModelConfig(
        model_name_or_path=str(model_dir), dtype="float32", load_in_4bit=True, use_peft=True, lora_dropout=0.0,
        lora_target_modules=["all-linear"],
    )  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(
        str(model_dir), quantization_config=get_quantization_config(margs), dtype=torch.float32
    )
    model = get_peft_model(base, get_peft_config(margs))
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    model.train()
    params = dict(model.named_parameters())
    found = []
    for step in steps:
        for name, value in step["weights"].items():
            params[name].data.copy_(value)
            params[name].grad = None
        out = model(**step["batch"], use_cache=False, fused_lm_head=True)
        out.loss.backward()
        trainable = [params[n] for n in step["weights"]]
        norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        valid = out.label_mask.sum()
        found.append({
            "loss": float(out.loss.detach()), "entropy": float(out.entropy.detach().sum() / valid),
            "accuracy": float(out.is_top1.sum() / valid), "grad_norm": float(norm),
            "grads": {n: params[n].grad.detach().clone() for n in step["weights"]},
        })  # fmt: skip
    return found


def test_trl_sft_py_under_sp2_equals_one_process(sft_run):
    """trl's sft.py, unchanged, through `-m hf_fsdp_qlora.run` with `parallelism_config_sp_size: 2` in the accelerate
    config (2 ranks, gloo, FSDP2): every one of the 8 steps' loss, entropy, token accuracy, gradient norm and every LoRA
    gradient equal one process running trl's loss on the whole batch from the same weights; FSDP2 and sequence
    parallelism engaged (each rank embedded half of each batch's tokens)."""
    model_dir, sft_out, ranks, steps, text = sft_run
    assert "hf_fsdp_qlora: FSDP2 engaged on 2 rank(s)" in text
    for rank, found in ranks.items():
        assert found["trainer"] == "SFTTrainer" and found["sp_size"] == 2 and found["world"] == 2
        assert found["distributed_type"] == "DistributedType.FSDP" and found["parallelism_config"] == "None"
        assert found["engaged"]["fsdp2_modules"] > 0 and found["dtensor_params"] > 0, found["engaged"]
        whole, local = found["whole_tokens"], found["local_tokens"]
        assert len(whole) == len(local) == SFT_STEPS, (whole, local)
        assert local == [(n + n % 2) // 2 for n in whole], (whole, local)  # half of each (padded) batch
    assert ranks[0]["whole_tokens"] == ranks[1]["whole_tokens"]  # the group's two ranks shared each batch
    assert any(n % 2 for n in ranks[0]["whole_tokens"])  # a row padded for the split
    logged = {e["step"]: e for e in ranks[0]["log_history"] if "loss" in e}
    assert sorted(logged) == list(range(1, SFT_STEPS + 1)) and len(steps) == SFT_STEPS
    assert any((steps[0]["batch"]["position_ids"][0, 1:] == 0).tolist())  # packed: two conversations per row
    oracle = _sft_oracle(model_dir, steps)
    report = {"loss": 0.0, "entropy": 0.0, "accuracy": 0.0, "grad_norm": 0.0, "grad": 0.0}
    for index, (step, want) in enumerate(zip(steps, oracle), start=1):
        got = logged[index]
        for key, name in (("loss", "loss"), ("entropy", "entropy"), ("accuracy", "mean_token_accuracy"),
                          ("grad_norm", "grad_norm")):  # fmt: skip
            report[key] = max(report[key], abs(got[name] - want[key]) / max(abs(want[key]), 1e-12))
        assert set(step["grads"]) == set(want["grads"]) and len(want["grads"]) == 2 * 7 * 2
        for name, ref in want["grads"].items():
            scale = float(ref.abs().max())
            assert scale > 0 or index == 1, name  # lora_B starts at zero: lora_A's first gradient is zero
            error = float((step["grads"][name] - ref).abs().max())
            report["grad"] = max(report["grad"], error / max(scale, 1e-30) if scale else error)
    print("trl sft.py sp_size=2 vs one process:", report)
    assert max(report["loss"], report["entropy"], report["grad_norm"]) <= SFT_RTOL and report["accuracy"] == 0.0, (
        report
    )
    assert report["grad"] <= SFT_GRAD_TOL, report
    assert (sft_out / "adapter_model.safetensors").is_file()
