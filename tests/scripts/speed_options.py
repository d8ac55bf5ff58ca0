"""Worker for tests/test_speed_options.py: FSDPQLoRATrainer under FSDP2 with each speed option, in one launch.

Scenarios, in this order (compilation last: accelerate sets process-wide dynamo flags when it compiles):
``base`` (no option), ``regather`` (base with the frozen embedding gathered again in the backward, as before
``skip_frozen_embedding_backward_gather``), ``offload`` (activation_offloading=True), ``compile``
(compile_layers=True). Each trains 2 steps of the tiny Llama from the same seed and data; each rank writes
rank<N>.json with the logged losses, what the option engaged, the FSDP2 all-gathers per unit in the forward and
the backward, and the logits of its first training forward (logits_<scenario>_rank<N>.pt).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as ts

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before the arguments build accelerate's state)
from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
from hf_fsdp_qlora.train.compile import compiled_modules
from hf_fsdp_qlora.train.fsdp import fsdp_engagement

OPTIONS = {"base": {}, "regather": {}, "offload": {"activation_offloading": True}, "compile": {"compile_layers": True}}


GATHERS = {}  # (unit fqn, "forward" | "backward") -> all-gathers issued, for the scenario running


def count_gathers():
    """Count the all-gathers FSDP2 really issues per unit (an unshard that finds the unit gathered issues none)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    unshard = FSDPParamGroup.unshard

    def counted(self, async_op=False):
        pending = self._all_gather_result
        unshard(self, async_op)
        if pending is None and self._all_gather_result is not None:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            key = f"{self._module_fqn}|{phase}"
            GATHERS[key] = GATHERS.get(key, 0) + 1

    FSDPParamGroup.unshard = counted


def run(name, path, out):
    from transformers import TrainerCallback

    from hf_fsdp_qlora.train import callbacks

    GATHERS.clear()
    skip = callbacks.skip_frozen_embedding_backward_gather
    if name == "regather":  # the behaviour before the fix, as the oracle for numerics and gather counts
        callbacks.skip_frozen_embedding_backward_gather = lambda model: []

    seen = {}

    class FirstLogits(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def keep(module, inputs, output):
                if "logits" not in seen:
                    seen["logits"] = output.logits.detach().float().clone()

            seen["handle"] = model.register_forward_hook(keep)
            seen["engaged"] = fsdp_engagement(model)
            seen["compiled"] = compiled_modules(model)

    torch.manual_seed(0)
    model = load_qlora_model(path, lora_config=ts.lora_config())
    args = FSDPQLoRATrainingArguments(
        output_dir=str(out / name), per_device_train_batch_size=ts.BATCH, max_steps=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_drop_last=True, bf16=True,
        seed=0, chunked_loss=False, **OPTIONS[name],  # the stock loss: the test compares the forward's full logits
    )  # fmt: skip
    trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=ts.TokenDataset(), callbacks=[FirstLogits()])
    offloading = getattr(trainer.model, "_hf_fsdp_qlora_offloading", None)
    try:
        trainer.train()
    finally:
        callbacks.skip_frozen_embedding_backward_gather = skip
    seen["handle"].remove()
    torch.save(seen["logits"], out / f"logits_{name}_rank{ts.rank()}.pt")
    found = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "engaged": seen["engaged"],
        "compiled": seen["compiled"],
        "distributed_type": str(trainer.accelerator.distributed_type),
        "gathers": dict(GATHERS),
    }
    if offloading is not None:
        found["offload"] = {"packed": offloading.packed, "offloaded": offloading.offloaded}
    if name == "compile":
        from torch._dynamo.utils import counters

        found["dynamo"] = dict(counters["stats"])
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(OPTIONS))
    args = parser.parse_args()
    out, path = Path(args.out), str(Path(args.models) / "llama")
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    count_gathers()
    for name in args.scenarios.split(","):
        try:
            found[name] = run(name, path, out)
        except Exception as err:  # noqa: BLE001 - reported to the test
            found[name] = {"error": "".join(traceback.format_exception(err))[-3000:]}
        ts.reset_accelerate()
    (out / f"rank{ts.rank()}.json").write_text(json.dumps(found))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from dist_utils import exit_worker

    exit_worker()
