"""The import graph of `sgl/`, read with `ast`: acyclic, and layered as ARCHITECTURE.md says.

Every import counts, including those inside functions and under `TYPE_CHECKING`: a lazy
import hides a cycle from Python's import machinery, not from the design. Relative
imports are resolved, and `from pkg import name` is an edge to `pkg.name` when that is a
module, else to `pkg`. Edges go to the named module only (a package's `__init__` is not
made a dependency of its submodules), except where the question is what gets *executed*
(torch in the DSL), which follows parent packages too.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1)
def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between sgl modules, top-level external packages each module imports)."""
    files = {_module_name(p): p for p in (ROOT / "sgl").rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}

    def add(src: str, target: str) -> None:
        if target.split(".")[0] != "sgl":
            external[src].add(target.split(".")[0])
            return
        while target and target not in files:  # `import sgl.x.y` names module sgl.x.y, or a symbol's module
            target = target.rpartition(".")[0]
        if target and target != src:
            edges[src].add(target)

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(mod, alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    add(mod, candidate if candidate in files else base)
    return edges, external


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for start in sorted(edges):
        if state.get(start):
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(edges[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                state[node] = 2
                continue
            nxt = todo.pop(0)
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(edges[nxt])))
    return None


def reachable(edges: dict[str, set[str]], start: str, with_parents: bool = False) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += edges[m]
        if with_parents and "." in m:
            todo.append(m.rpartition(".")[0])  # importing a.b.c runs a/__init__ and a/b/__init__
    return seen


def _in(pkg: str, mod: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_graph_sees_lazy_type_checking_and_relative_imports():
    edges, external = import_graph()
    assert "sgl.lang.backends.engine" in edges["sgl.lang.backends"]  # imported inside a function
    assert "sgl.runtime.constrained.kinds" in edges["sgl.runtime.constrained.registry"]  # `from .kinds import`
    assert "torch" in external["sgl.runtime.executor.sampler"]
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": set()}
    assert find_cycle(toy) == ["a", "b", "c", "a"]
    assert cycles(toy) == [["a", "b", "c", "a"], ["d", "e", "d"]]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per tangle (strongly connected component with more than one module)."""
    out, done = [], set()
    for mod in sorted(edges):
        if mod in done:
            continue
        tangle = {m for m in reachable(edges, mod) if mod in reachable(edges, m)}
        done |= tangle
        if len(tangle) > 1:
            out.append(find_cycle({m: edges[m] & tangle for m in tangle}) or [])
    return out


def test_no_import_cycles():
    found = cycles(import_graph()[0])
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_radix_imports_nothing_else_of_sgl():
    edges, _ = import_graph()
    bad = {(m, t) for m in edges if _in("sgl.radix", m) for t in edges[m] if not _in("sgl.radix", t)}
    assert not bad, bad


def test_the_dsl_never_imports_torch():
    edges, external = import_graph()
    for mod in (m for m in edges if _in("sgl.lang", m)):
        with_torch = sorted(m for m in reachable(edges, mod, with_parents=True) if "torch" in external[m])
        assert not with_torch, f"{mod} imports torch through {with_torch}"


def test_the_runtime_never_imports_server_dsl_or_router():
    edges, _ = import_graph()
    for mod in (m for m in edges if _in("sgl.runtime", m)):
        bad = sorted(m for m in reachable(edges, mod) if any(_in(p, m) for p in ("sgl.server", "sgl.lang",
                                                                                   "sgl.router")))
        assert not bad, f"{mod} reaches {bad}"


def test_the_dsl_reads_only_the_plain_sampling_schema_of_the_runtime():
    # The in-process backend wraps an Engine object it is handed; it needs no runtime import.
    allowed = {"sgl.runtime", "sgl.runtime.sampling_params", "sgl.runtime.constrained",
               "sgl.runtime.constrained.kinds"}
    edges, _ = import_graph()
    for mod in (m for m in edges if _in("sgl.lang", m)):
        bad = sorted(m for m in reachable(edges, mod, with_parents=True) if _in("sgl.runtime", m) and m not in allowed)
        assert not bad, f"{mod} reaches {bad}"


def test_the_router_imports_only_radix_kv_events_and_the_shared_auth_guard():
    allowed = ("sgl.router", "sgl.radix", "sgl.kv_events", "sgl.http_auth")
    edges, _ = import_graph()
    assert not edges["sgl.http_auth"], "sgl/http_auth.py is shared by server and router: it imports nothing of sgl"
    for mod in (m for m in edges if _in("sgl.router", m)):
        bad = sorted(m for m in reachable(edges, mod) if not any(_in(p, m) for p in allowed))
        assert not bad, f"{mod} reaches {bad}"
