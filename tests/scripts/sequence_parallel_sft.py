"""Worker for tests/test_sequence_parallel.py: trl's sft.py, unchanged, under Ulysses sequence parallelism.

Run as ``accelerate launch ... -m hf_fsdp_qlora.run tests/scripts/sequence_parallel_sft.py OUT SFT_ARGS...``. It gives
every trainer the script builds a recorder (``Trainer.__init__`` wrapped once more, around the launcher's hook), then
runs trl's installed ``trl/scripts/sft.py`` as ``__main__`` with SFT_ARGS (runpy: the script is not copied).

Each rank writes OUT/rank<N>.json: FSDP engagement, the sp_size the trainer saw, accelerate's parallelism config, the
tokens of each whole training batch and the tokens each forward of this rank embedded, the log history. Rank 0 writes
OUT/steps.pt: for every optimizer step the whole batch, the LoRA weights the step ran with and their gradients
(gathered whole from the FSDP2 shards, after the Trainer's clipping), for the test's one-process oracle.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
import trl.scripts.sft
from transformers import TrainerCallback

from hf_fsdp_qlora.train.fsdp import fsdp_engagement

_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    # full_tensor(): collective under FSDP2; every rank calls it, in the same order
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().clone()


class Recorder(TrainerCallback):
    def __init__(self, trainer, out: Path):
        self.trainer, self.out = trainer, out
        self.found = {"whole_tokens": [], "local_tokens": []}
        self.steps: list[dict] = []
        self.batch = None

    def record_batch(self, model, inputs):
        if model.training:
            self.batch = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
            self.found["whole_tokens"].append(int(inputs["input_ids"].shape[-1]))

    def _count(self, module, args):
        if module.training:
            self.found["local_tokens"].append(int(args[0].shape[-1]))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        accelerator = self.trainer.accelerator
        self.found.update(
            engaged=fsdp_engagement(model),
            dtensor_params=sum(hasattr(p, "to_local") for p in model.parameters()),
            sp_size=getattr(args, "sp_size", None),
            trainer=type(self.trainer).__name__,
            parallelism_config=repr(accelerator.parallelism_config),
            distributed_type=str(accelerator.distributed_type),
            world=dist.get_world_size(),
        )
        model.get_input_embeddings().register_forward_pre_hook(self._count)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        trainable = [(_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        weights = {n: _whole(p) for n, p in trainable}
        grads = {n: _whole(p.grad) for n, p in trainable}
        self.steps.append({"batch": self.batch, "weights": weights, "grads": grads})

    def on_train_end(self, args, state, control, **kwargs):
        rank = dist.get_rank()
        self.found["log_history"] = state.log_history
        (self.out / f"rank{rank}.json").write_text(json.dumps(self.found, default=str))
        if rank == 0:
            torch.save(self.steps, self.out / "steps.pt")


def _instrument(trainer, out: Path) -> None:
    recorder = Recorder(trainer, out)
    trainer.add_callback(recorder)
    stock = trainer.compute_loss  # the whole batch, before the sequence split

    def compute_loss(model, inputs, *args, **kwargs):
        recorder.record_batch(model, inputs)
        return stock(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    built = transformers.Trainer.__init__

    def __init__(self, *args, **kwargs):
        built(self, *args, **kwargs)
        _instrument(self, out)

    transformers.Trainer.__init__ = __init__
    script = trl.scripts.sft.__file__
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
