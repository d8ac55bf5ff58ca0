"""The error index: the failures people meet with FSDP + QLoRA on the Hugging Face stack, keyed by their message.

One table, read by everything that talks about these errors: ``hf-fsdp-qlora explain`` matches a log against it,
``docs/errors.md`` is rendered from it (``python -m hf_fsdp_qlora.error_index > docs/errors.md``; a test checks
the page equals the rendering), and a guard test checks that every entry's backing tests exist and hold its text.
Only the standard library is imported, so ``explain`` answers without importing torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._error_entries import ENTRIES

__all__ = ["ERRORS", "KnownError", "find_known_errors", "is_certain", "render_markdown"]


@dataclass(frozen=True)
class KnownError:
    """One entry of the index.

    Attributes:
        id: stable identifier, also the anchor in ``docs/errors.md``.
        title: the message in a few words (the heading).
        text: the exact text the stock stack prints (or, where the stock stack is silent, ours).
        pattern: a regular expression that finds the error in a log or traceback.
        cause: why it happens.
        ours: what this package does about it.
        stock_fix: the setting to change on the stock stack, and the value to use.
        tests: pytest node ids that back the entry (reproduce the stock text where a CPU can, and show ours passes).
        test_text: a part of ``text`` that the backing tests' files contain; None where a CPU cannot reproduce it.
        cpu: why a CPU cannot reproduce the stock text (None where it can).
        context: a regular expression that, found in the same log, makes this cause certain.
        other_causes: the other causes of the same message and how to tell them apart. When set, a log that
            matches `pattern` but not `context` gets this entry as a possible cause, not as the cause.
    """

    id: str
    title: str
    text: str
    pattern: str
    cause: str
    ours: str
    stock_fix: str
    tests: tuple[str, ...]
    test_text: str | None = None
    cpu: str | None = None
    context: str | None = None
    other_causes: str | None = None

    @property
    def anchor(self) -> str:
        return f"errors.md#{self.id}"


ERRORS: tuple[KnownError, ...] = tuple(KnownError(**entry) for entry in ENTRIES)


def find_known_errors(log: str) -> list[KnownError]:
    """The entries whose pattern occurs in `log` (a log file or a pasted traceback), in index order."""
    return [entry for entry in ERRORS if re.search(entry.pattern, log, flags=re.MULTILINE)]


def is_certain(entry: KnownError, log: str) -> bool:
    """Whether `entry`'s cause is certain for `log` (which matches its pattern): its message has no other known
    cause, or the log also holds the entry's context (e.g. the ``merge_and_unload`` frame of a device mismatch)."""
    if entry.other_causes is None:
        return True
    return entry.context is not None and re.search(entry.context, log, flags=re.MULTILINE) is not None


def _tests_line(entry: KnownError) -> str:
    nodes = ", ".join(f"`{node}`" for node in entry.tests)
    if entry.cpu:
        return f"**Tested:** {nodes}. {entry.cpu}"
    return f"**Tested:** {nodes} (the stock text reproduced on CPU, and our route without it)."


def render_markdown() -> str:
    """The page ``docs/errors.md``: one section per entry, anchored by its id."""
    lines = [
        "# Errors, by message",
        "",
        "<!-- Generated from hf_fsdp_qlora/error_index.py by `python -m hf_fsdp_qlora.error_index`. Do not edit. -->",
        "",
        "Start from the message you saw. `hf-fsdp-qlora explain LOG` (or `... | hf-fsdp-qlora explain -`) finds",
        "these entries in a log or a pasted traceback. Each entry gives the exact text, the cause, what this",
        "package does about it, and the setting to change if you stay on the stock stack. Every entry is backed by",
        "the tests it names. Where the same message has other causes, the entry says how to tell them apart, and",
        "`explain` reports the entry as a possible cause unless the log holds what makes it certain.",
        "",
    ]
    lines += [f"- [{entry.title}](#{entry.id})" for entry in ERRORS]
    for entry in ERRORS:
        lines += [
            "",
            f"## {entry.title} {{ #{entry.id} }}",
            "",
            "```text",
            entry.text,
            "```",
            "",
            f"**Cause:** {entry.cause}",
            "",
            *([f"**Same message, other causes:** {entry.other_causes}", ""] if entry.other_causes else []),
            f"**What hf_fsdp_qlora does:** {entry.ours}",
            "",
            f"**On the stock stack:** {entry.stock_fix}",
            "",
            _tests_line(entry),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
