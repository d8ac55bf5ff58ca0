"""The doctor's figures on the docs pages outside docs/recipes/: where each comes from, and how to refresh them.

A ```text block preceded by ``<!-- doctor-output -->`` (or ``<!-- doctor-output: model=CONFIG -->``) quotes what
the page's nearest preceding `hf-fsdp-qlora doctor` command prints, with `--model` replaced by CONFIG when given
(a published config.json under tests/data). The quote is the whole output (compared paragraph by paragraph: runs of
lines between blank lines, trailing spaces dropped). The visible line before the marker says "Planned by the
doctor". A GiB figure in a page's prose (tables included) is one that a doctor command shown on the page prints;
a command's `--model` that is not a file here is read from MODELS (the published config of that model).
Figures that were measured, not planned, sit in paragraphs that say "measured" and name the machine, the
versions and the date (tests/test_docs_figures.py).

Refresh after a deliberate change of the memory plan (a new quote: a block holding the line FILL), then review the
diff; a figure the page's prose takes from a command it does not quote is named by the test, to edit by hand:
`PYTHONPATH=$PWD/tests .venv/bin/python tests/doc_figures.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from unittest import mock

from readme_blocks import REPO, blocks, program, shell_commands

DOCS = REPO / "docs"
# Pages other sessions own (recipes: tests/test_recipes_docs.py); every other page is held to the rules here.
OWNED_ELSEWHERE = {"families.md", "moe.md"}
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in OWNED_ELSEWHERE and not p.name.startswith("serving"))
DATA = "tests/data"
# The published config.json (tests/data) of each model a page names by Hub id (or by a folder of that name). The
# doctor reads the id as a user's would, from a Hugging Face cache holding that file, offline (see hub_cache()).
MODELS = {
    "meta-llama/Llama-3.1-8B": "llama3_1_8b_config.json",
    "meta-llama/Llama-3.1-70B": "llama3_1_70b_config.json",
    "meta-llama/Meta-Llama-3-70B": "llama3_70b_config.json",
    "meta-llama/Llama-2-70b-hf": "llama2_70b_config.json",
    "meta-llama/Llama-Guard-3-1B": "llamaguard3_1b_config.json",
    "Qwen/Qwen2-7B": "qwen2_7b_config.json",
    "google/gemma-2-9b": "gemma2_9b_config.json",
    "Qwen/Qwen3-30B-A3B": "qwen3_30b_a3b_config.json",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral_8x7b_config.json",
    "Qwen/Qwen3-235B-A22B": "qwen3_235b_a22b_config.json",
}
_REVISION = "0" * 40
QUOTE = re.compile(r"<!--\s*doctor-output(?::\s*model=(\S+))?\s*-->\n```text\n(.*?)\n```", re.DOTALL)
GIB = re.compile(r"(?<![\d.])\d+\.\d+\s+GiB")
_FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def model_config(model: str) -> str:
    """What a doctor command's `--model` reads here: a path that exists, a Hub id of MODELS (from hub_cache()), or
    for a local folder named like one of them, that model's config.json."""
    if (REPO / model).exists() or model in MODELS:
        return model
    name = model.rstrip("/").rsplit("/", 1)[-1]
    ids = [repo for repo in MODELS if repo.rsplit("/", 1)[-1] == name]
    assert ids, f"--model {model}: add its Hub id and published config.json to tests/doc_figures.py MODELS"
    return f"{DATA}/{MODELS[ids[0]]}"


def doctor_args(words: list[str], model: str | None = None) -> tuple[str, ...]:
    """The arguments after `hf-fsdp-qlora doctor`, `--model` one that reads here."""
    args = list(words[2:])
    at = args.index("--model") + 1
    args[at] = model or model_config(args[at])
    return tuple(args)


@functools.cache
def hub_cache() -> str:
    """A Hugging Face cache laid out as huggingface_hub writes it, holding each MODELS entry's config.json alone."""
    root = Path(tempfile.mkdtemp(prefix="doc_figures_hub_"))
    atexit.register(shutil.rmtree, root, True)
    for repo, config in MODELS.items():
        folder = root / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(_REVISION)
        (folder / "snapshots" / _REVISION).mkdir(parents=True)
        shutil.copy(REPO / DATA / config, folder / "snapshots" / _REVISION / "config.json")
    return str(root)


def page_commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line of its block, words) of every `hf-fsdp-qlora doctor` command in a shell block of the page."""
    return [
        (block.line, words)
        for block in blocks(page)
        if block.lang != "python"
        for words in shell_commands(block.body)
        if program(words) == "hf-fsdp-qlora doctor"
    ]


def quotes(page: Path) -> list[tuple[str, tuple[str, ...], str, str]]:
    """(where, the doctor's arguments, the quoted text, the text before the marker) of each quoted output."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in QUOTE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        above = [words for at, words in page_commands(page) if at < line]
        assert above, f"{page.name}:{line}: no doctor command above the quoted output"
        found.append((f"{page.name}:{line}", doctor_args(above[-1], match.group(1)), match.group(2),
                      text[: match.start()]))  # fmt: skip
    return found


@functools.cache
def run_doctor(args: tuple[str, ...]) -> tuple[int, str]:
    """(exit status, stdout) of `hf-fsdp-qlora doctor ARGS`, run in process as the console script runs it."""
    from huggingface_hub import constants

    from hf_fsdp_qlora.cli.main import main

    out, here = io.StringIO(), os.getcwd()
    os.chdir(REPO)  # the pages' paths (tests/data/...) are the repository's, printed as given
    try:  # offline, from hub_cache(): huggingface_hub reads both settings at each call
        with contextlib.redirect_stdout(out), mock.patch.object(constants, "HF_HUB_CACHE", hub_cache()), \
                mock.patch.object(constants, "HF_HUB_OFFLINE", True):  # fmt: skip
            status = main(["doctor", *args])
    finally:
        os.chdir(here)
    return status, out.getvalue()


def paragraphs(text: str) -> list[str]:
    """Runs of non-blank lines, each line's trailing spaces dropped."""
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return [p for p in "\n".join(lines).split("\n\n") if p.strip()]


def prose(text: str) -> str:
    """The page without fenced blocks and HTML comments."""
    return _FENCED.sub("", re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL))


def planned_figures(page: Path) -> str:
    """Everything the doctor commands shown on the page print."""
    return "\n".join(run_doctor(doctor_args(words))[1] for _, words in page_commands(page))


def _refresh_quote(args, quoted: str, changed: dict[str, str]) -> str:
    """The doctor's whole output, noting in `changed` each figure that moved in a paragraph of the same shape (the
    same text, numbers blanked) as one the page quoted (a new quote: a block holding the line FILL)."""
    printed = paragraphs(run_doctor(args)[1])
    shape = functools.partial(_NUMBER.sub, "#")
    by_shape = {shape(p): p for p in printed}
    for old in paragraphs(quoted):
        new = by_shape.get(shape(old), old)
        for old_n, new_n in zip(_NUMBER.findall(old), _NUMBER.findall(new), strict=True):
            if old_n != new_n and "." in old_n:
                changed[old_n] = new_n
    return "\n\n".join(printed)


def refresh(page: Path) -> dict[str, str]:
    """Rewrite the page's quotes from a fresh run and every changed figure in its prose, in one pass."""
    text = page.read_text(encoding="utf-8")
    changed: dict[str, str] = {}
    bodies = iter([_refresh_quote(args, quoted, changed) for _, args, quoted, _ in quotes(page)])
    if changed:  # one pass, so a new figure equal to another's old one is not replaced again
        pattern = "|".join(re.escape(old) for old in sorted(changed, key=len, reverse=True))
        text = re.sub(rf"(?<![\d.])(?:{pattern})(?= GiB)", lambda m: changed[m.group(0)], text)
    text = QUOTE.sub(lambda m: m.group(0).replace(m.group(2), next(bodies)), text)
    page.write_text(text, encoding="utf-8")
    return changed


if __name__ == "__main__":
    for page in PAGES:
        if page_commands(page):
            print(page.name, refresh(page))
