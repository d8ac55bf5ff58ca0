"""`hf-fsdp-qlora config`: find, list and show the shipped accelerate FSDP configs.

    accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" train.py
    hf-fsdp-qlora config --list
    hf-fsdp-qlora config --show fsdp2_qlora

Only the standard library is imported here, so the command answers instantly (no torch import).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_fsdp_qlora.cli._command import Command, CommandError
from hf_fsdp_qlora.configs import config_path, list_configs

__all__ = ["ConfigCommand"]


def _description(path: Path) -> str:
    # Each shipped YAML opens with `# <one-line description>`.
    with path.open(encoding="utf-8") as file:
        first = file.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""


class ConfigCommand(Command):
    name = "config"
    help = "Path, list or contents of the shipped accelerate FSDP configs."
    description = """\
Print the absolute path of a shipped accelerate config file, for `accelerate launch --config_file`.
Every file opens with a comment giving its exact launch command and why each non-obvious setting is set."""
    epilog = """\
examples:
  accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)" train.py
  hf-fsdp-qlora config --list                # names and one-line descriptions
  hf-fsdp-qlora config --show fsdp2_qlora    # print the file (copy it to edit it)
  hf-fsdp-qlora config --show fsdp2_qlora_multinode > multinode.yaml"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        what = parser.add_mutually_exclusive_group(required=True)
        what.add_argument(
            "name",
            nargs="?",
            metavar="NAME",
            help="config to locate, e.g. fsdp2_qlora (the .yaml suffix is optional); prints only its absolute path",
        )
        what.add_argument("--list", action="store_true", help="list the available configs with a one-line description")
        what.add_argument("--show", metavar="NAME", help="print the contents of config NAME")

    def run(self, args: argparse.Namespace) -> int:
        """0 on success; an unknown name is a usage error (2) whose message lists the available configs."""
        if args.list:
            names = list_configs()
            width = max(map(len, names), default=0)
            for name in names:
                print(f"{name:<{width}}  {_description(config_path(name))}")
            return 0
        name = args.show if args.show is not None else args.name
        try:
            path = config_path(name)
        except ValueError as err:
            raise CommandError(str(err)) from err
        if args.show is not None:
            sys.stdout.write(path.read_text(encoding="utf-8"))
        else:
            # Only the path on stdout, so that `$(hf-fsdp-qlora config NAME)` can be passed to accelerate as is.
            print(path)
        return 0
