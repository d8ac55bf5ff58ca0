"""The recipe pages (docs/recipes/) follow the doctor and the launchers: they cannot drift.

A page quotes the doctor's output in a ```text block preceded by ``<!-- doctor-output: model=CONFIG -->``: the test
runs the page's nearest preceding `hf-fsdp-qlora doctor` command (in process, as the console script does) with
`--model CONFIG` (a published config.json under tests/data, no weights) and checks that every quoted line is a line
the doctor prints, in order, and that the exit status matches (verdict FITS: 0, an ERROR line: 1). Every GiB figure
in a page's prose is one its doctor runs print. The launch commands are marked as everywhere in docs/
(tests/readme_blocks.py); the ``<!-- cpu-rehearsal: COMMAND -->`` forms, which no other test runs, run here on CPU
(one rank, a tiny local model, a fraction of an epoch) and must engage FSDP and write safetensors.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import subprocess

import pytest
import yaml
from dist_utils import BIN, REPO, _env, free_port
from readme_blocks import blocks, options, program, scripts, shell_commands

DOCS = REPO / "docs"
RECIPES = DOCS / "recipes"
PAGES = sorted(RECIPES.glob("*.md"))
RUNS = [p for p in PAGES if p.name != "index.md"]
_EXCERPT = re.compile(r"<!--\s*doctor-output:\s*model=(\S+)\s*-->\n```text\n(.*?)\n```", re.DOTALL)
_FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_GIB = re.compile(r"\b\d+\.\d\d GiB")


def _without_env(words: list[str]) -> list[str]:
    """A command's words without the VAR=value assignments before its program."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _doctor_words(page, before_line: int) -> list[str]:
    """The words of the last `hf-fsdp-qlora doctor` command in a shell block above `before_line`."""
    found = [
        words
        for block in blocks(page)
        if block.line < before_line and block.lang != "python"
        for words in shell_commands(block.body)
        if program(words) == "hf-fsdp-qlora doctor"
    ]
    assert found, f"{page.name}:{before_line}: no doctor command above the quoted output"
    return found[-1]


def excerpts(page) -> list[tuple[str, tuple[str, ...], str]]:
    """(where, the doctor's arguments on the local config, the quoted text) of each doctor-output block."""
    return [(where, args, quoted) for where, args, quoted, _ in _excerpts(page)]


def _excerpts(page) -> list[tuple[str, tuple[str, ...], str, tuple[str, str]]]:
    """excerpts() and, for each, (the local config, the page's --model): the page shows the doctor's output for its
    own --model, which the test runs on the model's published config.json under tests/data."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _EXCERPT.finditer(text):
        line = _line_of(text, match.start())
        words = _doctor_words(page, line)[2:]  # after "hf-fsdp-qlora doctor"
        model = words.index("--model")
        shown, words[model + 1] = words[model + 1], match.group(1)
        if "--training-config" in words:  # the recipe's settings file, relative to the repository (the pages' cwd)
            at = words.index("--training-config") + 1
            words[at] = str(REPO / words[at])
        found.append((f"{page.relative_to(REPO)}:{line}", tuple(words), match.group(2), (match.group(1), shown)))
    return found


@functools.cache
def run_doctor(args: tuple[str, ...]) -> tuple[int, str]:
    """(exit status, stdout) of `hf-fsdp-qlora doctor ARGS`: the console script's own function, in process."""
    from hf_fsdp_qlora.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(args))
    return status, out.getvalue()


def doctor_block(args: tuple[str, ...], model: tuple[str, str]) -> str:
    """What a page quotes for the doctor run `args`: its whole output, as the page's own command prints it (the
    page's --model and settings file in the header line), without trailing spaces or blank lines."""
    config, shown = model
    printed = run_doctor(("doctor", *args))[1].replace(config, shown)
    printed = printed.replace(str(REPO) + "/", "")
    return "\n".join(line.rstrip() for line in printed.splitlines()).strip("\n")


EXCERPTS = [(w, a, q, m) for page in RUNS for w, a, q, m in _excerpts(page)]


def test_every_recipe_page_has_the_parts_a_user_needs():
    assert len(RUNS) >= 6, [p.name for p in RUNS]
    for page in RUNS:
        text = page.read_text(encoding="utf-8")
        assert excerpts(page), f"{page.name}: no doctor output quoted"
        for heading in ("## 1. Ask the doctor", "## 2. Launch", "## 3. What the run writes", "## 4. Merge",
                        "## When it does not fit"):  # fmt: skip
            assert heading in text, (page.name, heading)
        commands = [_without_env(w) for b in blocks(page) for w in shell_commands(b.body)]
        launches = [w for w in commands if program(w) in ("accelerate launch", "sbatch")]
        assert launches, f"{page.name}: no launch command"
        configs = {w for words in launches for w in words if "hf-fsdp-qlora config" in w} | {
            "fsdp2_qlora_multinode" for words in launches if words[0] == "sbatch"
        }
        assert configs, f"{page.name}: the launch names no shipped config"


@pytest.mark.parametrize("where, args, quoted, model", EXCERPTS, ids=[e[0] for e in EXCERPTS])
def test_quoted_doctor_output_is_what_the_doctor_prints(where, args, quoted, model):
    """Whole: every line the doctor prints, none cut (tests/refresh_recipe_figures.py rewrites them)."""
    status, _ = run_doctor(("doctor", *args))
    printed = doctor_block(args, model)
    assert quoted.rstrip() == printed, f"{where}: the page's block is not what the doctor prints:\n{printed}"
    if "verdict: FITS" in quoted:
        assert status == 0, (where, printed)
    if re.search(r"^ERROR ", quoted, flags=re.MULTILINE):
        assert status == 1, (where, printed)


@pytest.mark.parametrize("page", RUNS, ids=lambda p: p.name)
def test_every_figure_says_it_is_planned_and_for_what(page):
    """No figure on a recipe page was measured on a GPU: each doctor block is introduced as planned by the doctor,
    for the hardware its command names; the page says so before its first figure."""
    text = page.read_text(encoding="utf-8")
    for match in _EXCERPT.finditer(text):
        before = _prose(text[: match.start()]).rstrip().rsplit("\n\n", 1)[-1]
        assert re.search(r"[Pp]lanned by the doctor \(.*(GPU|GB).*\)", before), (page.name, before[-300:])
    intro = _prose(text.split("## 1.", 1)[0])
    assert "planned by the doctor" in intro and "not measured" in intro, (page.name, intro)


def _prose(text: str) -> str:
    return _FENCED.sub("", re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL))


def test_figures_in_the_prose_are_the_doctors():
    """A GiB figure in a page's text (tables included) is one the page's doctor runs print; the index's, one of
    the page its row links to."""
    printed = {page.name: " ".join(run_doctor(("doctor", *a))[1] for _, a, _ in excerpts(page)) for page in RUNS}
    for page in RUNS:
        missing = [f for f in _GIB.findall(_prose(page.read_text())) if f not in printed[page.name]]
        assert not missing, f"{page.name}: figures the doctor does not print: {missing}"
    rows = [r for r in (RECIPES / "index.md").read_text().splitlines() if r.startswith("|") and ".md)" in r]
    assert len(rows) == len(RUNS), rows
    for row in rows:
        target = re.search(r"\]\(([\w-]+\.md)\)", row).group(1)
        missing = [f for f in _GIB.findall(row) if f not in printed[target]]
        assert _GIB.findall(row) and not missing, (row, missing)


def test_recipes_come_first():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert next(iter(nav[0].values())) == "index.md"
    section = nav[1].get("Recipes")
    assert section, nav[1]
    listed = [next(iter(item.values())) if isinstance(item, dict) else item for item in section]
    assert sorted(listed) == sorted(f"recipes/{p.name}" for p in PAGES), listed
    index = (DOCS / "index.md").read_text()
    first_link = re.search(r"\]\(([^)#]+)", index).group(1)
    assert first_link.startswith("recipes/"), first_link


COMMANDS = [b for page in PAGES for b in blocks(page) if b.kind == "command"]


@pytest.mark.parametrize("block", COMMANDS, ids=lambda b: b.where)
def test_cpu_form_runs_the_same_program_script_and_options(block):
    cpu = [w for words in shell_commands(block.arg) for w in words]
    cpu_programs = {program(words) for words in shell_commands(block.arg)}
    for words in shell_commands(block.body):
        assert program(words) in cpu_programs, (block.where, program(words), cpu_programs)
        assert scripts(words) <= scripts(cpu), (block.where, scripts(words) - scripts(cpu))
        assert options(words) <= options(cpu), (block.where, options(words) - options(cpu))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from recipe_fixtures import build_recipe_model

    work = tmp_path_factory.mktemp("recipes_docs")
    return {"WORK": str(work), "RECIPE_MODEL": str(build_recipe_model(work / "recipe"))}


@pytest.mark.distributed
@pytest.mark.parametrize("block", COMMANDS, ids=lambda b: b.where)
def test_cpu_form_succeeds(block, workspace):
    """The launch's CPU form: FSDP engaged on its rank, and the output folder holds safetensors."""
    env = _env({**workspace, "PORT": str(free_port()), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.arg], check=False, cwd=str(REPO), env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.where}\n{text[-6000:]}"
    assert re.search(r"FSDP2 engaged on \d rank\(s\)", text), text[-3000:]
    for folder in re.findall(r'--output "\$WORK/([\w-]+)"', block.arg):
        written = os.listdir(os.path.join(workspace["WORK"], folder))
        assert any(name.endswith(".safetensors") for name in written), (block.where, folder, written)
    assert shlex.split(block.arg)  # the form is one well-quoted command line
