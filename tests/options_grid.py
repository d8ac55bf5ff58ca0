"""The options sweep's grid (issue 49): options a user sets on TrainingArguments or the Trainer (rows) x settings this
package adds (columns). Read by the worker (tests/scripts/options_sweep.py), the test (tests/test_options.py) and the
page's generator (tests/make_options_table.py), so the three cannot disagree on what a cell is.

Every cell trains a tiny 4-bit Llama (NF4, float32 compute, all-linear LoRA r=4 from one initial adapter) for
STEPS optimizer steps on 2 ranks and is compared with the stock run in one process: transformers' ``Trainer`` and
stock peft (float32 adapters) on the same start, the same global batches and the same option. A cell is ``equal``
(within the tolerances below), ``refused`` (an error naming the option, raised before the first step) or a failure;
a combination that cannot exist is ``n/a`` by :func:`not_applicable`, never left blank.
"""

from __future__ import annotations

import re

STEPS = 3
SEQ = 16  # even: the sequence-parallel column splits it 8 + 8
TRAIN_ROWS = 12  # 3 steps x a global batch of 2, twice over for gradient accumulation 2: no remainder
EVAL_ROWS = 5  # odd: a remainder batch on 2 ranks, and under sp_size=2 with an evaluation batch of 2
LEARNING_RATE = 5e-2

# Tolerances against the stock run (float32 throughout; FSDP sums gradients in another order than one process):
# losses and metrics relative; the adapter's change relative to the size of the stock change, plus a few float32
# steps of the weight's own size (a clipped step changes a weight by less than its rounding).
LOSS_RTOL = 1e-4
ADAPTER_RTOL = 1e-3
ADAPTER_ULPS = 4
LOGITS_ATOL = 1e-4
# bitsandbytes' LLM.int8() matmul (the stock 8-bit forward) also quantizes the activations to int8; ours multiplies
# them unquantized by the dequantized weight (hf_fsdp_qlora/loading/int8.py): logits ~1% apart, losses within 1e-4.
LOGITS_ATOL_BY_MODEL = {"int8": 2e-2}


def _token_loss(logits, labels):
    """(sum of the next-token cross-entropy, labelled-token count) of one batch."""
    import torch.nn.functional as F

    logits = logits[..., :-1, :].float().reshape(-1, logits.shape[-1])
    targets = labels[..., 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), (targets != -100).sum()


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """A user's own causal-LM loss, as transformers' docs show ``compute_loss_func`` (sum over tokens, divided by
    the batch's labelled tokens): what stock computes by default, written out."""
    total, count = _token_loss(outputs["logits"], labels)
    return total / (num_items_in_batch if num_items_in_batch is not None else count)


def _share_dim(labels, groups: int) -> int:
    """The axis along which a global batch splits into the ranks' shares: rows, or (one packed row of every rank's
    sequences, padding-free) the tokens."""
    return 0 if labels.shape[0] >= groups else 1


def group_means_loss(groups: int):
    """The stock oracle of ``average_tokens_across_devices=False`` on `groups` data-parallel ranks, in one process:
    each rank's rows (a contiguous share of the global batch) divided by that rank's own labelled tokens, and the
    ranks' losses averaged (as the gradient all-reduce averages them)."""

    def loss(outputs, labels, num_items_in_batch=None):
        dim = _share_dim(labels, groups)
        parts = zip(outputs["logits"].chunk(groups, dim), labels.chunk(groups, dim))
        means = [total / count for total, count in (_token_loss(*part) for part in parts)]
        return sum(means) / len(means)

    return loss


def router_aux_loss(model, groups: int):
    """The stock oracle of a router aux loss on `groups` data-parallel ranks, in one process: the cross-entropy over
    the whole batch plus ``router_aux_loss_coef`` x the mean of each rank's own aux loss (the model's
    ``load_balancing_loss_func`` over that rank's share of the rows), what the ranks' averaged gradients give when
    the coefficient is kept (transformers issue #48690)."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    balancing = sys.modules[type(base).__module__].load_balancing_loss_func
    config = base.config
    experts, top_k, coef = config.num_experts, config.num_experts_per_tok, config.router_aux_loss_coef

    def loss(outputs, labels, num_items_in_batch=None):
        total, count = _token_loss(outputs["logits"], labels)
        # Router logits are [tokens, experts], rows after rows: either split is a split of the tokens
        shares = [
            balancing(parts, experts, top_k, None)
            for parts in zip(*(r.chunk(groups) for r in outputs["router_logits"]))
        ]
        return total / (num_items_in_batch if num_items_in_batch is not None else count) + coef * (
            sum(shares) / len(shares)
        )

    return loss


def gapped_positions(features):
    """Batches with user position ids that jump (0..7 then 12..19: two sequences by transformers' rule, a step other
    than 1 starts one) and no attention mask, as a padding-free collator hands them to the model."""
    import torch

    ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
    if "labels" in features[0]:
        labels = torch.stack([torch.as_tensor(f["labels"]) for f in features])
    else:  # trl's pre-tokenized rows: the completion mask says which targets count
        labels = ids.masked_fill(torch.stack([torch.as_tensor(f["completion_mask"]) for f in features]) == 0, -100)
    batch = {"input_ids": ids, "labels": labels}
    half = SEQ // 2
    positions = torch.cat([torch.arange(half), torch.arange(half) + half + 4])
    batch["position_ids"] = positions.expand(len(features), -1).clone()
    return batch


# A row's own model: a tiny Qwen3-MoE whose router aux loss joins the loss (16-bit experts, as stock loads them:
# bitsandbytes quantizes only nn.Linear), with transformers' keywords from_pretrained passes to its config.
# LoRA on the attention only: stock peft's all-linear also wraps the fused experts (as target_parameters), which
# this row does not compare (the family sweep and tests/test_moe.py do).
ROUTER_AUX = {
    "arch": "qwen3_moe",
    "config": {"output_router_logits": True, "router_aux_loss_coef": 1.0},
    "load": {"quantize_experts": False},
    "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
}
_LLAMA = {"arch": "llama", "config": {}, "load": {}, "lora": {}}

# name -> {"args": TrainingArguments settings, "trainer": Trainer keywords, "after": evaluation calls compared,
# "per_rank_mean": the option averages per data-parallel rank (its stock oracle: group_means_loss), "per_rank_aux":
# each rank's router aux loss is its own (the stock oracle: router_aux_loss), "resume": ours trains again from a fresh
# model resumed from its step-1 checkpoint (of 6 batches an epoch) and is compared as that run, "model": the
# row's own model (default: the tiny Llama)}.
OPTIONS = {
    "defaults": {},
    "gradient_accumulation_steps=2": {"args": {"gradient_accumulation_steps": 2}},
    "max_grad_norm=0.05 (clipping)": {"args": {"max_grad_norm": 0.05}},
    "weight_decay=0.5": {"args": {"weight_decay": 0.5}},
    "warmup + cosine schedule": {"args": {"warmup_steps": 1, "lr_scheduler_type": "cosine"}},
    "label_smoothing_factor=0.1": {"args": {"label_smoothing_factor": 0.1}},
    "compute_loss_func": {"trainer": {"compute_loss_func": causal_lm_loss}},
    "average_tokens_across_devices=False": {"args": {"average_tokens_across_devices": False}, "per_rank_mean": True},
    "position_ids with gaps": {
        "trainer": {"data_collator": gapped_positions},
        "args": {"remove_unused_columns": False},
    },
    "include_num_input_tokens_seen": {"args": {"include_num_input_tokens_seen": "all"}},
    "output_router_logits (Qwen3-MoE)": {"model": ROUTER_AUX, "per_rank_aux": True},
    "resume from a mid-epoch checkpoint": {"args": {"save_strategy": "steps", "save_steps": 1}, "resume": True},
    "evaluate, remainder batch": {"after": ("evaluate",)},
    "predict": {"after": ("predict",)},
}

# name -> {"version": FSDP version, "args": FSDPQLoRATrainingArguments settings, "batch"/"eval_batch": per-device
# train/eval batch, "dp": data-parallel groups, "packed": padding-free batches (DataCollatorWithFlattening), "model": the model variant (lora, dora, int8), "route": trainer (our
# FSDPQLoRATrainer against transformers' Trainer) or sft (trl's SFTTrainer both sides)}. Every column's global
# batch is 2: 2 data-parallel ranks x 1 row, or one sequence-parallel group of 2 ranks x 2 rows.
_PLAIN = {"args": {}, "batch": 1, "eval_batch": 1, "dp": 2, "model": "lora", "route": "trainer", "packed": False}
SETTINGS = {
    "FSDP1": {**_PLAIN, "version": 1},
    "FSDP2": {**_PLAIN, "version": 2},
    "FSDP2 + sp_size=2": {**_PLAIN, "version": 2, "args": {"sp_size": 2}, "batch": 2, "eval_batch": 2, "dp": 1},
    "FSDP2 + tiled_mlp": {**_PLAIN, "version": 2, "args": {"tiled_mlp": True, "tiled_mlp_tokens": 4}},
    "FSDP2 + chunked_loss": {**_PLAIN, "version": 2, "args": {"chunked_loss": True}},
    "FSDP2 + activation_offloading": {**_PLAIN, "version": 2, "args": {"activation_offloading": True}},
    "FSDP2 + DoRA": {**_PLAIN, "version": 2, "model": "dora"},
    "FSDP2 + 8-bit base": {**_PLAIN, "version": 2, "model": "int8"},
    # transformers' DataCollatorWithFlattening on both sides: each rank packs its 2 rows into one, stock its 4
    "FSDP2 + padding-free packing": {**_PLAIN, "version": 2, "batch": 2, "packed": True},
    # trl's SFTTrainer built by a script as stock (model loaded by from_pretrained + get_peft_model, SFTConfig,
    # completion-only loss on pre-tokenized rows), made ours by `accelerate launch -m hf_fsdp_qlora.run`
    "trl SFTTrainer (-m hf_fsdp_qlora.run)": {**_PLAIN, "version": 2, "route": "sft"},
}


# Options of issue 49's list that this grid does not hold yet, and where each is tested meanwhile (shown on the page).
NOT_IN_GRID = {
    "lora_dropout, attention dropout, neftune_noise_alpha": "random draws differ by layout between one process and "
    "ranks, so no run is equal; under sp_size each rank draws its own masks and NEFTune keeps one process's bound "
    "(tests/test_sequence_parallel.py)",
    "generate during evaluation": "tests/test_eval_generate.py",
    "trl assistant_only_loss": "needs a chat template with generation marks; completion_only_loss is trl's column's loss",
    "expert LoRA on a 4-bit MoE": "stock keeps 16-bit experts, so its oracle must hold our dequantized experts: "
    "tests/test_moe.py compares it with peft on those",
}


def option(name: str) -> dict:
    defaults = {"args": {}, "trainer": {}, "after": (), "per_rank_mean": False, "per_rank_aux": False, "resume": False}
    return {**defaults, "model": _LLAMA, **OPTIONS[name]}


def not_applicable(option_name: str, setting: str) -> str | None:
    """Why a cell cannot exist (shown in the table), or None: a row that brings its own data collator under a
    setting that is a data collator."""
    if SETTINGS[setting]["packed"] and "data_collator" in option(option_name)["trainer"]:
        return "the row's own data collator replaces the packing one"
    return None


def cells() -> list[tuple[str, str]]:
    return [(o, s) for s in SETTINGS for o in OPTIONS]


def _safe(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def cell_key(option_name: str, setting: str) -> str:
    """A file-name-safe key of a cell."""
    return _safe(f"{setting}__{option_name}")


def stock_run(option_name: str, setting: str) -> tuple:
    """(option, model variant, data-parallel groups, route, global batch, packed) of the stock run a cell is
    compared with: the groups matter only to an option that averages per rank."""
    column = SETTINGS[setting]
    row = option(option_name)
    groups = column["dp"] if row["per_rank_mean"] or row["per_rank_aux"] else 1
    return option_name, column["model"], groups, column["route"], global_batch(column), column["packed"]


def global_batch(column: dict) -> int:
    """Rows per optimizer micro-step over all ranks: per-device rows x data-parallel groups."""
    return column["batch"] * column["dp"]


def stock_runs() -> list[tuple]:
    """Every stock run the grid needs, in a stable order."""
    return sorted({stock_run(o, s) for o, s in cells() if not_applicable(o, s) is None})


def stock_key(run: tuple) -> str:
    name, model, groups, route, batch, packed = run
    return _safe(f"stock__{route}__{model}__dp{groups}__b{batch}{'_packed' if packed else ''}__{name}")


def init_file(folder, option_name: str, variant: str):
    """Where the stock run's initial adapter of `variant` on `option_name`'s model lies (one per variant and
    architecture): every run of that pair, stock and ours, starts from it."""
    from pathlib import Path

    return Path(folder) / f"init_{variant}_{option(option_name)['model']['arch']}.pt"
