"""`merge-adapters` / `hf-fsdp-qlora merge`: merge a LoRA adapter into its 16-bit base, streamed.

The work is :func:`hf_fsdp_qlora.merge.merge_adapters`; this module only parses options and turns its
errors into a message and an exit status (1: the merge failed, 2: usage). torch is imported in `run`,
so `--help` is instant.
"""

from __future__ import annotations

import argparse
import signal
import sys

__all__ = ["build_parser", "main", "merge_command_parser", "register", "run"]

_DESCRIPTION = "Merge a LoRA adapter into its 16-bit base model and write a plain, sharded safetensors model."
_EPILOG = """\
The base is read one tensor at a time and every update is computed in float32 and cast once, so peak
memory is about the largest tensor, not the model. The output appears only when complete; with --force
the old output is kept until then. --force replaces only an earlier output of this tool; an --output that
is, contains or lies inside --base or --adapter (symlinks and .. resolved) is always refused.

example:
  merge-adapters --base ./Llama-3.1-8B --adapter ./run/checkpoint-500 --output ./merged --dtype bfloat16

exit status: 0 merged, 1 the merge failed (adapter does not fit the base, corrupted file, full disk),
2 usage error (bad option, missing path, existing output without --force, an output that may not be
replaced, no CUDA for --device cuda).
"""


def merge_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `merge` options, as a subcommand of `subparsers` or as a standalone parser."""
    kwargs = {"description": _DESCRIPTION, "epilog": _EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    if subparsers is not None:
        parser = subparsers.add_parser("merge", help="merge a LoRA adapter into its 16-bit base", **kwargs)
    else:
        parser = argparse.ArgumentParser(prog="merge-adapters", **kwargs)
    parser.add_argument("--base", required=True, metavar="PATH", help="16-bit base model folder (safetensors)")
    parser.add_argument(
        "--adapter",
        required=True,
        metavar="PATH",
        help="peft adapter folder, Trainer checkpoint folder, or FSDP sharded checkpoint (pytorch_model_fsdp_0)",
    )
    parser.add_argument("--output", required=True, metavar="PATH", help="folder to create for the merged model")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="dtype of the merged floating-point tensors (default: the base's own dtype)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest output shard, e.g. 5GB, 500MB, 2GiB (default: 5GB)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the updates are computed: cpu or cuda[:N] (default: cpu)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --output that an earlier merge-adapters or convert wrote and that holds nothing "
        "else (kept until the new one is complete); any other folder is left alone",
    )
    parser.add_argument(
        "--adapter-config",
        default=None,
        metavar="PATH",
        help="adapter_config.json of the run, for an FSDP sharded checkpoint saved without one",
    )
    parser.add_argument(
        "--allow-other-base",
        action="store_true",
        help="merge even though adapter_config.json names a local model of another architecture than --base",
    )
    parser.add_argument(
        "--dequantize",
        choices=["nf4", "fp4"],
        default=None,
        help="merge onto the 4-bit round trip of the base that QLoRA trained against, with this "
        "bnb_4bit_quant_type (default: merge onto the 16-bit base as is)",
    )
    parser.add_argument(
        "--no-double-quant",
        dest="double_quant",
        action="store_false",
        help="with --dequantize: training used bnb_4bit_use_double_quant=False (default: double quant on)",
    )
    parser.add_argument(
        "--quant-blocksize",
        type=int,
        default=64,
        help="with --dequantize: the 4-bit block size of training (default: 64)",
    )
    parser.add_argument(
        "--untie-embeddings",
        action="store_true",
        help="if the adapter changes only one side of tied input/output embeddings, write both "
        "(tie_word_embeddings=false) instead of failing (default: fail)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide the per-shard progress bars"
    )
    if subparsers is not None:
        parser.set_defaults(func=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return merge_command_parser()


def register(subparsers) -> argparse.ArgumentParser:
    """Add `merge` to the umbrella `hf-fsdp-qlora` command."""
    return merge_command_parser(subparsers)


def _terminate(signum, frame):
    # Turn SIGTERM into an exception so the partial output folder is removed on the way out.
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Run the merge described by parsed `args`; returns the exit status."""
    from hf_fsdp_qlora.cli._flags import cli_message
    from hf_fsdp_qlora.errors import MergeError
    from hf_fsdp_qlora.merge import merge_adapters

    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        output = merge_adapters(
            args.base,
            args.adapter,
            args.output,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            device=args.device,
            force=args.force,
            dequantize=args.dequantize,
            double_quant=args.double_quant,
            quant_blocksize=args.quant_blocksize,
            untie_embeddings=args.untie_embeddings,
            adapter_config=args.adapter_config,
            allow_other_base=args.allow_other_base,
            progress=args.progress,
        )
    except MergeError as err:  # the library names parameters; show them as this command's options
        print(f"merge-adapters: error: {cli_message(str(err), vars(args))}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("merge-adapters: interrupted; no output was written", file=sys.stderr)
        return 130
    except SystemExit:  # SIGTERM, via _terminate; the partial folder is already removed
        print("merge-adapters: terminated; no output was written", file=sys.stderr)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"merged model written to {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `merge-adapters` console script."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
