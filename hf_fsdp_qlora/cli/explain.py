"""`hf-fsdp-qlora explain`: find the known FSDP + QLoRA errors in a log or a pasted traceback.

    hf-fsdp-qlora explain train.log
    accelerate launch ... 2>&1 | hf-fsdp-qlora explain -
    hf-fsdp-qlora explain          # on a terminal: paste the traceback, then Ctrl-D

A message with several known causes is reported as a possible cause, with what tells them apart, unless the log
holds what makes the cause certain (e.g. the ``merge_and_unload`` frame of a device mismatch).

The entries come from :mod:`hf_fsdp_qlora.error_index`, the same table ``docs/errors.md`` is rendered from.
Only the standard library is imported, so the command answers instantly.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

from hf_fsdp_qlora.cli._command import Command, CommandError

__all__ = ["ExplainCommand"]


def _paragraph(label: str, text: str) -> str:
    # The index is written in Markdown for docs/errors.md; a terminal shows the words of its links and code.
    plain = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text).replace("`", "")
    return textwrap.fill(f"{label}: {plain}", width=100, subsequent_indent="    ")


class ExplainCommand(Command):
    name = "explain"
    help = "Explain the known errors in a log or traceback"
    description = """\
Read a training log or a pasted traceback and print, for every known error found in it, the cause, what
hf_fsdp_qlora does about it and the setting to change on the stock stack (the entries of docs/errors.md)."""
    epilog = """\
examples:
  hf-fsdp-qlora explain train.log
  accelerate launch ... 2>&1 | tee train.log | hf-fsdp-qlora explain -
  hf-fsdp-qlora explain                 # on a terminal: paste the traceback, then Ctrl-D (Ctrl-Z Enter on Windows)
  hf-fsdp-qlora explain --list          # every known error, by id

A message that has other causes than the entry's (a device mismatch, an out-of-memory error, a NaN loss) is
reported as "possible", with what tells the causes apart, unless the log holds what makes it certain.

exit status: 0 a known error (or a possible cause) was found, 1 none was, 2 usage error (e.g. FILE unreadable)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "file", nargs="?", default="-", metavar="FILE", help="log file to read; '-' (the default) reads stdin"
        )
        parser.add_argument("--list", action="store_true", help="list every known error (id and title) and exit")

    def run(self, args: argparse.Namespace) -> int:
        from hf_fsdp_qlora.error_index import ERRORS, find_known_errors, is_certain

        if args.list:
            width = max(len(entry.id) for entry in ERRORS)
            for entry in ERRORS:
                print(f"{entry.id:<{width}}  {entry.title}")
            return 0
        if args.file == "-":
            if sys.stdin.isatty():  # else a bare `explain` waits silently for input the user does not know to give
                print(
                    f"{self.prog}: reading the log from the terminal: paste the traceback, then press Ctrl-D "
                    f"(Ctrl-Z Enter on Windows). Or: `{self.prog} train.log`, `... 2>&1 | {self.prog} -`.",
                    file=sys.stderr,
                    flush=True,
                )
            log = sys.stdin.read()
        else:
            try:
                log = Path(args.file).read_text(encoding="utf-8", errors="replace")
            except OSError as err:
                raise CommandError(f"cannot read FILE {args.file}: {err.strerror or err}") from err
        found = find_known_errors(log)
        if not found:
            print(
                f"{self.prog}: no known error found in {'stdin' if args.file == '-' else args.file} "
                f"({len(ERRORS)} known: `{self.prog} --list`; the index is docs/errors.md)"
            )
            return 1
        for entry in found:
            if is_certain(entry, log):
                print(f"== {entry.title} [{entry.id}]")
                print(_paragraph("cause", entry.cause))
            else:
                print(f"== possibly: {entry.title} [{entry.id}] (this message has other causes too)")
                print(_paragraph("cause, if it is this one", entry.cause))
                print(_paragraph("other causes", entry.other_causes))
            print(_paragraph("hf_fsdp_qlora", entry.ours))
            print(_paragraph("stock fix", entry.stock_fix))
            print(f"docs: docs/{entry.anchor}")
            print()
        return 0
