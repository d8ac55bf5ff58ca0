"""Worker for tests/test_semantics_dist.py: issue-12 scenarios batched in one 2-rank launch per FSDP version.

Scenarios (--scenarios a,b):
  eval    - the same 3 training steps without evaluation and with eval_strategy="steps", eval_steps=1;
            writes both loss lists.
  tokens  - a tiny Llama whose vocabulary was resized for 4 added ChatML-like tokens, LoRA + trainable tokens
            for the new ids + modules_to_save=["lm_head"]: run A trains 4 steps with a checkpoint at step 2;
            run B resumes from A's checkpoint-2. Writes the trainable weights gathered independently
            (FSDP2 full_tensor / FSDP1 summon_full_params) to tokens_weights.pt.
--allow-repack switches bitsandbytes' CPU repack back on (only to measure the figures before the fix).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as ts
from dist_utils import finish_worker

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before TrainingArguments)
from hf_fsdp_qlora import load_qlora_model

NEW_TOKENS = 4
BASE_VOCAB = 256


def allow_repack(model):
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = True


class TrainLosses(ts.LossRecorder):
    """Records training losses only (the eval loop calls compute_loss too)."""

    def prediction_step(self, *args, **kwargs):
        count = len(self.losses)
        result = super().prediction_step(*args, **kwargs)
        del self.losses[count:]
        return result


def run_eval(path, out, version, repack):
    found = {}
    with_eval = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 2}
    for name, kw in (("plain", {}), ("eval", with_eval)):
        torch.manual_seed(0)  # the same LoRA initialisation in both runs
        model = load_qlora_model(path, lora_config=ts.lora_config(), gradient_checkpointing=False)
        if repack:
            allow_repack(model)
        args = ts.training_args(out / name, version, "llama", steps=3, seed=7, **kw)
        data = ts.TokenDataset()
        trainer = TrainLosses(model=model, args=args, train_dataset=data, eval_dataset=data if kw else None)
        trainer.losses = []
        trainer.train()
        found[f"{name}_losses"] = trainer.losses
        found[f"{name}_engaged"] = trainer.fsdp_callback.engagement
        if name == "plain":
            found["mismatch"] = mismatch_errors(trainer.model, path, out)
        ts.reset_accelerate()
    return found


def mismatch_errors(model, path, out):
    """What load_adapter_into says on this FSDP-wrapped model for a rank-8 adapter and one with an extra tensor."""
    from peft import get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.train.checkpoint import load_adapter_into, save_adapter

    rank_dir = out / f"mismatch_rank{dist.get_rank()}"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    get_peft_model(base, ts.lora_config(r=8)).save_pretrained(rank_dir / "r8")
    save_adapter(model, out / "r4")  # collective; rank 0 writes
    dist.barrier()
    tensors = load_file(str(out / "r4" / "adapter_model.safetensors"))
    tensors["base_model.model.model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    (rank_dir / "extra").mkdir(parents=True)
    save_file(tensors, str(rank_dir / "extra" / "adapter_model.safetensors"))
    # The count a resume reports: the file's tensors (FSDP2 once counted every model parameter, issue 39).
    errors = {
        "count": [load_adapter_into(model, out / "r4"), len(load_file(str(out / "r4" / "adapter_model.safetensors")))]
    }
    for kind in ("r8", "extra"):
        try:
            load_adapter_into(model, rank_dir / kind)
            errors[kind] = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            errors[kind] = f"{type(err).__name__}: {err}"
    return errors


def tokens_model(path):
    """4-bit base, embeddings resized for NEW_TOKENS added tokens, LoRA + trainable tokens + lm_head copy."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=ts.bnb_config(), dtype=torch.bfloat16)
    model.resize_token_embeddings(BASE_VOCAB + NEW_TOKENS)
    # Every rank must hold the same new rows (frozen, never broadcast), and the test's unsharded oracle too:
    # set them instead of drawing them.
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            layer.weight[BASE_VOCAB:] = layer.weight[3 : 3 + NEW_TOKENS].flip(-1) * 0.5
    torch.manual_seed(0)
    return get_peft_model(model, tokens_lora_config(), autocast_adapter_dtype=False)


def tokens_lora_config():
    new_ids = list(range(BASE_VOCAB, BASE_VOCAB + NEW_TOKENS))
    # Trainable tokens for half the new ids: the other half keep their (frozen) resized rows, which only the
    # saved embeddings carry to a reload.
    return ts.lora_config(trainable_token_indices={"embed_tokens": new_ids[:2]}, modules_to_save=["lm_head"])


class TokensDataset(ts.TokenDataset):
    def __init__(self):
        super().__init__(vocab=BASE_VOCAB + NEW_TOKENS)
        self.ids[:, ::3] = torch.arange(BASE_VOCAB, BASE_VOCAB + NEW_TOKENS).repeat(6)[: self.ids[:, ::3].shape[1]]


def run_tokens(path, out, version):
    weights = {}
    for name, steps, resume in (("A", 4, None), ("B", 4, out / "tokens_A" / "checkpoint-2")):
        args = ts.training_args(out / f"tokens_{name}", version, "llama", steps=steps, seed=7, save_strategy="steps",
                                save_steps=2)  # fmt: skip
        trainer = ts.LossRecorder(model=tokens_model(path), args=args, train_dataset=TokensDataset())
        trainer.losses = []
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        trainer.save_model(str(out / f"tokens_{name}" / "final"))
        weights[name] = ts.full_trainable(trainer.model, version)
        weights[f"{name}_losses"] = trainer.losses
        ts.reset_accelerate()
    if dist.get_rank() == 0:
        torch.save(weights, out / "tokens_weights.pt")
    return {"tokens_A_losses": weights["A_losses"], "tokens_B_losses": weights["B_losses"]}


class SameRows(ts.TokenDataset):
    """An overfit-one-example set: every row identical, correctly split across ranks by Trainer."""

    def __init__(self):
        super().__init__()
        self.ids[:] = self.ids[0]


class NoLabels(ts.TokenDataset):
    """Every label -100, as tokenize_completion_only leaves it when max_length cut the completion away."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["labels"][:] = -100
        return item


def run_hygiene(path, out, version):
    from hf_fsdp_qlora import DistinctBatchesCallback
    from hf_fsdp_qlora.train.hygiene import LabelsCheckCallback

    class NoSampler(ts.LossRecorder):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=ts.BATCH)

    found = {}
    cases = (("same_rows", ts.LossRecorder, SameRows, []), ("no_sampler", NoSampler, ts.TokenDataset, []),
             ("no_labels", ts.LossRecorder, NoLabels, [LabelsCheckCallback()]))  # fmt: skip
    for name, cls, data, callbacks in cases:
        torch.manual_seed(0)
        model = load_qlora_model(path, lora_config=ts.lora_config(), gradient_checkpointing=False)
        args = ts.training_args(out / name, version, "llama", steps=2, seed=7)
        trainer = cls(model=model, args=args, train_dataset=data(), callbacks=callbacks)
        trainer.losses = []
        try:
            trainer.train()
            result = {"error": None}
        except Exception as err:  # noqa: BLE001 - reported to the test
            result = {"error": f"{type(err).__name__}: {err}"}
        check = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DistinctBatchesCallback))
        result.update(losses=trainer.losses, verdict=getattr(check, "verdict", None))
        found[name] = result
        ts.reset_accelerate()
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument("--scenarios", default="eval,tokens")
    parser.add_argument("--allow-repack", action="store_true")
    args = parser.parse_args()
    out, version, path = Path(args.out), args.fsdp_version, str(Path(args.models) / "llama")
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    found = {}
    for scenario in args.scenarios.split(","):
        try:
            found.update(run_eval(path, out, version, args.allow_repack) if scenario == "eval" else {})
            found.update(run_tokens(path, out, version) if scenario == "tokens" else {})
            found.update(run_hygiene(path, out, version) if scenario == "hygiene" else {})
        except Exception as err:  # noqa: BLE001 - reported to the test, which prints it
            import traceback

            found[f"{scenario}_error"] = "".join(traceback.format_exception(err))[-4000:]
            ts.reset_accelerate()
    finish_worker(out, found)  # results on disk, barrier, teardown, exit


if __name__ == "__main__":
    main()
