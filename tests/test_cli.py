"""The command interface: every registered command documents its options, and every command's errors become
one line on stderr and the documented exit status, through the one dispatcher (`run_command`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys

import pytest

from hf_fsdp_qlora.cli._command import Command, CommandError, run_command
from hf_fsdp_qlora.cli.main import COMMANDS, build_parser, main, merge_adapters_main
from hf_fsdp_qlora.errors import FSDPNotEngagedError, MergeError, MergeUsageError, UnsupportedSetupError


def _help(entry, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        entry(argv)
    assert exc.value.code == 0, argv
    return out.getvalue()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_is_registered_and_listed():
    assert [c.name for c in COMMANDS] == ["config", "merge", "convert", "export-gguf", "doctor", "explain"]
    assert set(_subparsers()) == {c.name for c in COMMANDS}
    overview = _help(main, ["--help"])
    for command in COMMANDS:
        assert command.name in overview and command.help in overview, command.name


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_every_command_help_exits_0_and_lists_its_options(name):
    parser = _subparsers()[name]
    text = _help(main, [name, "--help"])
    options = _options(parser) - {"-h", "--help"}
    assert options, f"{name} declares no option"
    missing = sorted(opt for opt in options if opt not in text)
    assert not missing, f"`hf-fsdp-qlora {name} --help` does not list {missing}"
    command = next(c for c in COMMANDS if c.name == name)
    assert command.description.splitlines()[0] in text
    if command.epilog:
        assert command.epilog.splitlines()[0] in text


def test_merge_adapters_is_the_merge_command_under_its_own_name():
    # The two spellings share one option list; only the standalone script adds --version.
    text = _help(merge_adapters_main, ["--help"])
    assert text.startswith("usage: merge-adapters ")
    merge = _subparsers()["merge"]
    for opt in _options(merge):
        assert opt in text, opt
    assert "--version" in text
    assert _help(merge_adapters_main, ["--version"]).startswith("merge-adapters ")


def test_help_and_parsing_do_not_import_torch():
    # One interpreter for every command, so the check costs one start-up.
    code = (
        "import sys, contextlib, io\n"
        "from hf_fsdp_qlora.cli.main import COMMANDS, main\n"
        "for c in COMMANDS:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([c.name, '--help'])\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch for --help'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    # `python -m hf_fsdp_qlora.cli` is the umbrella command without the console scripts (tests/test_cuda.py).
    proc = subprocess.run(
        [sys.executable, "-m", "hf_fsdp_qlora.cli", "merge", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and "usage: hf-fsdp-qlora merge" in proc.stdout, proc.stderr


class _Raises(Command):
    """A command whose `run` raises what it is given, to exercise the dispatcher alone."""

    name = "raises"
    help = description = "raise an error"

    def __init__(self, error: BaseException, writes_output: bool = False):
        self.error = error
        self.writes_output = writes_output

    def add_arguments(self, parser):
        pass

    def run(self, args):
        raise self.error


@pytest.mark.parametrize(
    "error, code",
    [
        (CommandError("--lora-r 0: must be at least 1"), 2),
        (CommandError("the checkpoint could not be read", exit_code=1), 1),
        (MergeUsageError("--output x already exists: pass --force"), 2),
        (MergeError("adapter does not fit the base"), 1),
        (UnsupportedSetupError("bnb_4bit_quant_storage=uint8 cannot be sharded: use torch.bfloat16"), 2),
        (FSDPNotEngagedError("FSDP was requested but the model is not wrapped"), 1),
        (OSError(28, "No space left on device"), 1),
    ],
)
def test_dispatcher_maps_errors_to_one_line_and_exit_status(error, code, capsys):
    assert run_command(_Raises(error), argparse.Namespace()) == code
    out, err = capsys.readouterr()
    assert not out and err == f"hf-fsdp-qlora raises: error: {error}\n"


def test_dispatcher_lets_bugs_raise_and_reports_interruption(capsys):
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_command(_Raises(ZeroDivisionError("division by zero")), argparse.Namespace())
    assert run_command(_Raises(KeyboardInterrupt(), writes_output=True), argparse.Namespace()) == 130
    assert capsys.readouterr().err == "hf-fsdp-qlora raises: interrupted; no output was written\n"
    assert run_command(_Raises(KeyboardInterrupt()), argparse.Namespace()) == 130
    assert capsys.readouterr().err == "hf-fsdp-qlora raises: interrupted\n"


def test_sigterm_becomes_exit_143_with_one_line():
    code = (
        "import argparse, os, signal, sys\n"
        "from hf_fsdp_qlora.cli._command import Command, run_command\n"
        "class Slow(Command):\n"
        "    name = 'slow'; writes_output = True\n"
        "    def run(self, args):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        raise AssertionError('SIGTERM did not interrupt the command')\n"
        "sys.exit(run_command(Slow(), argparse.Namespace()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr == "hf-fsdp-qlora slow: terminated; no output was written\n"


def test_real_commands_report_library_errors_in_one_line(tmp_path, capsys):
    # A library error (MergeUsageError from hf_fsdp_qlora.merge) and a command's own usage error, end to end.
    rc = main(
        ["merge", "--base", str(tmp_path / "nobase"), "--adapter", str(tmp_path), "--output", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("merge-adapters: error: --base ") and len(err.splitlines()) == 1, err
    assert main(["convert", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-fsdp-qlora convert: error: ") and "not an FSDP sharded checkpoint" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()
    assert main(["config", "no_such_config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-fsdp-qlora config: error: ") and "fsdp2_qlora" in err and len(err.splitlines()) == 1


def test_no_command_prints_the_overview_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
