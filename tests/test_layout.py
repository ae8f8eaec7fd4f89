"""The tree's import graph: no cycles anywhere, and benchmarks built on the harness only.

Every import counts (also those inside functions: a lazy import is still a dependency). A
benchmark module of ``ops/bench`` may import the harness (``ops.bench.harness``), the shared
packages (``ops.sim``, ``ops.data``) and the product (``app``, ``workers``), never another
benchmark: what two benchmarks share belongs in the harness.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "workers", "ops", "tests")
BENCH_MAY_IMPORT = ("ops.bench.harness", "ops.sim", "ops.data", "app", "workers")


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges |= {target} if target in modules else {base} if base in modules else set()
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_tree() -> None:
    graph = import_graph()
    assert {"app.cli", "workers.engine.engine", "ops.bench.harness.cli", "ops.sim.traces"} <= set(graph)
    assert cycles(graph) == []


def test_benchmarks_import_only_the_harness_shared_packages_and_the_product() -> None:
    graph = import_graph()
    benchmarks = [m for m in graph if m.startswith("ops.bench.") and not m.startswith("ops.bench.harness")]
    assert len(benchmarks) >= 8, benchmarks
    wrong = {m: sorted(t for t in graph[m] if not t.startswith(BENCH_MAY_IMPORT))
             for m in benchmarks}
    assert {m: t for m, t in wrong.items() if t} == {}
    harness = [m for m in graph if m.startswith("ops.bench.harness")]
    assert {m: sorted(graph[m] & set(benchmarks)) for m in harness if graph[m] & set(benchmarks)} == {}


def test_ops_is_packages_and_the_documented_scripts() -> None:
    """``ops/`` holds packages and the entry scripts the README, CI and compose call; nothing else."""
    top = sorted(p.name for p in (ROOT / "ops").iterdir() if p.name != "__pycache__")
    assert top == ["__init__.py", "bench", "bootstrap.sh", "compose_check.sh", "data", "demo.sh", "deploy",
                   "gpu_checks.sh", "sim", "test.sh", "train"]
