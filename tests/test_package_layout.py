"""The package layout: the public imports keep working, no import cycle inside specdec, and
no loop between its packages.

The cycle check reads every module's imports with ``ast`` (no import-time side effects): an
edge A -> B for each ``import specdec.B`` / ``from specdec.B import x`` / ``from specdec.B
import submodule`` in A, at module level or inside functions alike (a deferred import that
closes a cycle is still a cycle of the design). ``if TYPE_CHECKING:`` blocks are left out:
they never run.

The package check reads the same graph a level up: a node per part of specdec (a subpackage,
``specdec.engine``, or a top-level module, ``specdec.config``), an edge A -> B where a module of
A imports one of B. A loop there (engine -> serving -> engine) is a cycle of the design even when
no module cycle closes it (engine.llm -> serving.streaming -> engine.sequence).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specdec
import specdec.controllers
import specdec.drafters
import specdec.training
import specdec.verifiers

# the import namespace is one; the folders are the user's top level (pyproject's package-dir)
ROOTS = {name: Path(module.__file__).parent for name, module in {
    "specdec": specdec, "specdec.drafters": specdec.drafters,
    "specdec.verifiers": specdec.verifiers, "specdec.controllers": specdec.controllers,
    "specdec.training": specdec.training}.items()}


def _modules() -> dict[str, Path]:
    """specdec's module names -> files."""
    found = {}
    for prefix, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("specdec"):
                    out.add(resolve(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            if base.startswith("specdec"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out.add(full if full in modules else resolve(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(None)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sccs


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ that re-exports its own submodules is not a cycle of the design
    for name, deps in graph.items():
        if modules[name].name == "__init__.py":
            deps.difference_update({d for d in deps if d.startswith(name + ".")})
    return graph


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph at the level of specdec's parts (see the module docstring)."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        out.setdefault(part(name), set()).update(
            part(d) for d in deps if part(d) != part(name))
    return out


def test_no_import_cycle_inside_specdec():
    assert _cycles(_graph()) == []


def test_no_import_loop_between_specdec_packages():
    graph = _graph()
    loops = _cycles(_packages(graph))
    edges = [f"{a} -> {b}" for loop in loops for a in sorted(graph) for b in sorted(graph[a])
             if a.split(".")[:2] != b.split(".")[:2] and ".".join(a.split(".")[:2]) in loop
             and ".".join(b.split(".")[:2]) in loop]
    assert loops == [], f"package loops {loops}, through: {edges}"


def test_the_package_check_finds_a_loop_no_module_cycle_closes():
    """The old engine <-> serving loop: no module cycle, one package loop."""
    graph = {"specdec.engine.llm": {"specdec.serving.streaming"},
             "specdec.serving.streaming": {"specdec.engine.sequence"},
             "specdec.engine.sequence": set(), "specdec.config": {"specdec.engine.sequence"}}
    assert _cycles(graph) == []
    assert _cycles(_packages(graph)) == [["specdec.engine", "specdec.serving"]]


def test_the_cycle_check_finds_a_cycle():
    """The checker itself: a made-up two-module cycle and a three-module one are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_the_graph_sees_deferred_imports(tmp_path):
    """An import inside a function counts (that is how the old bench <-> llama.cpp cycle hid)."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from specdec.b import g\n")
    b.write_text("from specdec.a import f\nfrom typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    from specdec.c import h\n")
    modules = {"specdec.a": a, "specdec.b": b, "specdec.c": b}
    assert _imports("specdec.a", a, modules) == {"specdec.b"}
    assert _imports("specdec.b", b, modules) == {"specdec.a"}


@pytest.mark.parametrize("statement", [
    "from specdec import LLM, SamplingParams, RequestOutput",
    "from specdec.hookspecs import hookimpl, hookspec",
    "from specdec.plugins import get_plugin_manager",
    "from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedBatch",
    "from specdec.verifiers.base import VerifyBatch, VerifyOutput",
    "from specdec.controllers.base import DraftBudget",
    "from specdec.tree import DraftTree",
    "from specdec.engine import LLMEngine",
    "from specdec.config import EngineConfig",
    "from specdec.cli import main",
])
def test_public_imports(statement):
    exec(statement, {})


def test_specdec_keeps_only_small_shared_modules():
    top = sorted(p.stem for p in ROOTS["specdec"].glob("*.py") if p.stem != "__init__")
    assert len(top) <= 15, top


def test_the_user_folders_are_the_mapped_packages():
    """drafters/, verifiers/, controllers/, training/ sit beside specdec/ and are imported
    as specdec.drafters, ...: the same files in this checkout, the wheel and an editable
    install (tests/conftest.py stops a run that would import another checkout's)."""
    repo = ROOTS["specdec"].parent
    for name, folder in ROOTS.items():
        assert folder == repo / name.rpartition(".")[2], (name, folder)


def test_a_run_against_another_checkout_is_stopped(monkeypatch):
    """The session check names the package imported from elsewhere (a second worktree)."""
    import sys

    conftest = next(m for n, m in sys.modules.items()
                    if n.endswith("conftest") and hasattr(m, "imported_from_elsewhere"))
    assert conftest.imported_from_elsewhere() == []
    monkeypatch.setattr(conftest, "MAPPED", {"specdec.drafters": "elsewhere/drafters"})
    (wrong,) = conftest.imported_from_elsewhere()
    assert wrong.startswith(f"specdec.drafters from {ROOTS['specdec.drafters']}")
    assert "elsewhere/drafters" in wrong
