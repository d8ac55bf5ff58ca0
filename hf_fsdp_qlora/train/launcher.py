"""Run an unchanged training script with hf_fsdp_qlora's behaviour: ``python -m hf_fsdp_qlora.run SCRIPT.py ARGS``.

For scripts you cannot edit (trl's ``sft.py``/``dpo.py``, a colleague's recipe)::

    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" -m hf_fsdp_qlora.run sft.py ARGS...
    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" -m hf_fsdp_qlora.run -m trl.scripts.sft ARGS...

Before the script runs, this installs the CPU rehearsal hook (FSDP on CPU processes, where accelerate would silently
fall back to DDP) and gives every ``transformers.Trainer`` the script builds - SFTTrainer, DPOTrainer, your own
subclass - the behaviour of :class:`~hf_fsdp_qlora.FSDPQLoRATrainer` (see :mod:`hf_fsdp_qlora.train.trainer_hook`).
The script then runs as ``__main__`` with ``sys.argv`` = ``[SCRIPT, ARGS...]``.

The launch settings such scripts cannot pass are read here, from the environment (see ``USAGE``): among them
sequence parallelism, ``HF_FSDP_QLORA_SP_SIZE`` or accelerate's own ``parallelism_config_sp_size`` in the accelerate
config, which this takes over from accelerate (it runs sp_size under DeepSpeed only) before the script builds
accelerate's state, and gives to every trainer's arguments
(:func:`~hf_fsdp_qlora.train.sequence_parallel.adopt_launch_sp_size`).

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
LORA_ON_TOWERS_ENV = "HF_FSDP_QLORA_LORA_ON_TOWERS"
SP_SIZE_ENV = "HF_FSDP_QLORA_SP_SIZE"
_ACCELERATE_SP_ENV = "PARALLELISM_CONFIG_SP_SIZE"  # what accelerate launch exports for parallelism_config_sp_size

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
  HF_FSDP_QLORA_LORA_ON_TOWERS=1     LoRA on a multimodal model's vision/audio towers too (default: the language
                                     model only; towers stay unquantized and frozen; docs/multimodal.md)
  HF_FSDP_QLORA_ADAPTER_DTYPE=bfloat16  keep the adapters in bf16 (default float32: fp32 master weights, as stock
                                     peft; compute stays bf16)
  HF_FSDP_QLORA_SP_SIZE=2            Ulysses sequence parallelism for every trainer the script builds (trl's SFTTrainer
                                     included; docs/long-context.md): groups of 2 ranks share each sequence. Or, in
                                     an FSDP2 accelerate config, accelerate's name: parallelism_config:
                                     {parallelism_config_sp_size: 2} (accelerate alone runs it under DeepSpeed only)
"""


def lora_on_towers_from_env(environ=os.environ) -> bool:
    """HF_FSDP_QLORA_LORA_ON_TOWERS: off unless set to 1/true/yes (case and spaces ignored)."""
    return environ.get(LORA_ON_TOWERS_ENV, "0").strip().lower() in ("1", "true", "yes")


def quantize_experts_from_env(environ=os.environ) -> bool:
    """HF_FSDP_QLORA_QUANTIZE_EXPERTS: on unless set to 0/false/no (case and spaces ignored)."""
    return environ.get(QUANTIZE_EXPERTS_ENV, "1").strip().lower() not in ("0", "false", "no")


def _whole_number(name: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name}={value!r}: sp_size must be a whole number >= 1 (1: no sequence parallelism), e.g. 2")
    return number


def sp_size_from_env(environ=os.environ) -> tuple[int, str | None]:
    """(sp_size, the setting that asked for it) of Ulysses sequence parallelism for every trainer the script builds:
    HF_FSDP_QLORA_SP_SIZE, or the accelerate config's ``parallelism_config: {parallelism_config_sp_size: N}``, which
    ``accelerate launch`` exports as PARALLELISM_CONFIG_SP_SIZE (accelerate itself runs that only under DeepSpeed;
    under a DeepSpeed launch it is left to accelerate). (1, None) when neither asks.

    Raises:
        ValueError: a value that is not a whole number >= 1, the two settings disagreeing, HF_FSDP_QLORA_SP_SIZE
            under DeepSpeed, or sp_size beside accelerate's tp_size/cp_size (each named).
    """
    ours = environ.get(SP_SIZE_ENV, "").strip()
    ours = _whole_number(SP_SIZE_ENV, ours) if ours else None
    deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() in ("1", "true")
    if deepspeed:
        if ours is not None and ours > 1:
            raise ValueError(
                f"{SP_SIZE_ENV}={ours} under a DeepSpeed launch: hf_fsdp_qlora's sequence parallelism runs under "
                "FSDP. Use accelerate's own parallelism_config_sp_size (sp_backend: deepspeed), or an FSDP config."
            )
        return 1, None
    theirs = environ.get(_ACCELERATE_SP_ENV, "").strip()
    theirs = _whole_number("parallelism_config_sp_size", theirs) if theirs else None
    if ours is not None and theirs not in (None, 1, ours):
        raise ValueError(
            f"{SP_SIZE_ENV}={ours} and the accelerate config's parallelism_config_sp_size={theirs} disagree: set one."
        )
    sp_size = ours if ours is not None else (theirs or 1)
    source = f"{SP_SIZE_ENV}={sp_size}" if ours is not None else f"parallelism_config_sp_size={sp_size}"
    for dim in ("tp", "cp"):
        other = environ.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", "1").strip()
        if sp_size > 1 and other not in ("", "1"):
            raise ValueError(
                f"{source} with parallelism_config_{dim}_size={other}: sequence parallelism runs beside FSDP's data "
                f"parallelism only. Set parallelism_config_{dim}_size to 1, or sp_size to 1."
            )
    return sp_size, (f"{source} (read by hf_fsdp_qlora.run)" if sp_size > 1 else None)


def hand_over_accelerate_sp_size(environ=os.environ) -> None:
    """Take sp_size out of accelerate's parallelism config in this process (the setting is ours from here on), so
    accelerate neither refuses it under FSDP nor builds a mesh for it; a config with nothing else in it (no HSDP
    dp_replicate/dp_shard sizes) is then off, as without a parallelism_config."""
    if environ.get(_ACCELERATE_SP_ENV, "1").strip() == "1":
        return
    environ[_ACCELERATE_SP_ENV] = "1"
    sizes = [
        environ.get(f"PARALLELISM_CONFIG_{d}_SIZE", "1").strip() for d in ("DP_REPLICATE", "DP_SHARD", "TP", "CP")
    ]
    if all(s in ("", "1") for s in sizes):
        environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"


def _finish(code: int) -> None:
    """Exit with `code`. Only a preempted run's ranks meet first (they stopped together); a finished rank leaves
    at once, whatever tail another rank still runs (see :mod:`hf_fsdp_qlora.train.finish`)."""
    from .finish import finish_distributed
    from .preemption import PREEMPTED_EXIT_CODE

    finish_distributed(code, barrier=code == PREEMPTED_EXIT_CODE)


def _target(argv: list[str]) -> tuple[bool, str, list[str]]:
    """(run as a module, the script or module, its arguments); usage errors exit 2 before anything is imported."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    if argv[0] == "-m":
        if len(argv) < 2:
            print("hf_fsdp_qlora.run: -m needs a module name, e.g. -m trl.scripts.sft\n\n" + USAGE, file=sys.stderr)
            sys.exit(2)
        return True, argv[1], argv[2:]
    if not os.path.isfile(argv[0]):
        print(f"hf_fsdp_qlora.run: no such script: {argv[0]!r}\n\n" + USAGE, file=sys.stderr)
        sys.exit(2)
    return False, argv[0], argv[1:]


def _exit_on_bad_setting(setting: str, apply, *args):
    """`apply(*args)`; a ValueError (a bad environment value) is said with its setting's name, exit status 2."""
    try:
        return apply(*args)
    except ValueError as err:
        print(f"hf_fsdp_qlora.run: {setting}{err}", file=sys.stderr)
        sys.exit(2)


def _apply_launch_settings() -> None:
    """The environment's settings, each checked before the heavy imports: a bad value exits 2 naming it."""
    sp_size, sp_source = _exit_on_bad_setting("", sp_size_from_env)  # before anything is imported or loaded
    from .preemption import remember_early_signals, set_launch_defaults

    # First, before the heavy imports and the model loading: a scheduler's SIGUSR1 from here on is remembered and
    # acted on when train() starts (the node script's `trap '' USR1` would otherwise have it ignored until then).
    remember_early_signals()
    from .precision import set_launch_adapter_dtype

    auto_resume = os.environ.get(AUTO_RESUME_ENV, "").strip().lower() in ("1", "true", "yes")
    stop_after = os.environ.get(STOP_AFTER_ENV) or None
    _exit_on_bad_setting(f"{STOP_AFTER_ENV}: ", set_launch_defaults, auto_resume, stop_after)
    _exit_on_bad_setting(f"{ADAPTER_DTYPE_ENV}: ", set_launch_adapter_dtype, os.environ.get(ADAPTER_DTYPE_ENV) or None)
    if sp_size > 1:  # before the script builds accelerate's state, which would refuse sp_size without DeepSpeed
        from .sequence_parallel import set_launch_sp_size

        hand_over_accelerate_sp_size()
        set_launch_sp_size(sp_size, sp_source)


def _install_hooks() -> None:
    """FSDP on CPU processes, our behaviour for every Trainer the script builds, and its experts packed in 4 bits."""
    from ..cpu_rehearsal import enable_cpu_fsdp
    from ..experts.lora import quantize_experts_before_peft
    from ..loading.script_towers import keep_towers_of_script_loads, limit_script_lora_to_language_model
    from .trainer_hook import install_trainer_hook

    enable_cpu_fsdp()
    install_trainer_hook(adopt_all=True)
    keep_towers_of_script_loads()  # before the experts stream's from_pretrained wrapper, which wraps it
    quantize_experts_before_peft(QUANTIZE_EXPERTS_ENV, quantize=quantize_experts_from_env())
    limit_script_lora_to_language_model(lora_on_towers_from_env())  # around the experts hook's inject_adapter


def _run_script(as_module: bool, target: str, rest: list[str]) -> int:
    """Run the script as ``__main__``; its exit status (a traceback printed as Python would, and 1, if it raised)."""
    sys.argv = [target, *rest]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        from .finish import exit_status

        return exit_status(stop.code)
    except BaseException:  # noqa: BLE001 - printed as Python would, then the exit status says it failed
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    as_module, target, rest = _target(list(sys.argv[1:] if argv is None else argv))
    _apply_launch_settings()
    _install_hooks()
    _finish(_run_script(as_module, target, rest))


if __name__ == "__main__":
    main()
