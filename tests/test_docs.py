"""The docs cannot rot: they build strictly (links and anchors), the names and commands they show exist.

Every fenced shell block in docs/ is marked (tests/readme_blocks.py): run as written here, backed by a named test
(which must exist), or GPU-only - whose programs, scripts and options are checked here without running them
(`hf-fsdp-qlora`/`merge-adapters` arguments parsed by the real parsers, accelerate's options by accelerate's own
parser, a script's options looked up in its source).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys

import pytest
import yaml
from dist_utils import BIN, REPO, _env
from readme_blocks import blocks, node_exists, options, resolve_name, shell_commands

DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))  # docs/recipes/ included
BLOCKS = [b for page in PAGES for b in blocks(page)]
SHELL = [b for b in BLOCKS if b.lang != "python"]
STATIC = [b for b in SHELL if b.kind in ("gpu-only", "tested-by", "command")]
_SUBSTITUTION = re.compile(r"\$\((hf-fsdp-qlora config (\w+)|python -c .*)\)")


def _nav_files(entry) -> list[str]:
    """The files of a nav entry: a page, or a section's pages (`- Recipes: [...]`)."""
    if isinstance(entry, str):
        return [entry]
    return [f for item in entry for f in _nav_files(next(iter(item.values())) if isinstance(item, dict) else item)]


def test_pages_listed_in_nav_exist():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    files = [f for item in nav for f in _nav_files(next(iter(item.values())))]
    assert all((DOCS / f).is_file() for f in files), files
    for name in ("index", "routes", "dtypes", "fsdp1-vs-fsdp2", "checkpoints", "evaluation", "doctor", "merge",
                 "configs", "cpu-rehearsal", "performance", "troubleshooting", "errors"):  # fmt: skip
        assert f"{name}.md" in files, name


def test_mkdocs_build_strict(tmp_path):
    """Broken links, missing anchors and pages outside the nav fail the build (mkdocs.yml: strict, validation)."""
    pytest.importorskip("material", reason="the docs extra is part of dev: pip install -e '.[dev]'")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=str(REPO), env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "errors" / "index.html").is_file()


def test_errors_page_is_rendered_from_the_index():
    from hf_fsdp_qlora.error_index import render_markdown

    assert (DOCS / "errors.md").read_text() == render_markdown(), (
        "docs/errors.md is generated: python -m hf_fsdp_qlora.error_index > docs/errors.md"
    )


def _doctor_rule_ids() -> set[str]:
    source = "".join((REPO / "hf_fsdp_qlora/doctor" / f"{m}.py").read_text() for m in ("_rules", "_launch_rules"))
    raw = set(re.findall(r'f?"([a-z0-9{}-]+)",\s*"(?:error|warning|info)"', source))
    raw |= {i for pair in re.findall(r'rule_id = f"([\w{}-]+)" if .* else f"([\w{}-]+)"', source) for i in pair}
    ids = set()
    for rule in (r for r in raw if "-" in r):
        ids |= {rule.format(version=v, kind=k) for v in (1, 2) for k in ("adapters", "norms")}
    return ids


def test_every_doctor_rule_is_documented_by_its_id():
    ids = _doctor_rule_ids()
    assert len(ids) >= 25 and "fsdp2-fp32-norms" in ids and "checkpoint-timeout" in ids, sorted(ids)
    page = (DOCS / "doctor.md").read_text()
    missing = sorted(i for i in ids if f"`{i}`" not in page)
    assert not missing, f"docs/doctor.md does not describe these rule ids: {missing}"


def test_every_shipped_config_has_its_section_with_its_values():
    page = (DOCS / "configs.md").read_text()
    for path in sorted((REPO / "accelerate_configs").glob("*.yaml")):
        match = re.search(rf"^## {path.stem}\n(.*?)(?=^## |\Z)", page, flags=re.MULTILINE | re.DOTALL)
        assert match, f"docs/configs.md has no section '## {path.stem}'"
        config = yaml.safe_load(path.read_text())
        values = {**config, **(config.get("fsdp_config") or {})}
        for key, value in re.findall(r"^\| `(\w+)` \| `([^`]*)` \|$", match.group(1), flags=re.MULTILINE):
            assert str(values[key]) == value, (path.stem, key, values[key], value)
        assert f"hf-fsdp-qlora config {path.stem}" in match.group(1)


def test_python_names_in_docsresolve_name():
    import hf_fsdp_qlora

    text = "".join(page.read_text() for page in PAGES)
    names = sorted(set(re.findall(r"\bhf_fsdp_qlora(?:\.\w+)+", text)))
    assert len(names) >= 10, names
    for name in names:
        resolve_name(name)
    for block in (b for b in BLOCKS if b.lang == "python"):
        tree = ast.parse(block.body, filename=block.where)  # SyntaxError names the block
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_fsdp_qlora"):
                for alias in node.names:
                    resolve_name(f"{node.module}.{alias.name}")
    backticked = set(re.findall(r"`(FSDPQLoRA\w+|\w+Callback|load_qlora_model|generate_under_fsdp)`", text))
    for name in backticked:
        assert name in hf_fsdp_qlora.__all__ or name in ("TrainerCallback",), name


def test_every_shell_block_is_marked():
    assert len(SHELL) >= 15, len(SHELL)
    # "command" (<!-- cpu-rehearsal: COMMAND -->, the CPU form): run by tests/test_recipes_docs.py
    unmarked = [b.where for b in SHELL if b.kind not in ("as-written", "tested-by", "make-targets", "gpu-only",
                                                         "command")]  # fmt: skip
    assert not unmarked, f"shell blocks need <!-- cpu-rehearsal: ... --> or <!-- gpu-only -->: {unmarked}"
    elsewhere = [b.where for b in SHELL if b.kind == "command" and "recipes" not in b.path.parts]
    assert not elsewhere, f"only docs/recipes/ pages' CPU forms are run (tests/test_recipes_docs.py): {elsewhere}"
    for block in SHELL:
        if block.kind == "tested-by":
            assert node_exists(block.arg), (block.where, block.arg)
        if block.kind == "make-targets":
            targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))
            assert {w[1] for w in shell_commands(block.body)} <= targets, block.where


@pytest.mark.parametrize("block", [b for b in SHELL if b.kind == "as-written"], ids=lambda b: b.where)
def test_as_written_blocks_run(block):
    env = _env({"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body], cwd=str(REPO), env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout, (block.where, proc.stderr[-3000:])


def _words(words: list[str]) -> list[str]:
    """Command substitutions replaced by what they print, so the words can be parsed."""
    from hf_fsdp_qlora.configs import config_path

    out = []
    for word in words:
        match = _SUBSTITUTION.fullmatch(word)
        if match and match.group(2):
            out.append(str(config_path(match.group(2))))  # ValueError names an unknown config
        elif match:
            out.append("script.py")
        else:
            out.append(word)
    return out


def _check_script_options(script: str, args: list[str], where: str):
    source = (REPO / script).read_text()
    for option in options(args):
        assert re.search(rf"['\"]{re.escape(option)}['\"]", source), f"{where}: {script} has no option {option}"


def _check_command(words: list[str], where: str):
    from hf_fsdp_qlora.cli.main import build_parser
    from hf_fsdp_qlora.cli.merge import MergeCommand

    words = _words(words)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before the program
        words = words[1:]
    head, args = words[0], words[1:]
    head = {"python3": "python"}.get(head.rstrip(";"), head.rstrip(";"))
    if head == "python" and args[:2] == ["-m", "hf_fsdp_qlora.cli"]:
        head, args = "hf-fsdp-qlora", args[2:]
    try:
        if head == "hf-fsdp-qlora":
            build_parser().parse_args(args)
        elif head == "merge-adapters":
            MergeCommand().standalone_parser("merge-adapters").parse_args(args)
        elif head == "accelerate":
            from accelerate.commands.launch import launch_command_parser

            parsed = launch_command_parser().parse_args(args[1:])
            assert os.path.isfile(parsed.config_file), (where, parsed.config_file)
            if parsed.module:
                assert importlib.util.find_spec(parsed.training_script), (where, parsed.training_script)
            elif (REPO / parsed.training_script).is_file():
                _check_script_options(parsed.training_script, parsed.training_script_args, where)
        elif head == "python" and args and args[0].endswith(".py"):
            _check_script_options(args[0], args[1:], where)
        elif head in ("sbatch", "bash"):
            script = next(a for a in args if not a.startswith("-"))
            assert (REPO / script).is_file(), (where, script)
        elif head == "python" and args[:1] == ["-m"] and args[1].startswith("vllm."):
            pass  # vLLM lives in its own venv (.venv-serving); `make test-serving` runs this entry point there
        elif head == "python" and args[:1] == ["-m"]:
            assert importlib.util.find_spec(args[1]), (where, args[1])
        elif head not in ("pip", "make", "git", "tee", "printf", "echo", "cd", "export", "set", "exit", "mkdir"):
            raise AssertionError(f"{where}: no check for the program {head!r}")
    except SystemExit as err:  # argparse rejected the arguments (its message is on stderr)
        raise AssertionError(f"{where}: {' '.join(words)}: the arguments do not parse") from err


@pytest.mark.parametrize("block", STATIC, ids=lambda b: b.where)
def test_gpu_only_and_tested_by_commands_parse(block):
    for words in shell_commands(block.body):
        _check_command(words, block.where)


def test_inline_script_commands_exist():
    """`python benchmarks/x.py --option` in the text: the script exists and has each option."""
    for page in PAGES:
        for script, rest in re.findall(r"`python ((?:benchmarks|examples)/\w+\.py)([^`]*)`", page.read_text()):
            assert (REPO / script).is_file(), (page.name, script)
            _check_script_options(script, rest.split(), page.name)


def test_doctor_page_names_every_training_config_key_with_its_option():
    """docs/doctor.md's table of the --training-config keys is the doctor's own: each key it reads, with the option
    whose value it sets (an option's dest is its name, dashes as underscores)."""
    from hf_fsdp_qlora.train.training_config import DOCTOR_KEYS

    text = (DOCS / "doctor.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)(?:: false)?` \| `--([\w-]+)` \|$", text, flags=re.MULTILINE)
    assert {key: option.replace("-", "_") for key, option in rows} == DOCTOR_KEYS, rows
