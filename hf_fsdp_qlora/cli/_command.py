"""The interface every `hf-fsdp-qlora` command implements, and the one place its errors become exit statuses.

A command declares its options (`add_arguments`) and does its work (`run`); building the parser, the error
line on stderr, the exit status and interruption are handled here, the same way for every command.
Nothing here imports torch, so that `--help` and `config` answer instantly.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import ClassVar

from hf_fsdp_qlora.cli._flags import cli_message
from hf_fsdp_qlora.errors import FSDPNotEngagedError, MergeError, UnsupportedSetupError

__all__ = ["Command", "CommandError", "run_command"]

UMBRELLA = "hf-fsdp-qlora"


class CommandError(Exception):
    """A problem the command line reports in one line, with its exit status (2: usage, 1: the work failed)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class Command:
    """One subcommand of `hf-fsdp-qlora`.

    Subclasses set `name`, `help` (one line in `hf-fsdp-qlora --help`), `description` and `epilog` (the
    command's own `--help`), and implement `add_arguments` and `run`. Heavy imports belong in `run`.
    """

    name: ClassVar[str]
    help: ClassVar[str]
    description: ClassVar[str]
    epilog: ClassVar[str] = ""
    # Whether `run` writes an output folder. Such commands write through AtomicOutputDir, which removes its
    # partial folder on any exception, so an interruption can truthfully say that nothing was written.
    writes_output: ClassVar[bool] = False

    @property
    def prog(self) -> str:
        """The name that starts this command's error lines."""
        return f"{UMBRELLA} {self.name}"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        raise NotImplementedError

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit status. Raise `CommandError` or an `hf_fsdp_qlora.errors` error."""
        raise NotImplementedError

    def _parser_kwargs(self) -> dict:
        return {
            "description": self.description,
            "epilog": self.epilog or None,
            "formatter_class": argparse.RawDescriptionHelpFormatter,
        }

    def register(self, subparsers) -> argparse.ArgumentParser:
        """Add this command and its options to the umbrella parser's `subparsers`."""
        parser = subparsers.add_parser(self.name, help=self.help, **self._parser_kwargs())
        self.add_arguments(parser)
        parser.set_defaults(cli_command=self)
        return parser

    def standalone_parser(self, prog: str) -> argparse.ArgumentParser:
        """This command's parser on its own, for a console script of its own (`merge-adapters`)."""
        parser = argparse.ArgumentParser(prog=prog, **self._parser_kwargs())
        self.add_arguments(parser)
        return parser


class _Terminated(SystemExit):
    """SIGTERM, raised as an exception so that the output being written is removed on the way out."""


def _terminate(signum, frame):
    raise _Terminated(128 + signum)


def _exit_code(err: Exception) -> int | None:
    """The exit status for an error the command line reports in one line; None: a bug, let it raise."""
    if isinstance(err, (CommandError, MergeError)):
        return err.exit_code
    if isinstance(err, UnsupportedSetupError):
        return 2  # a setting that cannot work: the user changes it
    if isinstance(err, (FSDPNotEngagedError, OSError)):
        return 1  # the inputs were fine, the work failed (e.g. a full disk, an unreadable file)
    return None


def run_command(command: Command, args: argparse.Namespace) -> int:
    """Run `command` and turn its errors into one line on stderr and an exit status."""
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (e.g. called from a server's worker): leave signals alone
        previous = None
    nothing_written = "; no output was written" if command.writes_output else ""
    try:
        return int(command.run(args))
    except KeyboardInterrupt:
        print(f"{command.prog}: interrupted{nothing_written}", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{command.prog}: terminated{nothing_written}", file=sys.stderr)
        raise
    except Exception as err:
        code = _exit_code(err)
        if code is None:
            raise
        # The library names Python parameters (`force=True`); the command line shows its own options (--force).
        print(f"{command.prog}: error: {cli_message(str(err), vars(args))}", file=sys.stderr)
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
