"""trl's own ``sft.py`` (from the installed trl package, unchanged), once per learning rate in one launch, recorded so
that tests/test_precision_trl.py can replay each run in one process with stock peft.

    accelerate launch --config_file CONFIG -m hf_fsdp_qlora.run trl_sft_recorder.py RECORD LRS PORTS ARGS...

(the tests fork the ranks with that launch's environment: tests/fork_launch.py ``-m hf_fsdp_qlora.run``). For each
learning rate of the comma-separated LRS, sft.py runs as ``__main__`` with ``ARGS --learning_rate LR --output_dir
RECORD/lrLR``, its ranks meeting on the next port of PORTS, and every Trainer it builds gets a recording callback,
which writes ``RECORD/lrLR/record_rank{N}.pt``:

* ``init``: the trainable weights the run starts from, gathered on train begin from the wrapped model (FSDP2
  ``full_tensor``, FSDP1 ``summon_full_params``; train_scenarios.full_trainable, independent of hf_fsdp_qlora);
* ``batches``: every training micro-batch this rank's model was called with (the tensors, in order);
* ``facts``: FSDP engaged (FlatParameters / FSDP2 modules, DTensor parameters), the distributed type, FSDP's mixed
  precision, the dtypes of the trainable shards and of the optimizer states.

Each run seeds torch alike first, so rank 0's fresh adapters (broadcast to rank 1 by hf_fsdp_qlora) are the same in
every run: one oracle per learning rate. sft.py ends with ``trainer.end()``, which destroys the process group; the
next run's arguments make a new one once accelerate's state is reset.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import trl.scripts.sft as trl_sft
from accelerate.state import AcceleratorState, GradientState
from dist_utils import job_port
from train_scenarios import full_trainable
from transformers import Trainer, TrainerCallback


def _fsdp_facts(model, version: int) -> dict:
    """What wraps `model`, counted with torch's public classes (the package's own count is in `engagement`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    return {
        "fsdp1_units": len(FSDP.fsdp_modules(model)) if version == 1 else 0,
        "fsdp2_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
    }


class Recorder(TrainerCallback):
    """Record one trainer's start, micro-batches and dtypes (see the module docstring)."""

    def __init__(self, trainer, out: Path):
        self.trainer, self.out = trainer, out
        self.init, self.batches, self.facts, self._hook = None, [], {}, None

    def _record(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():  # training forwards only (not an evaluation)
            self.batches.append({k: v.detach().cpu().clone() for k, v in kwargs.items() if torch.is_tensor(v)})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        plugin = AcceleratorState().fsdp_plugin
        version = plugin.fsdp_version
        self.init = full_trainable(model, version)
        self.facts = {"fsdp_version": version, **_fsdp_facts(model, version)}
        self.facts["distributed_type"] = str(AcceleratorState().distributed_type)
        self.facts["mp_param_dtype"] = str(plugin.mixed_precision_policy.param_dtype)
        self.facts["mp_reduce_dtype"] = str(plugin.mixed_precision_policy.reduce_dtype)
        self._hook = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._hook.remove()
        inner = getattr(optimizer, "optimizer", optimizer)
        self.facts["optimizer_state_dtypes"] = sorted(
            {str(v.dtype) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
        )
        self.facts["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
        self.facts["engagement"] = self.trainer.fsdp_callback.engagement  # hf_fsdp_qlora's own check
        self.facts["steps"] = state.global_step
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"init": self.init, "batches": self.batches, "facts": self.facts}
        torch.save(record, self.out / f"record_rank{dist.get_rank()}.pt")


@contextlib.contextmanager
def recording(out: Path):
    """Every Trainer built inside gets a :class:`Recorder` (the script builds its own; we cannot pass callbacks)."""
    hooked = Trainer.__init__  # already hf_fsdp_qlora.run's hook, which gives the trainer our behaviour

    def __init__(self, *args, **kwargs):
        hooked(self, *args, **kwargs)
        self.add_callback(Recorder(self, out))

    Trainer.__init__ = __init__
    try:
        yield
    finally:
        Trainer.__init__ = hooked


def main() -> None:
    record, lrs, sft_args = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
    script = trl_sft.__file__
    used: set[str] = set()
    for lr in lrs:
        out = record / f"lr{lr}"
        torch.manual_seed(0)  # the same fresh adapters in every run (rank 0's, broadcast): one oracle per lr
        # sft.py ends with trainer.end(), which destroys the process group without a barrier; a rendezvous on the
        # same port could meet a rank still in the old group (seen: a hang), so each run meets on a port of its own
        os.environ["MASTER_PORT"] = job_port(out, used)
        sys.argv = [script, *sft_args, "--learning_rate", lr, "--output_dir", str(out)]
        with recording(out):
            runpy.run_path(script, run_name="__main__")
        # sft.py's trainer.end() destroyed the process group: the next SFTConfig makes a new one from fresh state
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


if __name__ == "__main__":
    main()
