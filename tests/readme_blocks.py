"""The command blocks of README.md and docs/*.md, and the marker before each that says how a test checks it.

A fenced ``bash`` or ``python`` block is preceded by an HTML comment (invisible on the rendered page)::

    <!-- cpu-rehearsal: COMMAND -->       README: run COMMAND, the block's CPU form (same program, script and options,
                                          on the CPU rehearsal config and a tiny local model)
    <!-- cpu-rehearsal: as-written -->    run the block as it is
    <!-- cpu-rehearsal: tested-by NODE -->  the block's CPU form is the pytest node NODE (file::test)
    <!-- cpu-rehearsal: run-by SCRIPT -->  README: each command of the block is a command of SCRIPT (same program,
                                          scripts and options; CPU config, tiny model), which a test runs as written
                                          (examples/cpu_demo.sh: tests/test_demo.py), so no test runs it twice
    <!-- cpu-rehearsal: make-targets -->  every `make T` in the block names a target of the Makefile
    <!-- cpu-rehearsal: excerpt-of PATH --> (python) every line is a line of PATH, in order; PATH is run elsewhere
    <!-- cpu-rehearsal: pasteable COMMAND --> (python) a whole script as a user pastes it: saved as $SNIPPET, its
                                          MODEL = "..." and DATA = "..." lines pointed at a tiny local model and
                                          data, and run by COMMAND (README: tests/test_readme.py)
    <!-- gpu-only -->                     docs: needs a GPU or a real model; its programs, scripts and options are
                                          checked to exist (argument parsing, not a run)
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND_LANGS = ("bash", "sh", "shell", "console", "python")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"<!--\s*(cpu-rehearsal:|gpu-only)\s*(.*?)\s*-->", re.DOTALL)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    kind: str | None  # "command", "as-written", "tested-by", "run-by", "make-targets", "excerpt-of", "pasteable",
    # "gpu-only", None
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _marker(before: str) -> tuple[str | None, str]:
    before = before.rstrip()
    if not before.endswith("-->"):
        return None, ""
    match = _MARKER.fullmatch(before[before.rfind("<!--") :])
    if match is None:
        return None, ""
    if match.group(1) == "gpu-only":
        return "gpu-only", match.group(2)
    text = match.group(2)
    for kind in ("as-written", "make-targets"):
        if text == kind:
            return kind, ""
    for kind in ("tested-by", "run-by", "excerpt-of", "pasteable"):
        if text.startswith(kind + " "):
            return kind, text[len(kind) + 1 :].strip()
    return "command", text


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path` in a command language, with the marker that precedes it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        lang = match.group(2)
        if lang in COMMAND_LANGS:
            kind, arg = _marker("\n".join(lines[:i]))
            body = "\n".join(line[len(match.group(1)) :] for line in lines[i + 1 : end])
            found.append(Block(path, i + 1, lang, body, kind, arg))
        i = end + 1
    return found


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block, as words (continuations joined, comments and `&&`/`|` split)."""
    joined = re.sub(r"\\\n", " ", text)
    commands = []
    pending = ""
    for line in joined.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote open across lines (`python -c "` and a script): read on to its end
            continue
        pending = ""
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", "|", ";"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def program(words: list[str]) -> str:
    """The program and subcommand: `accelerate launch`, `hf-fsdp-qlora doctor`, `merge-adapters`."""
    head = [words[0]]
    if len(words) > 1 and not words[1].startswith("-") and words[0] in ("accelerate", "hf-fsdp-qlora", "pip", "make"):
        head.append(words[1])
    return " ".join(head)


def options(words: list[str]) -> set[str]:
    return {w.split("=")[0] for w in words if w.startswith("--")}


def scripts(words: list[str]) -> set[str]:
    """Repository files and `-m` modules a command runs (`examples/train_qlora.py`, `hf_fsdp_qlora.run`)."""
    found = {w for w in words if w.endswith(".py") and (REPO / w).is_file()}
    found |= {words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"}
    return found


def node_exists(node: str) -> bool:
    """Whether the pytest node `file::test` names a test function defined in that file (static: no collection)."""
    file, _, name = node.partition("::")
    path = REPO / file
    if not path.is_file() or not name:
        return False
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def resolve_name(name: str):
    """The object a dotted ``hf_fsdp_qlora.X.Y`` shown in README or docs names: the longest importable module
    prefix, then attributes (AttributeError names what the text shows but the package lacks)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    for attr in parts[cut:]:
        obj = getattr(obj, attr)
    return obj
