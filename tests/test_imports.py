"""The product's imports point one way (DESIGN.md §3), read from the source: no import
cycle anywhere, nothing a stage runs reaches the gateway's room (mesh/front/), cache/ and
topology/ import nothing of ours beyond each other, stages/ does not import mesh/.

Every import counts: at the top of a module, inside a function, under TYPE_CHECKING, and
`importlib.import_module` of a literal name. `from a.b import c` is an import of a.b.c
where c is a module, else of a.b. (Nothing in the product importing evals/ is
tests/test_layout.py's.)"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("topology", "stages", "cache", "mesh", "proto", "evals")

Graph = dict[str, dict[str, int]]  # module -> {module it imports: line of the first import}


def module_files(root: Path = ROOT, folders=PRODUCT) -> dict[str, Path]:
    """Every module of the product by its import name (`skippy.mesh.stage.server`); a
    package by its own name, for its `__init__.py`."""
    found = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = ["skippy", folder, *path.relative_to(root / folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(source: str, package: list[str]) -> list[tuple[str, int]]:
    """(dotted name, line) of each import in `source`, read as a module of `package` (its
    parts), relative imports resolved; `from x import y` gives x.y (y may be a module, or
    a name in x)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [(f"{module}.{a.name}", node.lineno) for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names += [(node.args[0].value, node.lineno)]
    return names


def import_graph(files: dict[str, Path]) -> Graph:
    """Which product modules each product module imports (names outside it are dropped;
    a name is taken as its longest prefix that is a module)."""
    graph: Graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for dotted, line in imported_names(path.read_text(), package):
            target = dotted
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle ([a, b, ..., a]) in each strongly connected part of `graph` that has one:
    an empty list means there is no cycle at all."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:  # Tarjan's, iterative: the graph is deep enough to matter
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
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
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.add(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(_cycle_in(graph, part))
    return found


def _cycle_in(graph: Graph, part: set[str]) -> list[str]:
    """A shortest cycle through the first (by name) module of a strongly connected part."""
    start = min(part)
    came_from = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if child in part and child not in came_from:
                came_from[child] = node
                todo.append(child)
    raise AssertionError(f"no cycle through {start}")  # a strongly connected part has one


def reached(graph: Graph, starts: list[str]) -> dict[str, str | None]:
    """Every module imported from `starts`, directly or not: module -> who imports it."""
    by = {s: None for s in starts}
    todo = deque(starts)
    while todo:
        node = todo.popleft()
        for child in sorted(graph[node]):
            if child not in by:
                by[child] = node
                todo.append(child)
    return by


def _path(by: dict[str, str | None], module: str) -> list[str]:
    chain = [module]
    while by[chain[-1]] is not None:
        chain.append(by[chain[-1]])
    return chain[::-1]


def _spelled(graph: Graph, files: dict[str, Path], chain: list[str]) -> str:
    """`a -> b -> c` with the file and line of each import."""
    steps = [f"{a} ({files[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(chain, chain[1:])]
    return " -> ".join([*steps, chain[-1]])


def _in(module: str, *folders: str) -> bool:
    return any(module == f"skippy.{f}" or module.startswith(f"skippy.{f}.") for f in folders)


@pytest.fixture(scope="module")
def product() -> tuple[Graph, dict[str, Path]]:
    files = module_files()
    return import_graph(files), files


# -- the product --------------------------------------------------------------------------------
def test_no_import_cycle_anywhere_in_the_product(product):
    graph, files = product
    found = cycles(graph)
    assert not found, "import cycles (each import with its file and line):\n" + \
        "\n".join(_spelled(graph, files, c) for c in found)


def test_nothing_a_stage_runs_imports_the_gateway(product):
    """The stage server and the runtimes (and all they import) never reach mesh/front/:
    what the gateway and a stage share lives below both."""
    graph, files = product
    starts = sorted(m for m in graph if _in(m, "mesh.stage", "stages"))
    by = reached(graph, starts)
    wrong = sorted(m for m in by if _in(m, "mesh.front"))
    assert not wrong, "a stage reaches the gateway's room:\n" + \
        "\n".join(_spelled(graph, files, _path(by, m)) for m in wrong)


@pytest.mark.parametrize("folder, allowed", [
    ("cache", ("cache", "topology")), ("topology", ("topology", "cache")),
    ("stages", ("stages", "cache", "topology", "proto")), ("proto", ("proto",))])
def test_imports_point_one_way(product, folder, allowed):
    """DESIGN §3: cache/ and topology/ import nothing of ours beyond each other; stages/
    uses them (and the wire's schemas), never mesh/; proto/ holds schemas only."""
    graph, files = product
    wrong = sorted(f"{files[m].relative_to(ROOT)}:{line} imports {t}"
                   for m in graph if _in(m, folder)
                   for t, line in graph[m].items() if not _in(t, *allowed))
    assert not wrong, "\n".join(wrong)


# -- the reader itself: it sees what it must, so the checks above can fail --------------------
def test_the_reader_sees_imports_in_functions_relative_ones_and_literal_import_module(tmp_path):
    (tmp_path / "mesh" / "stage").mkdir(parents=True)
    (tmp_path / "mesh" / "front").mkdir()
    for name in ("__init__", "stage/__init__", "front/__init__", "front/tokenizer", "cli"):
        (tmp_path / "mesh" / f"{name}.py").write_text("")
    (tmp_path / "mesh" / "stage" / "server.py").write_text(
        "import importlib\n"
        "def mask():\n    from ..front import tokenizer\n"
        "def later():\n    importlib.import_module('skippy.mesh.cli')\n"
        "from . import loop\n")
    (tmp_path / "mesh" / "stage" / "loop.py").write_text("import skippy.mesh.stage\n")
    files = module_files(tmp_path, ("mesh",))
    graph = import_graph(files)
    assert graph["skippy.mesh.stage.server"] == {"skippy.mesh.front.tokenizer": 3,
                                                 "skippy.mesh.cli": 5,
                                                 "skippy.mesh.stage.loop": 6}
    assert graph["skippy.mesh.stage.loop"] == {"skippy.mesh.stage": 1}
    by = reached(graph, ["skippy.mesh.stage.loop"])
    assert "skippy.mesh.front.tokenizer" not in by and "skippy.mesh.stage" in by


def test_a_cycle_is_found_and_spelled_out_shortest():
    graph = {"a": {"b": 1}, "b": {"c": 2, "d": 3}, "c": {"a": 4}, "d": {"b": 5}, "e": {"a": 6},
             "f": {}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}, "c": {"a": 2}}) == []
    assert sorted(cycles({"x": {"y": 1}, "y": {"x": 2}, "p": {"q": 3}, "q": {"p": 4}})) == \
        [["p", "q", "p"], ["x", "y", "x"]]
