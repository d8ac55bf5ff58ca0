"""`hf-fsdp-qlora`: the umbrella command. Each subcommand lives in its own module under `cli/`."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under hf_fsdp_qlora.cli exposing `register(subparsers)`; the module's `run(args)`
# is what the subcommand calls. Modules are imported only to build the parser (cheap: they import
# torch/transformers lazily inside `run`).
_COMMANDS = {
    "config": "config",
    "merge": "merge",
    "convert": "convert",
    "doctor": "doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-fsdp-qlora",
        description="QLoRA fine-tuning under FSDP with the Hugging Face stack: shipped accelerate configs, "
        "adapter merging and more.",
    )
    from hf_fsdp_qlora import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in _COMMANDS.items():
        try:
            module = importlib.import_module(f"hf_fsdp_qlora.cli.{module_name}")
        except ModuleNotFoundError as err:  # a command not written yet in this checkout
            if err.name != f"hf_fsdp_qlora.cli.{module_name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
