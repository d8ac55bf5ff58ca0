"""`hf-fsdp-qlora doctor`: every inconsistency of a QLoRA/FSDP setup, and its per-GPU memory plan, before launch.

    hf-fsdp-qlora doctor --accelerate-config llama3_70b_2xa100_80gb --model ./Llama-3.1-70B \\
        --load-in-4bit --seq-len 4096 --gpu-memory 80GB

Reads the accelerate config as ``accelerate launch`` would and only the model's config.json (the model is built
on the meta device), so a 70B model is checked in seconds on a laptop. Exit status: 0 no error, 1 errors found,
2 bad usage (not an accelerate config, unknown key, no config.json, a Hub id whose config.json cannot be
fetched). ``--json`` prints the document described in :mod:`hf_fsdp_qlora.doctor` (schema version 1). The work is :func:`hf_fsdp_qlora.doctor.diagnose`; torch is
imported in `run`, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json

from hf_fsdp_qlora.cli._command import Command, CommandError
from hf_fsdp_qlora.cli._options import FLOAT_DTYPES, dtype_type
from hf_fsdp_qlora.loss_paths import DEFAULT_LOSS_CHUNK_SIZE, LOSS_PATHS

__all__ = ["DoctorCommand"]

# uint8/int8 are accepted so that the integer 4-bit storage that FSDP cannot shard can be diagnosed.
_dtype = dtype_type(FLOAT_DTYPES + ("uint8", "int8"))


def _positive(value: str) -> int:
    # Only the type here: the range is checked in `run`, so that every bad value gives one line (see _impossible).
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def _size(value: str) -> int:
    from hf_fsdp_qlora.doctor.memory import parse_gpu_memory

    try:
        return parse_gpu_memory(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a memory size (e.g. 80GB, 24GiB, 40960MiB)") from None


def _settings(args: argparse.Namespace) -> dict:
    quantization = "4bit" if args.load_in_4bit else "8bit" if args.load_in_8bit else None
    targets = args.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return {
        "quantization": quantization,
        "full_finetune": args.full_finetune,
        "dtype": args.dtype,
        "quant_storage": args.quant_storage,
        "compute_dtype": args.compute_dtype,
        "adapter_dtype": args.adapter_dtype,
        "norm_dtype": "float32" if args.kbit_prep else None,
        "double_quant": not args.no_double_quant,
        "quantize_experts": not args.no_quantize_experts,
        "lora_r": args.lora_r,
        "lora_dropout": args.lora_dropout,
        "use_dora": args.use_dora,
        "lora_target_modules": targets,
        "lora_target_parameters": [t.strip() for t in (args.lora_target_parameters or "").split(",") if t.strip()]
        or None,
        "trainer": args.trainer,
        "loss_path": args.loss_path,
        "trainer_class": args.trainer_class,
        "loss_chunk_size": args.loss_chunk_size,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "eval_batch_size": args.eval_batch_size,
        "gradient_checkpointing": args.gradient_checkpointing,
        "activation_offloading": args.activation_offloading,
        "sp_size": args.sp_size,
        "tiled_mlp_tokens": args.tiled_mlp_tokens if args.tiled_mlp else 0,
        "model_checkpointing": args.model_checkpointing,
        "attn_implementation": args.attn_implementation,
        "optimizer": args.optimizer,
        "mixed_precision": args.mixed_precision,
        "gpu_memory": args.gpu_memory,
        "num_gpus": args.num_gpus or None,
        "device_map": args.device_map,
        "timeout_minutes": args.timeout_minutes,
        "save_steps": args.save_steps or None,
        "save_only_model": args.save_only_model,
        "write_speed_mb_s": args.write_speed,
        "padding": args.padding,
        "packing": args.packing,
    }


# Values no run can have: a usage error (exit 2, one line), not a report built on a division by zero.
_AT_LEAST_ONE = ("lora_r", "seq_len", "batch_size", "eval_batch_size", "num_gpus", "loss_chunk_size")


def _impossible(args: argparse.Namespace) -> str | None:
    for name in _AT_LEAST_ONE:
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} {value}: must be at least 1"
    if args.save_steps is not None and args.save_steps < 0:
        return f"--save-steps {args.save_steps}: must not be negative (0: no checkpoints)"
    if not 0.0 <= args.lora_dropout < 1.0:
        return f"--lora-dropout {args.lora_dropout}: a dropout probability, from 0 up to (not including) 1"
    for option, value, unit in (
        ("--write-speed", args.write_speed, "MB/s, e.g. 200"),
        ("--timeout-minutes", args.timeout_minutes, "minutes, e.g. 30"),
        ("--gpu-memory", args.gpu_memory, "a memory size, e.g. 80GB"),
    ):
        if value is not None and not value > 0:  # also NaN
            shown = f"{value / 2**30:g}GiB" if option == "--gpu-memory" else value
            return f"{option} {shown}: must be positive ({unit})"
    return None


class DoctorCommand(Command):
    name = "doctor"
    help = "Check a QLoRA/FSDP setup and plan its memory, before launch."
    description = """\
Check a QLoRA/FSDP setup before launch: every known inconsistency (dtypes, 8-bit or integer 4-bit storage
under FSDP, use_orig_params, device maps, activation checkpointing, wrap classes, loading, checkpoint timeouts)
with the setting to change and the value to use, and how much memory each GPU needs (mixture-of-experts models:
total and active parameters, experts in 4 bits)."""
    epilog = """\
examples:
  hf-fsdp-qlora doctor --accelerate-config fsdp2_qlora --model ./Llama-3.1-8B --load-in-4bit --gpu-memory 24GB
  hf-fsdp-qlora doctor --accelerate-config llamaguard3_1b_1x24gb --model ./Llama-Guard-3-1B --full-finetune \\
      --gpu-memory 24GB --json
  # the settings the launch reads (sequence length, batch, checkpoints, LoRA; flags given here win):
  hf-fsdp-qlora doctor --accelerate-config fsdp2_qlora --num-gpus 1 --gpu-memory 24GB --model ./Llama-3.1-8B \\
      --training-config examples/recipes/llama-8b-1x24gb.yaml

--model takes a model directory, its config.json, or a Hugging Face Hub id (org/name: only its config.json is
fetched, with your token and cache; HF_HUB_OFFLINE=1 reads the cache only); no weight is read. Memory sizes: 80GB = 80GiB (GPUs are
sold in binary units). exit status: 0 no error, 1 errors found, 2 usage error."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--accelerate-config",
            required=True,
            metavar="YAML",
            help="accelerate config file, or a shipped config name (hf-fsdp-qlora config --list)",
        )
        parser.add_argument(
            "--model", required=True, metavar="PATH|ORG/NAME", help="model directory, its config.json, or a Hub id"
        )
        parser.add_argument(
            "--training-config",
            metavar="YAML",
            help="the training settings file the launch reads (trl's --config, the example scripts' --config; "
            "examples/recipes/): its max_length, per_device_train_batch_size, save_steps, quantization and LoRA "
            "keys plan the run; an option given here with another value than its default wins",
        )
        quant = parser.add_mutually_exclusive_group()
        quant.add_argument("--load-in-4bit", action="store_true", help="QLoRA: 4-bit NF4 base + LoRA")
        quant.add_argument(
            "--load-in-8bit",
            action="store_true",
            help="LLM.int8 base + LoRA: load_qlora_model(path, bits=8) with our trainers (int8 weights sharded by FSDP; "
            "a stock load_in_8bit base is refused)",
        )
        quant.add_argument("--full-finetune", action="store_true", help="train every weight: no quantization, no LoRA")
        parser.add_argument(
            "--dtype", type=_dtype, default="bfloat16", help="dtype of the base model (default bfloat16)"
        )
        parser.add_argument("--quant-storage", type=_dtype, help="bnb_4bit_quant_storage (default: --dtype)")
        parser.add_argument("--compute-dtype", type=_dtype, help="bnb_4bit_compute_dtype (default: --dtype)")
        parser.add_argument(
            "--adapter-dtype",
            type=_dtype,
            help="LoRA weights' dtype (default float32: peft's autocast_adapter_dtype=True; with --trainer "
            "hf_fsdp_qlora the dtype they train in: float32 master weights, or --dtype for adapter_dtype='bfloat16')",
        )
        parser.add_argument(
            "--kbit-prep", action="store_true", help="prepare_model_for_kbit_training is called (fp32 norms)"
        )
        parser.add_argument("--no-double-quant", action="store_true", help="bnb_4bit_use_double_quant=False")
        parser.add_argument(
            "--no-quantize-experts",
            action="store_true",
            help="mixture of experts: keep the fused experts 16-bit, as a stock load_in_4bit does "
            "(load_qlora_model(..., quantize_experts=False)); default: experts in 4 bits, as load_qlora_model does",
        )
        parser.add_argument("--lora-r", type=_positive, default=16, help="LoRA rank (default 16)")
        parser.add_argument("--lora-dropout", type=float, default=0.05, help="LoRA dropout (default 0.05)")
        parser.add_argument("--use-dora", action="store_true", help="LoraConfig(use_dora=True): plan DoRA's memory")
        parser.add_argument(
            "--lora-target-modules", default="all-linear", help="'all-linear' or comma-separated names"
        )
        parser.add_argument(
            "--lora-target-parameters",
            metavar="NAMES",
            help="LoRA on mixture-of-experts weights: peft's target_parameters (trl: --lora_target_parameters), "
            "comma-separated, e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj",
        )
        parser.add_argument(
            "--trainer",
            choices=("hf_fsdp_qlora", "transformers", "accelerate"),
            default="hf_fsdp_qlora",
            help="who runs the loop: our trainers (default), a stock transformers/trl Trainer, or a plain accelerate loop",
        )
        parser.add_argument(
            "--loss-path",
            choices=LOSS_PATHS,
            help="whose loss holds the logits: ours (our trainers and routes: chunked, one chunk of logits), sft (trl "
            "SFTTrainer: fused LM head tiles), stock (a Trainer without our mixin, or chunked_loss=False: full logits "
            "+ fp32 copy + gradient), dpo (trl DPOTrainer: fused head over chosen+rejected). Default: the path the "
            "run takes (trainer, --trainer-class and the model's config decide, as the trainer does at run time)",
        )
        parser.add_argument(
            "--trainer-class",
            metavar="NAME",
            help="the Trainer class the script builds when it has a loss of its own, e.g. SFTTrainer for trl's sft.py "
            "under `python -m hf_fsdp_qlora.run` (its loss runs, not ours); DPOTrainer for dpo.py",
        )
        parser.add_argument(
            "--loss-chunk-size",
            type=_positive,
            default=DEFAULT_LOSS_CHUNK_SIZE,
            help=f"tokens per chunk of our chunked loss (FSDPQLoRATrainingArguments.loss_chunk_size; default "
            f"{DEFAULT_LOSS_CHUNK_SIZE})",
        )
        parser.add_argument("--seq-len", type=_positive, default=2048, help="tokens per sample (default 2048)")
        parser.add_argument("--batch-size", type=_positive, default=1, help="per_device_train_batch_size (default 1)")
        parser.add_argument("--eval-batch-size", type=_positive, help="per_device_eval_batch_size")
        parser.add_argument(
            "--gradient-checkpointing",
            action="store_true",
            help="TrainingArguments.activation_checkpointing (formerly gradient_checkpointing) is on",
        )
        parser.add_argument(
            "--model-checkpointing",
            action="store_true",
            help="activation checkpointing is enabled on the model itself, e.g. by load_qlora_model (its default)",
        )
        parser.add_argument(
            "--activation-offloading",
            action="store_true",
            help="FSDPQLoRATrainingArguments(activation_offloading=True): saved activations live in host RAM",
        )
        parser.add_argument(
            "--sp-size",
            type=_positive,
            default=1,
            help="FSDPQLoRATrainingArguments(sp_size=N): N ranks share each sequence (Ulysses; default 1)",
        )
        parser.add_argument(
            "--tiled-mlp", action="store_true", help="FSDPQLoRATrainingArguments(tiled_mlp=True): MLPs over tiles"
        )
        parser.add_argument(
            "--tiled-mlp-tokens", type=_positive, default=1024, help="tokens per MLP tile (default 1024)"
        )
        parser.add_argument("--attn-implementation", choices=("sdpa", "flash_attention_2", "eager"), default="sdpa")
        parser.add_argument("--optimizer", choices=("adamw", "adamw_8bit", "sgd"), default="adamw")
        parser.add_argument(
            "--mixed-precision",
            choices=("no", "bf16", "fp16"),
            help="override the config's mixed_precision, as TrainingArguments(bf16=True) does",
        )
        parser.add_argument("--gpu-memory", type=_size, help="memory of one GPU, e.g. 80GB (enables the verdict)")
        parser.add_argument("--num-gpus", type=_positive, help="GPUs in all (default: the config's num_processes)")
        parser.add_argument("--device-map", help="from_pretrained(device_map=...): auto, balanced, sequential, ...")
        parser.add_argument(
            "--timeout-minutes",
            type=float,
            default=30.0,
            help="collective timeout (TrainingArguments.ddp_timeout / 60; default 30)",
        )
        parser.add_argument("--save-steps", type=_positive, default=500, help="checkpoint every N steps (0: never)")
        parser.add_argument("--save-only-model", action="store_true", help="checkpoints without optimizer state")
        parser.add_argument(
            "--write-speed",
            type=float,
            default=200.0,
            metavar="MB_S",
            help="checkpoint write speed per writer in MB/s (default 200, a network filesystem)",
        )
        parser.add_argument("--padding", choices=("longest", "max_length"), default="longest")
        parser.add_argument("--packing", action="store_true", help="samples are packed into full sequences")
        parser.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
        parser.add_argument(
            "--longest",
            action="store_true",
            help="also print the longest --seq-len whose plan the verdict calls fits (within 90%% of --gpu-memory, every "
            "other setting as given), capped at the model's max_position_embeddings; the 100%% edge beside it",
        )

    def run(self, args: argparse.Namespace) -> int:
        """Print the report; 0 no error, 1 errors found, 2 usage error."""
        if args.training_config:
            _apply_training_config(self, args)
        problem = _impossible(args)
        if problem:
            raise CommandError(problem)
        from hf_fsdp_qlora.doctor import SetupInputError, diagnose, render, to_json

        try:
            diagnosis = diagnose(args.model, accelerate_config=args.accelerate_config, **_settings(args))
        except SetupInputError as err:  # not an accelerate config, an unknown key, no config.json
            raise CommandError(str(err)) from err
        if args.json:
            print(json.dumps(to_json(diagnosis), indent=2))
        else:
            print(render(diagnosis))
        if args.longest:
            print(_longest_line(diagnosis))
        return diagnosis.exit_code


_QUANTIZATION = ("load_in_4bit", "load_in_8bit", "full_finetune")


def _apply_training_config(command: Command, args: argparse.Namespace) -> None:
    """Plan with the settings the launch reads from the same file: each option the file sets replaces the option's
    default; one given on the command line (another value than its default) wins, as flags beside trl's --config do."""
    from hf_fsdp_qlora.training_config import doctor_values, read_training_config

    try:
        values = doctor_values(read_training_config(args.training_config))
    except (OSError, ValueError) as err:
        raise CommandError(f"--training-config {args.training_config}: {err}") from err
    defaults = argparse.ArgumentParser()
    command.add_arguments(defaults)
    given = {dest for dest in values if getattr(args, dest) != defaults.get_default(dest)}
    if any(getattr(args, q) for q in _QUANTIZATION):  # --load-in-8bit beside a file's load_in_4bit: the flag's
        given.update(_QUANTIZATION)
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)
    if sum(bool(getattr(args, q)) for q in _QUANTIZATION) > 1:
        raise CommandError(
            f"--training-config {args.training_config}: sets more than one of {', '.join(_QUANTIZATION)}"
        )


def _longest_line(diagnosis) -> str:
    """The doctor's answer to "what is the longest sequence that fits" for the setup as given: a length its own
    verdict calls "fits", capped at the model's positions, with the 100% edge (and the uncapped figure) beside it."""
    from hf_fsdp_qlora.doctor.longest import longest_answer

    setup = diagnosis.setup
    if diagnosis.shape is None or not setup.gpu_memory:
        raise CommandError("--longest needs the model's config (shapes) and --gpu-memory, e.g. --gpu-memory 80GB")
    answer = longest_answer(diagnosis.shape, setup)
    if answer.capped:
        why = (f"the model's max_position_embeddings: the memory would allow {answer.fits:,} (verdict fits), "
               f"{answer.edge:,} at 100% of it; past the positions see seq-len-above-max-positions")  # fmt: skip
    else:
        why = f"verdict fits, the plan within 90% of memory; {answer.edge:,} at 100% of it, verdict tight"
    return (
        f"longest sequence that fits: {answer.advised:,} tokens per sample ({why}; batch {setup.batch_size}, "
        f"{setup.world_size} GPU(s) of {setup.gpu_memory / 2**30:.0f} GiB, sp_size={setup.sp_size}, tiled MLP "
        f"{'on' if setup.tiled_mlp_tokens else 'off'})"
    )
