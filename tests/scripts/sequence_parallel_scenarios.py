"""Worker for tests/test_sequence_parallel.py: Ulysses sequence parallelism (sp_size=2) under FSDP2, 2 ranks, one
launch, and the same scenarios single-process (the oracle: one process training on the whole sequence).

Scenarios (tiny 4-bit NF4 + LoRA Llama, float32 compute, 15-token samples with prompts masked, so the sequence is
padded to 16 and split 8 + 8; gradient accumulation 2; 8 SGD steps; our FSDPQLoRATrainer):
``plain`` (chunked loss, no activation checkpointing), ``ckpt`` (the model's activation checkpointing, tiled MLP
of 4-token tiles, transformers' stock loss), ``packed`` (padding-free packing: DataCollatorWithFlattening's
position ids, several sequences per row, with activation offloading's hooks: on CPU every saved tensor stays, so
they prove the composition, not the transfer), ``gqa`` (a model with one key/value head: replicated for sp_size=2).
``plain`` also evaluates after training (the eval dataloader sharded by group too): on the whole set, on 5 samples
in batches of 2 (a remainder batch), with ``prediction_loss_only=False`` (a ``compute_metrics`` over the predictions),
and ``predict()`` (predictions and label ids written to predict_<name>_sp<N>.pt by rank 0).
Options one step away (issue 49), 2 steps each: ``moe_aux`` (tiny Qwen3-MoE, ``output_router_logits=True``,
``router_aux_loss_coef=1.0``: the router aux loss of the first forward recorded), ``smooth``
(``label_smoothing_factor=0.1``), ``loss_func`` (a causal-LM ``compute_loss_func``), ``gaps`` (user ``position_ids``
with a gap, ``[0..7, 12..19]``: transformers starts a new sequence wherever the step is not 1), ``dropout`` (LoRA
dropout 0.1: the first mask each rank draws recorded), ``neftune`` (``neftune_noise_alpha=5``: the largest noise of
the first forward recorded).
Each rank writes rank<N>.json (logged losses, FSDP engagement) and rank 0
grads_<name>.pt (every LoRA gradient at the first optimizer step, gathered whole).

``--single``: the same scenarios with sp_size=1 in this one process, no FSDP (the oracle).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as ts
from dist_utils import whole_grads

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before the arguments build accelerate's state)
from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
from hf_fsdp_qlora.train.fsdp import fsdp_engagement

SCENARIOS = {
    "plain": {"include_num_input_tokens_seen": True},  # also evaluates after training
    "ckpt": {"chunked_loss": False, "tiled_mlp": True, "tiled_mlp_tokens": 4},
    "packed": {"activation_offloading": True},  # offloading's saved-tensor hooks around the all-to-alls
    "gqa": {},  # one key/value head for sp_size=2: replicated to the query heads before the exchange
    # Options one step away from the proven path (issue 49): OPTION_STEPS steps each.
    "moe_aux": {},  # Qwen3-MoE with output_router_logits=True, router_aux_loss_coef=1.0
    "smooth": {"label_smoothing_factor": 0.1},
    "loss_func": {},  # a causal-LM compute_loss_func
    "gaps": {},  # user position_ids with a gap: [0..7, 12..19]
    "dropout": {},  # LoRA dropout 0.1: the masks each rank draws for its chunk recorded
    # The same under FSDP's activation checkpointing (launched only): its gradients must equal "dropout"'s, the
    # recomputation drawing each rank's forward masks again (train/sp_random.py, preserve_checkpoint_rng_state)
    "dropout_ckpt": {},
    "neftune": {"neftune_noise_alpha": 5.0},  # the largest noise NEFTune added in the first forward recorded
}
LAUNCHED_ONLY = ("dropout_ckpt",)  # compared with another launched scenario, not with one process
OPTION_STEPS = 2  # the option scenarios' steps (the first four: the proven paths, STEPS)
# Launched only: 4 steps with a checkpoint at step 2, then a fresh trainer resumed from it (steps 3 and 4).
RESUME = "resume"
LENGTH, SAMPLES, STEPS = 15, 32, 8


class PromptData(torch.utils.data.Dataset):
    """Equal-length samples (15 tokens: odd, so sp_size=2 pads) with prompts of different lengths masked."""

    def __init__(self):
        gen = torch.Generator().manual_seed(99)
        self.ids = torch.randint(3, 256, (SAMPLES, LENGTH), generator=gen)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        ids = self.ids[i]
        labels = ids.clone()
        labels[: 1 + i % 5] = -100
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


class GapData(PromptData):
    """16-token samples whose position ids jump from 7 to 12: two sequences for transformers (a step other than 1)."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item = {k: torch.cat([v, v[:1]]) for k, v in item.items() if k != "attention_mask"}
        item["position_ids"] = torch.cat([torch.arange(8), torch.arange(12, 20)])
        return item


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """A user's compute_loss_func: transformers' causal-LM loss (it shifts the labels itself)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, vocab_size=256, num_items_in_batch=num_items_in_batch)


def prediction_metrics(prediction):
    """compute_metrics for evaluate(prediction_loss_only=False): sums over the predictions' values and shape."""
    logits, labels = prediction.predictions, prediction.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"logit_sum": float(logits.astype("float64").sum()), "rows": int(logits.shape[0]),
            "label_sum": int(labels[labels != -100].sum())}  # fmt: skip


def _evaluate_options(trainer, out, name, sp_size) -> dict:
    """The plain scenario's evaluations: the whole set; 5 samples in batches of 2 (a remainder batch); the same with
    the predictions (compute_metrics); predict() on 4 samples."""
    from torch.utils.data import Subset

    found = {"eval_loss": trainer.evaluate(PromptData())["eval_loss"]}
    # batches of 2 (training's batches were whole; evaluation's last one is not)
    trainer.args.dataloader_drop_last, trainer.args.per_device_eval_batch_size = False, 2
    found["eval5_loss"] = trainer.evaluate(Subset(PromptData(), range(5)))["eval_loss"]
    trainer.compute_metrics = prediction_metrics
    found["eval5_metrics"] = trainer.evaluate(Subset(PromptData(), range(5)))
    trainer.compute_metrics = None
    predicted = trainer.predict(Subset(PromptData(), range(4)))
    found["predict_shapes"] = [list(predicted.predictions.shape), list(predicted.label_ids.shape)]
    found["predict_loss"] = predicted.metrics["test_loss"]
    if ts.rank() == 0:
        torch.save({"predictions": torch.from_numpy(predicted.predictions), "label_ids":
                    torch.from_numpy(predicted.label_ids)}, out / f"predict_{name}_sp{sp_size}.pt")  # fmt: skip
    return found


class VariedData(torch.utils.data.Dataset):
    """Sequences of 4 to 11 tokens, packed by DataCollatorWithFlattening (position ids restart per sequence)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(5)
        self.rows = [torch.randint(3, 256, (4 + i % 8,), generator=gen).tolist() for i in range(SAMPLES)]

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": list(self.rows[i])}


def run(name, path, out, sp_size):
    from transformers import DataCollatorWithFlattening, TrainerCallback

    seen = {}

    class FirstGrads(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["engaged"] = fsdp_engagement(model) if dist.is_initialized() else {}
            seen["dtensor_params"] = sum(hasattr(p, "to_local") for p in model.parameters())
            seen["checkpointed"] = sum("CheckpointWrapper" in type(m).__name__ for m in model.modules())
            if name == "neftune":  # after train() put NEFTune's hook on: this one sees the noisy embeddings
                embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
                embeddings = embeddings or trainer.accelerator.unwrap_model(model).get_input_embeddings()
                _record_noise(embeddings, seen)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if "grads" not in seen:
                seen["grads"] = whole_grads(model)

    settings = dict(SCENARIOS[name])
    if (
        "FSDP_ACTIVATION_CHECKPOINTING" in os.environ
    ):  # launched: the rehearsal config's FSDP checkpointing, per scenario
        os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = str(name in ("ckpt", "dropout_ckpt")).lower()
    model = _load(name, path)
    option = name in ("moe_aux", "smooth", "loss_func", "gaps", "dropout", "dropout_ckpt", "neftune")
    args = FSDPQLoRATrainingArguments(
        output_dir=str(out / f"{name}_sp{sp_size}"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=OPTION_STEPS if option else STEPS, learning_rate=0.1, optim="sgd", logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, dataloader_drop_last=True, seed=0, average_tokens_across_devices=True,
        sp_size=sp_size, **settings,
    )  # fmt: skip
    extra = {"data_collator": DataCollatorWithFlattening()} if name == "packed" else {}
    if name == "loss_func":
        extra["compute_loss_func"] = causal_lm_loss
    data = VariedData() if name == "packed" else GapData() if name == "gaps" else PromptData()
    trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=data, callbacks=[FirstGrads()], **extra)
    aux = _record_aux(model) if name == "moe_aux" else None
    masks = _record_dropout(model) if name == "dropout" else None
    trainer.train()
    found = _evaluate_options(trainer, out, name, sp_size) if name == "plain" else {"eval_loss": None}
    if ts.rank() == 0:
        torch.save(seen.get("grads", {}), out / f"grads_{name}_sp{sp_size}.pt")
    return {
        **found,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "first_aux": aux[0] if aux else None,
        "num_input_tokens_seen": trainer.state.num_input_tokens_seen,
        "first_dropout_mask": masks[0] if masks else None,
        "first_noise_max": seen.get("noise", [None])[0],
        "engaged": seen.get("engaged"),
        "dtensor_params": seen.get("dtensor_params"),
        "checkpointed": seen.get("checkpointed"),
        "offload_packed": getattr(getattr(trainer.model, "_hf_fsdp_qlora_offloading", None), "packed", 0),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "world": dist.get_world_size() if dist.is_initialized() else 1,
    }


def _load(name, path):
    torch.manual_seed(0)  # the same LoRA initialisation in the launch and in the oracle
    folder = {"gqa": "llama_kv1", "moe_aux": "qwen3_moe"}.get(name)
    model = load_qlora_model(
        str(Path(path).parent / folder) if folder else path,
        dtype=torch.float32,
        lora_config=ts.lora_config(init_lora_weights=False, lora_dropout=0.1 if "dropout" in name else 0.0),
        gradient_checkpointing=(name == "ckpt"),
    )
    model.config.use_cache = False
    if name == "moe_aux":
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 1.0
        model.get_base_model().router_aux_loss_coef = 1.0
    return model


def _record_noise(embeddings, seen) -> None:
    """Forward hooks recording the largest NEFTune noise of each training forward: the embeddings after NEFTune's hook
    minus those before it (one hook put first, one last)."""
    clean = []

    def before(module, args, output):
        clean.append(output.detach().clone())

    def after(module, args, output):
        if module.training:
            seen.setdefault("noise", []).append(float((output - clean.pop()).abs().max()))
        clean.clear()

    embeddings.register_forward_hook(before, prepend=True)
    embeddings.register_forward_hook(after)


def _record_dropout(model) -> list:
    """The mask of the first layer's q_proj LoRA dropout in every training forward: [batch, tokens, hidden] 0/1."""
    found = []
    dropout = model.get_base_model().model.layers[0].self_attn.q_proj.lora_dropout["default"]

    def hook(module, args, output):
        if module.training:
            found.append(((output == 0) & (args[0] != 0)).int().tolist())

    dropout.register_forward_hook(hook)
    return found


def _record_aux(model) -> list:
    """The router aux loss of every training forward (the model's own output, whatever computed it)."""
    found = []

    def hook(module, args, output):
        if module.training and getattr(output, "aux_loss", None) is not None:
            found.append(float(output.aux_loss))

    model.get_base_model().register_forward_hook(hook)
    return found


def _trainable(model) -> dict:
    """Every trainable weight, whole (full_tensor(): collective under FSDP2, every rank calls it)."""
    found = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            found[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
    return found


# The resume scenario's runs: (output folder, checkpoint to resume from, the step after which SIGUSR1 is sent).
RESUME_PARTS = {
    "whole": (None, None),
    "resumed": ("resume_whole/checkpoint-2", None),  # the periodic checkpoint of the uninterrupted run
    # SIGUSR1 after step 2 (no periodic checkpoints: a signal during one makes it the preemption's): every rank saves
    # checkpoint-3 at the next step's end and train() returns
    "preempted": (None, 2),
    "preempt_resumed": ("resume_preempted/checkpoint-3", None),
}


def _resume_callbacks(steps: list, signal_after: int | None) -> list:
    """Count the steps run; with `signal_after`, our preemption callback (train() returns instead of exiting, so the
    launch goes on) and a SIGUSR1 to this rank after that step, as a scheduler sends it to every task."""
    import signal

    from transformers import TrainerCallback

    from hf_fsdp_qlora import PreemptionCallback

    class CountSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)
            if state.global_step == signal_after:
                os.kill(os.getpid(), signal.SIGUSR1)

    # The preemption callback first: it looks at step 2's end before the signal, so the stop is at step 3's end
    return ([PreemptionCallback(exit_code=None)] if signal_after else []) + [CountSteps()]


def run_resume(path, out):
    """Bit-exact resume under sp_size=2: from a periodic checkpoint, and from the checkpoint a SIGUSR1 (preemption)
    made mid-run; each resumed run's losses and final adapter against the uninterrupted run's."""
    if "FSDP_ACTIVATION_CHECKPOINTING" in os.environ:
        os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "false"
    found = {}
    for part, (checkpoint, signal_after) in RESUME_PARTS.items():
        torch.manual_seed(0)
        model = load_qlora_model(path, dtype=torch.float32, lora_config=ts.lora_config(init_lora_weights=False),
                                 gradient_checkpointing=False)  # fmt: skip
        folder = {"resumed": "resume_resumed", "preempt_resumed": "resume_preempt_resumed"}.get(part, f"resume_{part}")
        args = FSDPQLoRATrainingArguments(
            output_dir=str(out / folder), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=4, learning_rate=0.1, optim="adamw_torch", logging_steps=1, report_to=[], save_steps=2,
            save_strategy="no" if signal_after else "steps", use_cpu=True, dataloader_drop_last=True, seed=0, sp_size=2,
        )  # fmt: skip
        steps = []
        trainer = FSDPQLoRATrainer(
            model=model, args=args, train_dataset=PromptData(), callbacks=_resume_callbacks(steps, signal_after)
        )
        trainer.train(resume_from_checkpoint=str(out / checkpoint) if checkpoint else None)
        found[part] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        found[f"{part}_steps_run"] = steps
        found[f"{part}_checkpoints"] = sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*"))
        weights = _trainable(trainer.model)
        if ts.rank() == 0:
            torch.save(weights, out / f"{folder}.pt")
        ts.reset_accelerate()
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp-version", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()
    out, path = Path(args.out), str(Path(args.models) / "llama")
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    names = args.scenarios.split(",") + ([] if args.single else [RESUME])
    names = [n for n in names if not (args.single and n in LAUNCHED_ONLY)]
    for name in names:
        wall, cpu = time.perf_counter(), time.process_time()  # where the launch's time goes (issue 33)
        try:
            found[name] = run_resume(path, out) if name == RESUME else run(name, path, out, 1 if args.single else 2)
            found[name].update(seconds=round(time.perf_counter() - wall, 2), cpu_s=round(time.process_time() - cpu, 2))
        except Exception as err:  # noqa: BLE001 - reported to the test
            found[name] = {"error": "".join(traceback.format_exception(err))[-4000:]}
        ts.reset_accelerate()
    if args.single:
        import json

        (out / "single.json").write_text(json.dumps(found, indent=1, default=str))
        return
    from dist_utils import finish_worker

    finish_worker(out, found)


if __name__ == "__main__":
    main()
