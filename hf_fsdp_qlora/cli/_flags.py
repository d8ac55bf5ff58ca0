"""Library messages name Python parameters; the command line shows its own flags instead.

The library writes a parameter as `name` or `name=value` (in backticks). A command rewrites the names it has an
option for - its argparse destinations, ``vars(args)`` - into the flag (``--name-with-dashes``), so the same error
reads right in Python (``merge_adapters(force=True)``) and on the command line (``--force``); ``name=False`` is
``--no-name``.
"""

from __future__ import annotations

import re

__all__ = ["cli_message", "flag"]

_REFERENCE = re.compile(r"`([a-z_][a-z0-9_]*)(?:=([^`]*))?`")


def flag(name: str) -> str:
    """The option of parameter `name`: every command spells its options as the parameter with dashes."""
    return "--" + name.replace("_", "-")


def cli_message(text: str, names) -> str:
    """`text` with each `name` / `name=value` whose name is in `names` written as the command-line option."""

    def replace(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        if name not in names:
            return match.group(0)
        if value is None or value == "True":  # a switch: `force=True` is --force
            return flag(name)
        if value == "False":  # its negative form: `double_quant=False` is --no-double-quant
            return "--no-" + flag(name).removeprefix("--")
        return f"{flag(name)} {value.strip(chr(39) + chr(34))}"

    return _REFERENCE.sub(replace, text)
