"""Run an unchanged training script with hf_fsdp_qlora's behaviour: ``python -m hf_fsdp_qlora.run SCRIPT.py ARGS``.

For scripts you cannot edit (trl's ``sft.py``/``dpo.py``, a colleague's recipe)::

    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" -m hf_fsdp_qlora.run sft.py ARGS...
    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" -m hf_fsdp_qlora.run -m trl.scripts.sft ARGS...

Before the script runs, this installs the CPU rehearsal hook (FSDP on CPU processes, where accelerate would silently
fall back to DDP) and gives every ``transformers.Trainer`` the script builds - SFTTrainer, DPOTrainer, your own
subclass - the behaviour of :class:`~hf_fsdp_qlora.FSDPQLoRATrainer` (see :mod:`hf_fsdp_qlora.train.trainer_hook`).
The script then runs as ``__main__`` with ``sys.argv`` = ``[SCRIPT, ARGS...]``.

Afterwards the process group is destroyed (without waiting for the other ranks), and the process exits with the
script's status without the interpreter's teardown: torch's gloo teardown at exit sometimes aborts ("terminate
called without an active exception") after a successful run, and ``accelerate launch`` would report a failure.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

# The environment switches of unchanged scripts, read here only (the launcher edge).
AUTO_RESUME_ENV = "HF_FSDP_QLORA_AUTO_RESUME"
STOP_AFTER_ENV = "HF_FSDP_QLORA_STOP_AFTER"
QUANTIZE_EXPERTS_ENV = "HF_FSDP_QLORA_QUANTIZE_EXPERTS"
ADAPTER_DTYPE_ENV = "HF_FSDP_QLORA_ADAPTER_DTYPE"

USAGE = """usage: python -m hf_fsdp_qlora.run SCRIPT.py [SCRIPT_ARGS...]
       python -m hf_fsdp_qlora.run -m MODULE [SCRIPT_ARGS...]

Run an unchanged training script with hf_fsdp_qlora's FSDP + QLoRA behaviour given to every transformers
Trainer it builds (trl's SFTTrainer, DPOTrainer, ...), and the CPU rehearsal hook installed. Launch it with
accelerate, e.g.:

  accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" -m hf_fsdp_qlora.run \\
      "$(python -c 'import trl.scripts.sft as s; print(s.__file__)')" --model_name_or_path ... --use_peft --load_in_4bit

Preemption (docs/preemption.md): on SIGTERM or SIGUSR1 every rank saves one checkpoint at the next optimizer step
and exits with status 75 (and leaves OUTPUT_DIR/preempted.json). Environment:
  HF_FSDP_QLORA_AUTO_RESUME=1        resume from the latest complete checkpoint in output_dir (fresh when none)
  HF_FSDP_QLORA_STOP_AFTER=HH:MM:SS  checkpoint and exit the same way after this much wall-clock time
  HF_FSDP_QLORA_QUANTIZE_EXPERTS=0   keep a mixture-of-experts model's experts 16-bit under --load_in_4bit
                                     (default: quantized to 4 bits like the linear layers, before peft and FSDP)
  HF_FSDP_QLORA_ADAPTER_DTYPE=bfloat16  keep the adapters in bf16 (default float32: fp32 master weights, as stock
                                     peft; compute stays bf16)
"""


def quantize_experts_from_env(environ=os.environ) -> bool:
    """HF_FSDP_QLORA_QUANTIZE_EXPERTS: on unless set to 0/false/no (case and spaces ignored)."""
    return environ.get(QUANTIZE_EXPERTS_ENV, "1").strip().lower() not in ("0", "false", "no")


def _finish(code: int) -> None:
    """Exit with `code`. Only a preempted run's ranks meet first (they stopped together); a finished rank leaves
    at once, whatever tail another rank still runs (see :mod:`hf_fsdp_qlora.train.finish`)."""
    from .finish import finish_distributed
    from .preemption import PREEMPTED_EXIT_CODE

    finish_distributed(code, barrier=code == PREEMPTED_EXIT_CODE)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    as_module = argv[0] == "-m"
    if as_module:
        if len(argv) < 2:
            print("hf_fsdp_qlora.run: -m needs a module name, e.g. -m trl.scripts.sft\n\n" + USAGE, file=sys.stderr)
            sys.exit(2)
        target, rest = argv[1], argv[2:]
    else:
        target, rest = argv[0], argv[1:]
        if not os.path.isfile(target):
            print(f"hf_fsdp_qlora.run: no such script: {target!r}\n\n" + USAGE, file=sys.stderr)
            sys.exit(2)

    from .preemption import remember_early_signals, set_launch_defaults

    # First, before the heavy imports and the model loading: a scheduler's SIGUSR1 from here on is remembered and
    # acted on when train() starts (the node script's `trap '' USR1` would otherwise have it ignored until then).
    remember_early_signals()
    try:
        set_launch_defaults(
            auto_resume=os.environ.get(AUTO_RESUME_ENV, "").strip().lower() in ("1", "true", "yes"),
            stop_after=os.environ.get(STOP_AFTER_ENV) or None,
        )
    except ValueError as err:
        print(f"hf_fsdp_qlora.run: {STOP_AFTER_ENV}: {err}", file=sys.stderr)
        sys.exit(2)
    from .precision import set_launch_adapter_dtype

    try:
        set_launch_adapter_dtype(os.environ.get(ADAPTER_DTYPE_ENV) or None)
    except ValueError as err:
        print(f"hf_fsdp_qlora.run: {ADAPTER_DTYPE_ENV}: {err}", file=sys.stderr)
        sys.exit(2)

    from ..cpu_rehearsal import enable_cpu_fsdp
    from ..loading.expert_lora import quantize_experts_before_peft
    from .trainer_hook import install_trainer_hook

    enable_cpu_fsdp()
    install_trainer_hook(adopt_all=True)
    quantize_experts_before_peft(QUANTIZE_EXPERTS_ENV, quantize=quantize_experts_from_env())

    code = 0
    try:
        if as_module:
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        from .finish import exit_status

        code = exit_status(stop.code)
    except BaseException:  # noqa: BLE001 - printed as Python would, then the exit status says it failed
        traceback.print_exc()
        code = 1
    _finish(code)


if __name__ == "__main__":
    main()
