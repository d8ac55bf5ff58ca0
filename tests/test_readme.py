"""Every command block of README.md runs on CPU in its rehearsal form, so none can drift.

Each block is preceded by an HTML comment giving its CPU form (see tests/readme_blocks.py): the same program,
script and options on the shipped CPU rehearsal config, a tiny model built locally once for the module, and a
step or two. The forms run in README order in one workspace. Route 1's launch and the merge are commands of the
demo (`run-by examples/cpu_demo.sh`), which tests/test_demo.py runs as written: checked here to be the same
program, script and options, run once in the suite, not twice. `make demo` and `make test` are not run here;
their targets must exist.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest
from dist_utils import BIN, REPO, _env, free_port
from readme_blocks import blocks, node_exists, options, program, scripts, shell_commands

README = REPO / "README.md"
BLOCKS = blocks(README)
RUN_KINDS = ("command", "as-written", "pasteable")


def _id(block):
    return f"line{block.line}"


def test_every_command_block_says_how_it_is_tested():
    assert len(BLOCKS) >= 8, [b.where for b in BLOCKS]
    missing = [b.where for b in BLOCKS if b.kind not in ("command", "as-written", "tested-by", "run-by",
                                                          "make-targets", "excerpt-of", "pasteable")]  # fmt: skip
    assert not missing, f"README blocks without a <!-- cpu-rehearsal: ... --> comment before them: {missing}"


def test_clone_command_shows_a_placeholder_not_an_invented_address():
    """The project has no published address yet: the clone command shows `<URL-of-this-repository>`, which the
    reader replaces, never a made-up one (`https://github.com/OWNER/...`). Once it has one, name it in pyproject's
    [project.urls] and here."""
    pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
    clones = [(b.where, words) for page in pages for b in blocks(page) for words in shell_commands(b.body)
              if words[:2] == ["git", "clone"]]  # fmt: skip
    assert {where.split(":")[0] for where, _ in clones} >= {"README.md", "docs/index.md"}, clones
    for where, words in clones:
        assert re.fullmatch(r"<[A-Za-z-]+>", words[2]), f"{where}: git clone {words[2]}: no such address"


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 160  # a five-minute read: detail lives in docs/


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "command"], ids=_id)
def test_cpu_form_runs_the_same_program_script_and_options(block):
    """The CPU form names the README command's program, script and every option it uses."""
    cpu = [w for words in shell_commands(block.arg) for w in words]
    cpu_programs = {program(words) for words in shell_commands(block.arg)}
    for words in shell_commands(block.body):
        assert program(words) in cpu_programs, (block.where, program(words), cpu_programs)
        assert scripts(words) <= scripts(cpu), (block.where, scripts(words) - scripts(cpu))
        assert options(words) <= options(cpu), (block.where, options(words) - options(cpu))


# The scripts a `run-by` block may name, and the test that runs each as written.
RUN_BY = {"examples/cpu_demo.sh": "tests/test_demo.py::test_cpu_demo"}


def _script_commands(path: str) -> list[list[str]]:
    return shell_commands((REPO / path).read_text())


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run-by"], ids=_id)
def test_run_by_block_is_a_command_of_a_script_a_test_runs(block):
    """Each command of the block is one of the script's commands: its program, its scripts and every option it
    uses; and the script is run as written by the test RUN_BY names."""
    node = RUN_BY.get(block.arg)
    assert node and node_exists(node), f"{block.where}: no test runs {block.arg} as written: {RUN_BY}"
    assert block.arg in (REPO / node.partition("::")[0]).read_text(), (block.where, node)
    ran = _script_commands(block.arg)
    for words in shell_commands(block.body):
        same = [w for w in ran if program(w) == program(words) and scripts(words) <= scripts(w)]
        assert any(options(words) <= options(w) for w in same), (block.where, words, same)


def test_tested_by_nodes_exist():
    for block in BLOCKS:
        if block.kind == "tested-by":
            assert node_exists(block.arg), (block.where, block.arg)


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))
    named = [words[1] for b in BLOCKS if b.kind == "make-targets" for words in shell_commands(b.body)]
    assert named and set(named) <= targets, (named, targets)


def test_python_excerpts_are_in_scripts_the_readme_runs():
    ran = {s for b in BLOCKS if b.kind == "command" for words in shell_commands(b.arg) for s in scripts(words)}
    ran |= {s for b in BLOCKS if b.kind == "run-by" for words in _script_commands(b.arg) for s in scripts(words)}
    for block in BLOCKS:
        if block.kind != "excerpt-of":
            continue
        assert block.arg in ran, f"{block.where}: {block.arg} is not run by any README command's CPU form"
        source = (REPO / block.arg).read_text().splitlines()
        position = 0
        for line in (line for line in block.body.splitlines() if line.strip()):
            assert line in source[position:], f"{block.where}: not a line of {block.arg} (in order): {line!r}"
            position = source.index(line, position) + 1


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from recipe_fixtures import build_chat_dataset, build_recipe_model

    work = tmp_path_factory.mktemp("readme")
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "examples" / "build_tiny_model.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    builder.main(["--data", str(REPO / "examples/data/capitals.jsonl"), "--output", str(work / "tiny")])
    return {
        "WORK": str(work),
        "TINY": str(work / "tiny"),
        "RECIPE_MODEL": str(build_recipe_model(work / "recipe")),
        "CHAT_DATA": str(build_chat_dataset(work / "chat")),
    }


def _pasted(block, workspace) -> str:
    """The script a user pastes, saved in the workspace: its MODEL and DATA lines point at the tiny model and the
    demo's data, its output folder lies in the workspace; nothing else changes."""
    text = re.sub(r'^MODEL = "[^"]*"', f'MODEL = "{workspace["TINY"]}"', block.body, count=1, flags=re.MULTILINE)
    text = re.sub(r'^DATA = "[^"]*"', f'DATA = "{REPO / "examples/data/capitals.jsonl"}"', text, count=1,
                  flags=re.MULTILINE)  # fmt: skip
    assert text.count(workspace["TINY"]) == 1 and "capitals.jsonl" in text, f"{block.where}: no MODEL/DATA lines"
    text = text.replace('output_dir="llama-qlora"', f'output_dir="{workspace["WORK"]}/pasted-{block.line}"')
    path = os.path.join(workspace["WORK"], f"pasted_line{block.line}.py")
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)
    return path


@pytest.fixture(scope="module")
def rehearsals(workspace):
    """Run every CPU form in README order; {line: completed process}."""
    done = {}
    for block in BLOCKS:
        if block.kind not in RUN_KINDS:
            continue
        script = block.body if block.kind == "as-written" else block.arg
        env = _env({**workspace, "PORT": str(free_port()), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
        if block.kind == "pasteable":
            env["SNIPPET"] = _pasted(block, workspace)
        done[block.line] = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], check=False, cwd=str(REPO), env=env, capture_output=True, text=True,
            timeout=420,
        )  # fmt: skip
    return done


@pytest.mark.distributed
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind in RUN_KINDS], ids=_id)
def test_cpu_form_succeeds(block, rehearsals, workspace):
    proc = rehearsals[block.line]
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-3000:]}\n----- stderr -----\n{proc.stderr[-6000:]}"
    text = proc.stdout + proc.stderr
    if "accelerate launch" in block.arg:  # a green launch proves nothing: FSDP must have engaged on both ranks
        assert re.search(r"FSDP2 engaged on 2 rank\(s\)", text), text[-3000:]
    folders = re.findall(r'--output(?:_dir)? "\$WORK/([\w-]+)"', block.arg)
    for folder in folders + ([f"pasted-{block.line}"] if block.kind == "pasteable" else []):
        written = os.listdir(os.path.join(workspace["WORK"], folder))
        assert any(name.endswith(".safetensors") for name in written), (block.where, folder, written)
    if "explain" in block.arg:
        assert "cannot-flatten-integer" in proc.stdout


def test_relative_links_resolve():
    """README links into docs/ and examples/ (mkdocs checks the links inside docs/, not the README's)."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing
