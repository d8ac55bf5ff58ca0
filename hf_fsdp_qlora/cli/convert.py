"""`hf-fsdp-qlora convert`: turn an FSDP sharded checkpoint into a plain peft adapter folder.

Reads the `.distcp` files with torch.distributed.checkpoint (no process group, one process), keeps only
the trained tensors, and writes `adapter_model.safetensors` + `adapter_config.json` that
`PeftModel.from_pretrained` and `merge-adapters` load. torch is imported in `run`.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "convert_command_parser", "main", "register", "run"]

_DESCRIPTION = "Convert an FSDP sharded checkpoint (.distcp) into a plain peft adapter folder."
_EPILOG = """\
CHECKPOINT is a Trainer checkpoint folder holding pytorch_model_fsdp_0/, or that folder itself. The
adapter_config.json is taken from beside it (the checkpoint folder or its parents) unless given.

example:
  hf-fsdp-qlora convert ./run/checkpoint-500 --output ./adapter-500

exit status: 0 converted, 1 the checkpoint could not be read, 2 usage error.
"""


def convert_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `convert` options, as a subcommand of `subparsers` or as a standalone parser."""
    kwargs = {"description": _DESCRIPTION, "epilog": _EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    if subparsers is not None:
        parser = subparsers.add_parser("convert", help="FSDP sharded checkpoint -> peft adapter folder", **kwargs)
    else:
        parser = argparse.ArgumentParser(prog="hf-fsdp-qlora convert", **kwargs)
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="FSDP checkpoint folder (with .distcp files)")
    parser.add_argument("--output", required=True, metavar="ADAPTER_DIR", help="peft adapter folder to create")
    parser.add_argument(
        "--adapter-config",
        default=None,
        metavar="PATH",
        help="adapter_config.json of the run (default: found beside the checkpoint)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --output that an earlier convert or merge-adapters wrote (nothing else)",
    )
    if subparsers is not None:
        parser.set_defaults(func=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return convert_command_parser()


def register(subparsers) -> argparse.ArgumentParser:
    """Add `convert` to the umbrella `hf-fsdp-qlora` command."""
    return convert_command_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """Convert the checkpoint named in parsed `args`; returns the exit status."""
    from pathlib import Path

    from hf_fsdp_qlora._adapter_io import find_distcp_dir, load_adapter, write_adapter_files
    from hf_fsdp_qlora._output_dir import AtomicOutputDir, check_output
    from hf_fsdp_qlora.cli._flags import cli_message
    from hf_fsdp_qlora.errors import MergeError

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir() or find_distcp_dir(checkpoint) is None:
        print(
            f"hf-fsdp-qlora convert: error: {checkpoint} is not an FSDP sharded checkpoint (no .metadata and "
            ".distcp files in it or in a pytorch_model_fsdp_* folder under it)",
            file=sys.stderr,
        )
        return 2
    # The checkpoint (its .distcp shards, optimizer and trainer state) and the adapter config are inputs:
    # an output that overlaps them is refused before anything is read or written.
    inputs = [("CHECKPOINT", checkpoint)]
    if args.adapter_config is not None:
        inputs.append(("--adapter-config", args.adapter_config))
    try:
        output = check_output(args.output, inputs, args.force)
        adapter = load_adapter(checkpoint, config_path=args.adapter_config, fsdp_only=True)
        with AtomicOutputDir(output, "convert") as tmp:
            write_adapter_files(adapter, tmp)
    except MergeError as err:  # the library names parameters; show them as this command's options
        print(f"hf-fsdp-qlora convert: error: {cli_message(str(err), vars(args))}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"hf-fsdp-qlora convert: error: {err}", file=sys.stderr)
        return 1
    print(f"adapter with {len(adapter.tensors)} tensors written to {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
