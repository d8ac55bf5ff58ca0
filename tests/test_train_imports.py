"""train/ imports one way (no cycle), old module paths are gone, and training_args.bin pickles load."""

from __future__ import annotations

import ast
import importlib
import pickle
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_fsdp_qlora"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports anywhere in its body (module level or inside a function: an
    import moved into a function to dodge a cycle is still an edge)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            candidates = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in candidates if name in known and name != me)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    """The oracle for the test below: a known cycle is reported, a chain is not."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_train_has_no_import_cycle():
    sources = {_module_name(p): p for p in (PACKAGE / "train").glob("*.py") if p.name != "__init__.py"}
    known = set(sources)
    graph = {name: _targets(path, known) for name, path in sources.items()}
    assert graph["hf_fsdp_qlora.train.trainer_hook"] >= {
        "hf_fsdp_qlora.train._trainer_mixin",
        "hf_fsdp_qlora.train.callbacks",
    }, "the graph lost the edges it is meant to watch"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in train/: " + " -> ".join(cycle)


@pytest.mark.parametrize("old", ["hf_fsdp_qlora.checkpoint", "hf_fsdp_qlora.training_args", "hf_fsdp_qlora.callbacks"])
def test_old_module_paths_are_gone(old):
    """No release shipped the pre-``train/`` paths, so nothing forwards them."""
    import hf_fsdp_qlora  # noqa: F401  (a finder installed on import would serve the old names)

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_training_args_pickle_round_trips_under_the_new_path():
    """``training_args.bin`` (what Trainer saves in each checkpoint) names ``hf_fsdp_qlora.train.training_args``
    and loads back."""
    from hf_fsdp_qlora import FSDPQLoRATrainingArguments

    args = FSDPQLoRATrainingArguments(output_dir="unused", report_to="none", learning_rate=3e-4)
    data = pickle.dumps(args)
    assert b"hf_fsdp_qlora.train.training_args" in data
    loaded = pickle.loads(data)
    assert isinstance(loaded, FSDPQLoRATrainingArguments)
    assert loaded.learning_rate == 3e-4


@pytest.mark.parametrize("name", ["FSDPQLoRACallback", "FSDPQLoRATrainer"])
def test_public_names_install_the_trainer_hook(name, tmp_path):
    """Importing the callback (a stock trainer needs the hook) or our trainer (its callbacks come through the hook)
    wraps Trainer.__init__; in a process where no earlier import has installed it: one rank forked by
    tests/fork_launch.py from the fork server, which imported transformers but never hf_fsdp_qlora (it refuses to
    serve otherwise), so no fresh interpreter pays the stack's imports."""
    from dist_utils import FORK_LAUNCH, _run

    script = tmp_path / "probe.py"
    script.write_text(  # in a function: the launch parent preloads a script's top-level imports only
        "def probe():\n"
        "    from transformers import Trainer\n"
        "    import hf_fsdp_qlora\n"
        "    before = hasattr(Trainer.__init__, '__wrapped__')\n"
        f"    from hf_fsdp_qlora import {name}\n"
        "    print(before, hasattr(Trainer.__init__, '__wrapped__'))\n"
        "probe()\n"
    )
    proc = _run([sys.executable, str(FORK_LAUNCH), "--nproc", "1", "--master-port", "1", str(script)], 120, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"]
