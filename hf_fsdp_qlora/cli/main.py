"""The console scripts: `hf-fsdp-qlora COMMAND` and `merge-adapters` (the `merge` command on its own).

Each command is a `Command` in its own module under `cli/`; this module only lists them, builds the parser
and hands the chosen one to `run_command`, which reports its errors.
"""

from __future__ import annotations

import argparse

from hf_fsdp_qlora import __version__
from hf_fsdp_qlora.cli._command import UMBRELLA, Command, run_command
from hf_fsdp_qlora.cli.config import ConfigCommand
from hf_fsdp_qlora.cli.convert import ConvertCommand
from hf_fsdp_qlora.cli.doctor import DoctorCommand
from hf_fsdp_qlora.cli.explain import ExplainCommand
from hf_fsdp_qlora.cli.gguf import ExportGgufCommand
from hf_fsdp_qlora.cli.merge import MergeCommand

__all__ = ["COMMANDS", "build_parser", "main", "merge_adapters_main"]

# In the order `hf-fsdp-qlora --help` lists them.
COMMANDS: tuple[Command, ...] = (
    ConfigCommand(),
    MergeCommand(),
    ConvertCommand(),
    ExportGgufCommand(),
    DoctorCommand(),
    ExplainCommand(),
)


def _add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=UMBRELLA,
        description="QLoRA fine-tuning under FSDP with the Hugging Face stack: shipped accelerate configs, "
        "adapter merging and more.",
    )
    _add_version(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`hf-fsdp-qlora`: returns the exit status (2 and the overview when no command is given)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return run_command(args.cli_command, args)


def merge_adapters_main(argv: list[str] | None = None) -> int:
    """`merge-adapters`: the `merge` command under its own name, as users of the merge alone know it."""
    command = MergeCommand()
    parser = command.standalone_parser(prog=command.prog)
    _add_version(parser)
    return run_command(command, parser.parse_args(argv))
