"""The package layout: public names resolve, subsystems import one way, modules stay small."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from readme_blocks import resolve_name

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_fsdp_qlora"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the hf_fsdp_qlora modules `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
            found.update(n for n in [module, *names] if n.startswith("hf_fsdp_qlora"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hf_fsdp_qlora"))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_readme_names_resolve():
    """Every dotted ``hf_fsdp_qlora.X`` the README shows imports (modules) or resolves (attributes)."""
    names = sorted(set(re.findall(r"\bhf_fsdp_qlora(?:\.\w+)+", (REPO / "README.md").read_text())))
    assert len(names) >= 3, names  # the README shows the API, the run module and the data helpers
    for name in names:
        resolve_name(name)  # AttributeError names what the README shows but the package lacks


def test_every_public_export_resolves():
    import hf_fsdp_qlora

    for name in hf_fsdp_qlora.__all__:
        assert getattr(hf_fsdp_qlora, name) is not None, name


def test_subsystems_import_one_way():
    """loading/ and merge/ never import train/; merge/ never imports loading/; nothing reaches into another
    subpackage's private (underscore) modules."""
    problems = []
    for path in SOURCES:
        me = _module_name(path)
        sub = me.split(".")[1] if me.count(".") >= 1 and (PACKAGE / me.split(".")[1]).is_dir() else None
        for target in _imports(path):
            parts = target.split(".")
            if sub in ("loading", "merge") and parts[1:2] == ["train"]:
                problems.append(f"{me} imports {target}")
            if sub == "merge" and parts[1:2] == ["loading"]:
                problems.append(f"{me} imports {target}")
            if len(parts) >= 3 and (PACKAGE / parts[1]).is_dir() and parts[1] != sub and parts[2].startswith("_"):
                problems.append(f"{me} imports {target}, private to {parts[1]}/")
    assert not problems, "\n".join(problems)


# The front doors: the lazy public API and the `-m hf_fsdp_qlora.run` entry point may import any subsystem.
_FRONT_DOORS = {"hf_fsdp_qlora", "hf_fsdp_qlora.run"}


def test_lower_layers_never_import_upward():
    """loading/, merge/, experts/ and the top-level modules (shapes, dtypes, I/O) sit below doctor/, train/ and cli/: none of
    them imports those (the doctor and the loader both read model shapes from a module below them)."""
    problems = []
    for path in SOURCES:
        me = _module_name(path)
        parts = me.split(".")
        lower = parts[1:2] in (["loading"], ["merge"], ["experts"]) or (
            len(parts) == 2 and not (PACKAGE / parts[1]).is_dir()
        )
        if not lower or me in _FRONT_DOORS:
            continue
        for target in _imports(path):
            if target.split(".")[1:2] in (["doctor"], ["train"], ["cli"]):
                problems.append(f"{me} imports {target}")
    assert not problems, "\n".join(problems)


# Modules allowed past the default 420 lines, each with the reason (none today: _compat/ is one module per library).
LIMITS: dict[str, int] = {}


def test_modules_stay_small():
    long = {
        name: n for p in SOURCES if (n := len(p.read_text().splitlines())) > LIMITS.get(name := _module_name(p), 420)
    }
    assert not long, f"split these modules (over 420 lines): {long}"


def _code_lines(node) -> int:
    """A function's lines without its docstring (a public API's Args/Returns are documentation, not code)."""
    length = node.end_lineno - node.lineno + 1
    doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) else None
    if doc is not None and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        length -= doc.end_lineno - doc.lineno + 1
    return length


def test_loader_and_doctor_read_as_steps():
    """No function of loading/ or doctor/ runs over 60 lines of code: a new capability adds a step or a term."""
    long = {
        f"{_module_name(p)}.{node.name}": n
        for p in SOURCES
        if _module_name(p).split(".")[1:2] in (["loading"], ["doctor"])
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := _code_lines(node)) > 60
    }
    assert not long, f"split these into named steps: {long}"


def _module_edges(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports anywhere (module level or inside a function: an import moved into
    a function to dodge a cycle is still an edge). ``from .pkg import sub`` is an edge to ``pkg.sub`` alone: the
    package's ``__init__`` runs first either way, and counting it would tie every submodule to its siblings."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{module}.{a.name}" for a in node.names} & known
            found |= subs
            if len(subs) < len(node.names) and module in known:  # a name from the module (or its __init__) itself
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    return found - {me}


def _import_graph() -> dict[str, set[str]]:
    sources = {_module_name(p): p for p in SOURCES}
    return {name: _module_edges(path, set(sources)) for name, path in sources.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path (first module repeated at the end) for each strongly connected component of more than one
    module (Tarjan's algorithm, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(component) > 1:
                    components.append(set(component))
    return [_path_within(component, graph) for component in components]


def _path_within(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first inside the component)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle in a strongly connected component: {component}")


def test_cycle_finder_finds_every_cycle():
    """The oracle for the test below: each cycle of a known graph is reported with its path; a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    """No module of the package imports (at module level or inside a function) a module that imports it back."""
    graph = _import_graph()
    assert "hf_fsdp_qlora.experts.quantized" in graph["hf_fsdp_qlora.experts.lora"], "the graph lost its edges"
    cycles = _cycles(graph)
    assert not cycles, "import cycles (one path per knot of modules that reach each other):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


# experts/, bottom first: each module imports (at module level or inside a function) only experts/ modules before it.
EXPERTS_LAYERS = (
    "layouts",  # where each family keeps its fused expert weights
    "routers",  # the routers' linear layers
    "orders",  # experts stored whole in another order (interleaved, transposed)
    "dbrx",  # DBRX's 2-D expert stacks fused into a declared class
    "files",  # where a checkpoint's files hold them
    "detect",  # whether a config builds fused experts
    "lora_rows",  # one routed expert's LoRA rows
    "grouped",  # grouped compute
    "quantized",  # the 4-bit experts module and the swap
    "placement",  # onto a GPU without the 16-bit experts there whole
    "stream",  # from the shards into 4 bits one layer at a time
    "script_stream",  # the stream under unchanged scripts' from_pretrained
    "targets",  # "all-linear" on a mixture of experts
    "stock_reload",  # adapters stock peft reloads as trained
    "lora",  # LoRA on 4-bit experts (peft's target_parameters)
)


def _experts_layer_problems(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    prefix = "hf_fsdp_qlora.experts."
    rank = {f"{prefix}{name}": i for i, name in enumerate(layers)}
    problems = [f"{m} is in no layer of EXPERTS_LAYERS" for m in graph if m.startswith(prefix) and m not in rank]
    for module, position in rank.items():
        for target in sorted(graph.get(module, ())):
            if target.startswith(prefix) and rank.get(target, len(layers)) >= position:
                problems.append(f"{module} imports {target}, not below it")
    # Below loading/, merge/, train/, doctor/ and cli/: not even through a top-level module it imports.
    seen, todo = set(), [m for m in graph if m.startswith("hf_fsdp_qlora.experts")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    upward = ("loading", "merge", "train", "doctor", "cli")
    problems += [f"experts/ reaches {m}" for m in sorted(seen) if m.count(".") and m.split(".")[1] in upward]
    return problems


def test_experts_layer_checker_finds_each_breach():
    """The oracle for the test below, on made-up graphs: an import upward, a module left out of the order, and a
    path to loading/ through a top-level module are each reported; a downward chain is not."""
    e = "hf_fsdp_qlora.experts."
    clean = {f"{e}a": set(), f"{e}b": {f"{e}a", "hf_fsdp_qlora.errors"}, "hf_fsdp_qlora.errors": set()}
    assert _experts_layer_problems(clean, ("a", "b")) == []
    upward = {f"{e}a": {f"{e}b"}, f"{e}b": set()}
    assert _experts_layer_problems(upward, ("a", "b")) == [f"{e}a imports {e}b, not below it"]
    assert _experts_layer_problems(clean, ("b",)) == [
        f"{e}a is in no layer of EXPERTS_LAYERS",
        f"{e}b imports {e}a, not below it",
    ]
    through = {f"{e}a": {"hf_fsdp_qlora.towers"}, "hf_fsdp_qlora.towers": {"hf_fsdp_qlora.loading.qlora"}}
    through["hf_fsdp_qlora.loading.qlora"] = set()
    assert _experts_layer_problems(through, ("a",)) == ["experts/ reaches hf_fsdp_qlora.loading.qlora"]


def test_experts_import_only_downward():
    """experts/ is one package in layers (EXPERTS_LAYERS): each module imports only the modules below it, and
    nothing in it reaches loading/, merge/, train/, doctor/ or cli/, directly or through a top-level module. Its
    __init__ imports only the top layer (to register expert LoRA's peft hook)."""
    graph = _import_graph()
    init = {t for t in graph["hf_fsdp_qlora.experts"] if t.startswith("hf_fsdp_qlora.")}
    assert init == {"hf_fsdp_qlora.experts.lora"}, init
    without_init = {m: t for m, t in graph.items() if m != "hf_fsdp_qlora.experts"}
    problems = _experts_layer_problems(without_init, EXPERTS_LAYERS)
    assert not problems, "\n".join(problems)
