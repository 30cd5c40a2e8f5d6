"""The package layout: no import cycles, and every import runs with the data flow.

spec → adapter → task → runner → store → compare → decide → report, with the command line on top. The
graph counts every import statement in a module, function-level ones included (a lazy import is still a
dependency). Modules are named as installed: ``kernels/`` is ``evalgate.kernels`` and ``model_adapters/``
is ``evalgate.model_adapters``. Inside ``model_adapters/`` the sub-packages are layered in turn
(``ADAPTER_LAYERS``): numerics, loading and the fast path under the in-process adapter, the server path on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"evalgate": REPO / "evalgate", "evalgate.kernels": REPO / "kernels",
         "evalgate.model_adapters": REPO / "model_adapters"}

# Stage of each part, lowest first: a module may import its own stage or lower ones, never higher.
STAGES = [
    (0, ("evalgate.errors", "evalgate.files", "evalgate.cores", "evalgate.allocator", "evalgate.collector", "evalgate.types", "evalgate.formatting", "evalgate.version", "evalgate.records",
         "evalgate.quiet", "evalgate.lifetime", "evalgate.located")),
    (1, ("evalgate.stats", "evalgate.tasks", "evalgate.kernels")),
    (2, ("evalgate.model_adapters",)),
    (3, ("evalgate.canary",)),
    (4, ("evalgate.run",)),
    (5, ("evalgate.gate",)),
    (6, ("evalgate.report",)),
    (7, ("evalgate.plan", "evalgate.pipeline", "evalgate.api", "evalgate.explain")),
    (8, ("evalgate.cli", "evalgate.__main__")),
]
PACKAGE_ROOT = 9  # ``evalgate/__init__.py`` re-exports the notebook surface


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if _is_package(path) else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _stage(module: str) -> int:
    if module == "evalgate":
        return PACKAGE_ROOT
    for rank, prefixes in STAGES:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no stage; add its folder to STAGES")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_imports():
    graph = _graph()
    # evalgate.cli.main imports its commands inside functions or at module level; either way they count
    assert "evalgate.cli.gate" in graph["evalgate.cli.main"]
    assert len(graph) > 40


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_imports_run_with_the_flow():
    against = sorted(f"{a} -> {b}" for a, targets in _graph().items() for b in targets
                     if b != "evalgate" and _stage(a) < _stage(b))
    assert against == []


def test_no_module_imports_the_package_root_for_its_names():
    # ``from evalgate import X`` runs evalgate/__init__.py, which imports the notebook surface (api, gate...)
    offenders = sorted(a for a, targets in _graph().items() if "evalgate" in targets and a != "evalgate"
                       and _stage(a) < 7)
    assert offenders == []


def test_kernels_stand_alone():
    # the emulated kernels know nothing of tasks, runs or adapters (only the shared errors)
    outside = sorted(f"{a} -> {b}" for a, targets in _graph().items() if a.startswith("evalgate.kernels")
                     for b in targets if not b.startswith("evalgate.kernels") and b != "evalgate.errors")
    assert outside == []


# ``model_adapters/`` by concern, lowest first: a sub-package may import its own layer or lower ones. The two
# modules at its top (stop strings, sample seeds) are what both adapters share; they import no sub-package.
ADAPTERS = "evalgate.model_adapters"
ADAPTER_LAYERS = ["canonical", "loading", "fast", "hf", "server"]
ADAPTER_SHARED = ("stops", "sample_seeds")


def _adapter_layer(module: str) -> int:
    rest = module[len(ADAPTERS) + 1:].split(".")
    if module == ADAPTERS or (len(rest) == 1 and rest[0] in ADAPTER_SHARED):
        return -1
    if rest[0] in ADAPTER_LAYERS:
        return ADAPTER_LAYERS.index(rest[0])
    raise AssertionError(f"{module} belongs to no sub-package of model_adapters; add it to ADAPTER_LAYERS")


def _against_adapter_layers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith(ADAPTERS)
                  for b in targets if b.startswith(ADAPTERS) and _adapter_layer(a) < _adapter_layer(b))


def _adapter_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between model_adapters' sub-packages (and its shared modules), modules collapsed."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:3])

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        if a.startswith(ADAPTERS + "."):
            out.setdefault(package(a), set()).update(
                package(b) for b in targets if b.startswith(ADAPTERS + ".") and package(b) != package(a))
    return out


def test_model_adapters_is_split_by_concern():
    modules = [m for m in _modules() if m.startswith(ADAPTERS)]
    assert {m.split(".")[2] for m in modules if m != ADAPTERS} == set(ADAPTER_LAYERS) | set(ADAPTER_SHARED)
    for module in modules:
        _adapter_layer(module)  # raises for a module outside every layer


def test_adapter_subpackages_import_downward():
    assert _against_adapter_layers(_graph()) == []


def test_no_import_cycles_between_adapter_subpackages():
    packages = _adapter_packages(_graph())
    # the layers do use each other (lazy imports included): the in-process adapter its numerics and loader,
    # the server the in-process adapter it serves
    assert f"{ADAPTERS}.canonical" in packages[f"{ADAPTERS}.hf"]
    assert f"{ADAPTERS}.loading" in packages[f"{ADAPTERS}.hf"]
    assert f"{ADAPTERS}.hf" in packages[f"{ADAPTERS}.server"]
    assert _cycles(packages) == []


def test_the_adapter_checks_see_an_import_against_the_layers():
    graph = {f"{ADAPTERS}.canonical.invariant": {f"{ADAPTERS}.server.errors", f"{ADAPTERS}.canonical.blocks"},
             f"{ADAPTERS}.server.errors": {f"{ADAPTERS}.canonical.invariant"}, f"{ADAPTERS}.canonical.blocks": set()}
    assert _against_adapter_layers(graph) == [f"{ADAPTERS}.canonical.invariant -> {ADAPTERS}.server.errors"]
    assert _cycles(_adapter_packages(graph)) == [[f"{ADAPTERS}.canonical", f"{ADAPTERS}.server"]]
    with pytest.raises(AssertionError, match="no sub-package"):
        _adapter_layer(f"{ADAPTERS}.flat_module")


def test_the_runner_is_handed_its_adapter():
    # spec → adapter → runner: the pipeline builds the adapter (pipeline.in_process_adapter) and the runner
    # takes it; run/ names no adapter, only what both adapters share (the sample seeds a manifest records)
    graph = _graph()
    assert "evalgate.model_adapters.hf.adapter" in graph["evalgate.pipeline"]
    building = sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith("evalgate.run")
                      for b in targets if b.startswith(ADAPTERS) and _adapter_layer(b) >= 0)
    assert building == []


def test_stats_holds_only_numbers():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("evalgate.stats"):
            assert all(t.startswith("evalgate.stats") for t in targets), (module, targets)
    words = [p for p in (REPO / "evalgate" / "stats").rglob("*.py")
             if "reasons" in p.read_text(encoding="utf-8") or "verdict" in p.read_text(encoding="utf-8").lower()]
    assert words == []


@pytest.mark.parametrize("needle", ["../shared", "shared/data", "/work/"])
def test_nothing_points_outside_the_project(needle):
    hits = []
    for path in [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("evalgate/**/*.py"),
                 *REPO.glob("kernels/**/*.py"), *REPO.glob("model_adapters/**/*.py"), *REPO.glob("tests/**/*.py"),
                 *REPO.glob("benchmarks/*.py"), *REPO.glob("examples/*.ipynb")]:
        if path == Path(__file__):
            continue
        if needle in path.read_text(encoding="utf-8"):
            hits.append(str(path.relative_to(REPO)))
    assert hits == []
