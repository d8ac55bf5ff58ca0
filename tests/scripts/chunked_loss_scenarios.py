"""Worker for tests/test_chunked_loss.py: the chunked loss under FSDP1 or FSDP2 (2 ranks), in one launch.

Scenarios, each training the tiny 4-bit QLoRA Llama 2 optimizer steps (gradient accumulation 2, prompts masked
with -100) from the same seed and data, then evaluating:
``stock`` (chunked_loss=False: the oracle), ``chunked`` (chunks of 4 tokens: several per micro-batch), the same two
as a full fine-tune of the bf16 model (``full_stock``, ``full_chunked``: the LM head is trained), the same two for a
tiny bf16 Mixtral with ``output_router_logits`` (``moe_stock``, ``moe_chunked``: the router's auxiliary loss is part
of the loss), and ``sft`` (our SFT trainer: trl's fused LM head, each step's loss compared with the unfused loss
computed from the full logits of the same inputs and weights). Each rank writes rank<N>.json with the
logged losses, eval loss, the loss path taken, FSDP engagement, the all-gathers issued, and grads_<name>_rank<N>.pt
(the local gradient shards at the first optimizer step). The all-gathers of the chunked loss's one-time probe (a
forward without gradients) are counted apart.
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import train_scenarios as ts
from dist_utils import finish_worker

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before the arguments build accelerate's state)
from hf_fsdp_qlora import FSDPQLoRASFTTrainer, FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
from hf_fsdp_qlora.train.fsdp import fsdp_engagement
from hf_fsdp_qlora.train.loss import trainer_loss_path

SCENARIOS = {
    "stock": {"chunked_loss": False},
    "chunked": {"loss_chunk_size": 4},
    "full_stock": {"chunked_loss": False},  # full fine-tune: the LM head is trained (its gradient reduce-scattered)
    "full_chunked": {"loss_chunk_size": 4},
    "moe_stock": {"chunked_loss": False},  # tiny Mixtral, full fine-tune, router aux loss on
    "moe_chunked": {"loss_chunk_size": 4},
    "sft": {},
}
GATHERS = [0]
PROBE_GATHERS = [0]


def count_probe_gathers():
    """The probe runs once per trainer and mode: its all-gathers are counted apart from the loss's."""
    from hf_fsdp_qlora.train import loss

    original = loss._probe

    def counted(*args, **kwargs):
        before = GATHERS[0]
        try:
            return original(*args, **kwargs)
        finally:
            PROBE_GATHERS[0] += GATHERS[0] - before

    loss._probe = counted


def count_gathers():
    """Count every all-gather issued (FSDP1 and FSDP2 both go through these two torch.distributed functions)."""
    for name in ("all_gather", "all_gather_single"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            GATHERS[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


class MaskedData(torch.utils.data.Dataset):
    def __init__(self):
        self.base = ts.TokenDataset()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        item = self.base[i]
        item["labels"][: 2 + 3 * (i % 4)] = -100  # prompts of different lengths
        return item


def run(name, path, out, version):
    from transformers import TrainerCallback

    seen = {"unfused": [], "fused": []}

    class FirstGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if "grads" not in seen:
                seen["grads"] = {
                    n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().float().clone()
                    for n, p in model.named_parameters()
                    if p.requires_grad and p.grad is not None
                }

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["engaged"] = fsdp_engagement(model)

    class UnfusedCheck(FSDPQLoRASFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with torch.no_grad():  # the oracle: full logits of the same inputs and weights, transformers' loss
                logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits.float()
                shift = F.pad(inputs["labels"][..., 1:], (0, 1), value=-100)
                total = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), reduction="sum")
                unfused = total / (num_items_in_batch if num_items_in_batch is not None else shift.ne(-100).sum())
                if num_items_in_batch is not None:  # as Trainer.compute_loss with average_tokens_across_devices
                    unfused = unfused * self.accelerator.num_processes
            seen["fused"].append(float(loss.detach() if torch.is_tensor(loss) else loss[0].detach()))
            seen["unfused"].append(float(unfused))
            return loss

    torch.manual_seed(0)
    if name.startswith(("full", "moe")):
        from transformers import AutoModelForCausalLM

        where = Path(path).parent / "mixtral" if name.startswith("moe") else path
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16)
    else:
        model = load_qlora_model(path, lora_config=ts.lora_config())
    common = dict(  # noqa: C408 - keyword arguments of TrainingArguments
        per_device_train_batch_size=ts.BATCH, per_device_eval_batch_size=ts.BATCH, gradient_accumulation_steps=2,
        max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        dataloader_drop_last=True, seed=0, optim="sgd", average_tokens_across_devices=True,
    )  # fmt: skip
    GATHERS[0] = PROBE_GATHERS[0] = 0
    if name == "sft":
        from trl import SFTConfig

        args = SFTConfig(output_dir=str(out / name), bf16=False, **common)
        data = ts.sft_dataset()
        trainer = UnfusedCheck(model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=[FirstGrads()])
    else:
        args = FSDPQLoRATrainingArguments(output_dir=str(out / name), **common, **SCENARIOS[name])
        trainer = FSDPQLoRATrainer(
            model=model, args=args, train_dataset=MaskedData(), eval_dataset=MaskedData(), callbacks=[FirstGrads()]
        )
    trainer.train()
    gathers_train, probe_gathers = GATHERS[0] - PROBE_GATHERS[0], PROBE_GATHERS[0]
    found = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "path": trainer_loss_path(trainer),
        "engaged": seen["engaged"],
        "distributed_type": str(trainer.accelerator.distributed_type),
        "gathers_train": gathers_train,
        "probe_gathers": probe_gathers,
        "fused": seen["fused"],
        "unfused": seen["unfused"],
    }
    torch.save(seen.get("grads", {}), out / f"grads_{name}_rank{ts.rank()}.pt")
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    out, path = Path(args.out), str(Path(args.models) / "llama")
    out.mkdir(parents=True, exist_ok=True)
    count_gathers()
    count_probe_gathers()
    found = {}
    for name in args.scenarios.split(","):
        try:
            found[name] = run(name, path, out, args.fsdp_version)
        except Exception as err:  # noqa: BLE001 - reported to the test
            found[name] = {"error": "".join(traceback.format_exception(err))[-3000:]}
        ts.reset_accelerate()
    finish_worker(out, found)


if __name__ == "__main__":
    main()
