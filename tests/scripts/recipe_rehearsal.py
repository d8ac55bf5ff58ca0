"""Worker: every recipe page's launch, with the page's own flags (its `--config` file included), at a tiny shape, one
after the other in ONE launch: tests/test_recipes_settings.py compares what each trained with to its doctor's plan.

    python -m hf_fsdp_qlora.run recipe_rehearsal.py PLAN.json     (2 ranks forked with accelerate's environment)

PLAN.json lists the runs: ``{"name", "script", "argv", "out", "port", "cwd"}``. trl's scripts run as ``__main__`` (runpy, as
``-m hf_fsdp_qlora.run`` runs them); the example scripts' ``main(argv)`` (their ``__main__`` block ends the process).
Every Trainer a script builds gets a recorder that writes OUT/record_rank{N}.json on train end: the training
arguments it trained with and the shape (rows, tokens) of every training forward of the model. trl's scripts end
with ``trainer.end()``, which destroys the process group: each run meets on a port of its own, after accelerate's
state is reset (as tests/scripts/trl_sft_recorder.py does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from dist_utils import job_port
from transformers import Trainer, TrainerCallback

ARGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type",
    "warmup_steps", "num_train_epochs", "max_steps", "save_strategy", "save_steps", "save_total_limit",
    "eval_strategy", "eval_steps", "logging_steps", "max_length", "max_completion_length", "num_generations", "beta",
)  # fmt: skip


class Recorder(TrainerCallback):
    """The arguments a trainer trains with and the (rows, tokens) of each training forward of its model."""

    def __init__(self, out: Path, trainer):
        self.out, self.trainer, self.forwards, self.hook = out, trainer, [], None

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and torch.is_grad_enabled() and torch.is_tensor(ids):
            self.forwards.append(list(ids.shape))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.hook = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.hook.remove()
        record = {
            "args": {name: _plain(getattr(args, name, None)) for name in ARGS},
            "forwards": self.forwards,
            "steps": state.global_step,
            "model": _model_facts(model),
            "trainer": type(self.trainer).__name__,
            # GRPO: the reward functions the trainer scored with, and what they gave (logged per function)
            "reward_funcs": getattr(self.trainer, "reward_func_names", None),
            "rewards": {k: v for e in state.log_history for k, v in e.items() if k.startswith("rewards/")},
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"record_rank{dist.get_rank()}.json").write_text(json.dumps(record))


def _model_facts(model) -> dict:
    """How the base is held (the classes of its quantized linear layers) and the LoRA rank (None: no adapter)."""
    kinds = sorted(
        {type(m).__name__ for m in model.modules() if re.search(r"4bit|8bit|Int8|QuantizedExperts", type(m).__name__)}
    )
    peft = next((m.peft_config for m in model.modules() if hasattr(m, "peft_config")), None)
    return {"quantized_classes": kinds, "lora_r": peft["default"].r if peft else None}


def _plain(value):
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _install(out: Path):
    hooked = Trainer.__init__  # hf_fsdp_qlora.run's hook already: the trainer has our behaviour

    def __init__(self, *args, **kwargs):
        hooked(self, *args, **kwargs)
        self.add_callback(Recorder(out, self))

    Trainer.__init__ = __init__
    return hooked


def _run(run: dict) -> None:
    script, argv = run["script"], run["argv"]
    if "/trl/scripts/" in script:
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
        return
    spec = importlib.util.spec_from_file_location(f"recipe_{run['name'].replace('-', '_')}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    os.chdir(runs[0]["cwd"])  # the pages' commands run from the repository's root (paths, GRPO's reward import)
    used: set[str] = set()
    for run in runs:
        hooked = _install(Path(run["out"]))
        torch.manual_seed(0)
        # A port of its own: a trl script's trainer.end() destroyed the last group without a barrier, and a
        # rendezvous on the same port could meet a rank still in it (a group still alive is simply reused).
        os.environ["MASTER_PORT"] = job_port(Path(run["out"]), used)
        try:
            _run(run)
        finally:
            Trainer.__init__ = hooked
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


if __name__ == "__main__":
    main()
