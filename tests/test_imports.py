"""Imports flow one way (docs/architecture.md, "Import rules"), read from the source with ``ast``.

Every ``import`` in pd_cluster/, master/, prefill_node/, decode_node/ and kernels/ counts: at
module level, inside functions and under ``if TYPE_CHECKING:`` (an import made for annotations
only is still a dependency a reader follows); relative imports are resolved.

- No circle between files.
- No circle between folders. Top level: the five packages. Inside pd_cluster:
  each subpackage (engine, model, handover, transfer, node, bench, ray_launcher) is one node and each
  module at pd_cluster's root (the shared vocabulary, and the entry points cli.py, llm.py,
  local_cluster.py) is a node of its own: those files are what the subpackages stand on.
- The roles (master, prefill_node, decode_node) never import each other; kernels imports
  nothing of ours.
- Inside pd_cluster only the CLI (which starts roles) and bench/ (which measures them) import a role.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pd_cluster", "master", "prefill_node", "decode_node", "kernels")
ROLES = ("master", "prefill_node", "decode_node")
PD_CLUSTER_FOLDERS = ("engine", "model", "handover", "transfer", "node", "bench", "ray_launcher")
#: Modules of pd_cluster, besides pd_cluster.bench.*, that may import a role: the ones that start one.
ROLE_STARTERS = frozenset({"pd_cluster.cli"})


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    module_level: bool
    type_checking: bool

    def __str__(self) -> str:
        where = "module level" if self.module_level else "in a function"
        if self.type_checking:
            where += ", under TYPE_CHECKING"
        return f"{self.source}:{self.line} imports {self.target} ({where})"


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted name -> file of every module of ``packages`` under ``root``."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> list[Import]:
    """The imports of one file that land in ``modules``."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def add(target: str | None, node: ast.stmt, module_level: bool, type_checking: bool) -> None:
        if target is not None and target != module:
            found.append(Import(module, target, node.lineno, module_level, type_checking))

    def visit(node: ast.AST, module_level: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node, module_level, type_checking)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else _resolve(base, modules), node, module_level, type_checking)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, module_level, True)
            for child in node.orelse:
                visit(child, module_level, type_checking)
            return
        inner = module_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_checking)

    visit(ast.parse(path.read_text(), str(path)), True, False)
    return found


def all_imports(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> list[Import]:
    modules = module_names(root, packages)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node, or a node importing itself
    (Tarjan's algorithm, iterative); each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    nodes = set(graph) | {t for targets in graph.values() for t in targets}
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                if len(component) > 1 or node in graph.get(node, ()):
                    cycles.append(sorted(component))
    return sorted(cycles)


def _graph(edges: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    return graph


def _explain(cycles: list[list[str]], imports: Iterable[Import], node_of) -> str:
    lines = []
    for cycle in cycles:
        members = set(cycle)
        lines.append(" <-> ".join(cycle))
        lines += [f"    {imp}" for imp in imports if node_of(imp.source) in members and node_of(imp.target) in members
                  and node_of(imp.source) != node_of(imp.target)]
    return "\n".join(lines)


def top_folder(module: str) -> str:
    return module.split(".")[0]


def pd_cluster_node(module: str) -> str:
    """Inside pd_cluster: a subpackage as a whole, a root module by itself."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in PD_CLUSTER_FOLDERS:
        return ".".join(parts[:2])
    return module


def starts_roles(module: str) -> bool:
    """May this pd_cluster module import a role? The CLI starts them, bench/ measures them."""
    return module in ROLE_STARTERS or module.startswith("pd_cluster.bench.")


def is_allowed_role_import(imp: Import) -> bool:
    return top_folder(imp.target) in ROLES and top_folder(imp.source) == "pd_cluster" and starts_roles(imp.source)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = all_imports()
    assert len(found) > 100, "the import walk found almost nothing: is the repository layout as expected?"
    return found


# ---- the checker checks -------------------------------------------------------------------


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []
    assert find_cycles({"a": {"a"}}) == [["a"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"x", "z"}}) == [["a", "b"], ["x", "y"]]


def test_import_walk_resolves_relative_function_level_and_type_checking_imports(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c\n")
    (pkg / "b.py").write_text("import os\n\ndef f():\n    from pkg.sub.c import name\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import name\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\nfrom .. import b\nname = 1\n")
    found = {(i.source, i.target, i.module_level, i.type_checking) for i in all_imports(tmp_path, ["pkg"])}
    assert found == {
        ("pkg.a", "pkg.b", True, False),
        ("pkg.a", "pkg.sub.c", True, False),
        ("pkg.b", "pkg.sub.c", False, False),
        ("pkg.sub", "pkg.sub.c", True, False),
        ("pkg.sub.c", "pkg.a", True, True),
        ("pkg.sub.c", "pkg.b", True, False),
    }
    # a -> b -> c in a function, c -> a for annotations only: one circle, seen only when every import counts.
    assert find_cycles(_graph((i.source, i.target) for i in all_imports(tmp_path, ["pkg"]))) == [
        ["pkg.a", "pkg.b", "pkg.sub.c"]]


# ---- the rules ----------------------------------------------------------------------------


def test_no_import_circle_between_files(imports) -> None:
    cycles = find_cycles(_graph((imp.source, imp.target) for imp in imports))
    assert not cycles, "import circles between files:\n" + _explain(cycles, imports, lambda m: m)


def test_no_import_circle_between_top_level_folders(imports) -> None:
    counted = [imp for imp in imports if not is_allowed_role_import(imp)]
    edges = {(top_folder(i.source), top_folder(i.target)) for i in counted if top_folder(i.source) != top_folder(i.target)}
    cycles = find_cycles(_graph(edges))
    assert not cycles, "import circles between folders:\n" + _explain(cycles, counted, top_folder)


def test_no_import_circle_between_folders_of_pd_cluster(imports) -> None:
    inside = [i for i in imports if top_folder(i.source) == top_folder(i.target) == "pd_cluster"]
    edges = {(pd_cluster_node(i.source), pd_cluster_node(i.target)) for i in inside
             if pd_cluster_node(i.source) != pd_cluster_node(i.target)}
    cycles = find_cycles(_graph(edges))
    assert not cycles, "import circles between pd_cluster's folders:\n" + _explain(cycles, inside, pd_cluster_node)


def test_roles_never_import_each_other(imports) -> None:
    crossing = [str(i) for i in imports
                if top_folder(i.source) in ROLES and top_folder(i.target) in ROLES
                and top_folder(i.source) != top_folder(i.target)]
    assert not crossing, "a role imports another role:\n" + "\n".join(crossing)


def test_kernels_import_nothing_of_ours(imports) -> None:
    ours = [str(i) for i in imports if top_folder(i.source) == "kernels" and top_folder(i.target) != "kernels"]
    assert not ours, "kernels import the rest of the project:\n" + "\n".join(ours)


def test_only_the_cli_and_bench_import_roles_from_pd_cluster(imports) -> None:
    starters = {name for name in module_names(REPO, ["pd_cluster"]) if name in ROLE_STARTERS}
    assert starters == ROLE_STARTERS, "a listed role starter no longer exists: update ROLE_STARTERS"
    wrong = [str(i) for i in imports
             if top_folder(i.source) == "pd_cluster" and top_folder(i.target) in ROLES and not starts_roles(i.source)]
    assert not wrong, "pd_cluster imports a role outside cli.py and bench/:\n" + "\n".join(wrong)


def test_the_master_and_the_cli_start_without_torch_or_triton() -> None:
    """The master relays text and the admin commands talk HTTP: neither loads torch or Triton
    (seconds of start-up, and hundreds of MB in every worker of a master), though both read the
    wire protocol, whose KV spec names the quantized row layout."""
    import subprocess
    import sys

    probe = ("import sys; import master.server, master.workers, pd_cluster.admin_cli; "
             "from pd_cluster.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"loaded at import: {out.stdout.strip()}"
