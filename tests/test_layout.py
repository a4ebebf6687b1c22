"""The layout rules of DESIGN.md §3, read from the source: imports point one way (nothing
in the product imports `skippy.evals`; `cache/` parses no command lines), and no function
in `stages/` or `mesh/` runs over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("topology", "stages", "cache", "mesh", "proto")
MAX_FUNCTION_LINES = 60


def sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path, folder: str) -> set[str]:
    """Every module the file at `path` in `folder` imports, relative imports resolved."""
    package = ["skippy", folder, *path.relative_to(ROOT / folder).parent.parts]
    return imports_of(path.read_text(), package)


def imports_of(source: str, package: list[str]) -> set[str]:
    """Every module `source` imports, as if it were a module of `package` (its parts); a
    `from X import y` counts as importing X and X.y (`from skippy import evals`)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("folder", PRODUCT)
def test_no_product_module_imports_evals(folder):
    offenders = sorted(f"{p.relative_to(ROOT)}: {m}" for p in sources(folder)
                       for m in imported_modules(p, folder)
                       if m == "skippy.evals" or m.startswith("skippy.evals."))
    assert not offenders, "evals/ wraps the product, never the other way:\n" + \
        "\n".join(offenders)


def test_cache_parses_no_command_lines():
    offenders = sorted(str(p.relative_to(ROOT)) for p in sources("cache")
                       if "argparse" in imported_modules(p, "cache"))
    assert not offenders, f"the command line belongs to mesh/, not cache/: {offenders}"


def test_the_import_reader_sees_every_spelling():
    code = ("import skippy.evals.numerics\nfrom skippy import evals\n"
            "from ..evals import bench_cache\nfrom . import frame\n")
    assert {"skippy.evals.numerics", "skippy.evals", "skippy.evals.bench_cache",
            "skippy.stages.frame"} <= imports_of(code, ["skippy", "stages"])
    assert {"skippy.stages.evals.bench_cache", "skippy.stages.sub.frame"} <= \
        imports_of(code, ["skippy", "stages", "sub"])


def long_functions(folder: str) -> list[str]:
    found = []
    for path in sources(folder):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


@pytest.mark.parametrize("folder", ["stages", "mesh"])
def test_no_function_runs_over_60_lines(folder):
    assert not long_functions(folder), "split these into named pieces:\n" + \
        "\n".join(long_functions(folder))


def test_the_stage_server_modules_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in sources("mesh/stage")
           if (n := len(p.read_text().splitlines())) >= 400]
    assert not big, big


def test_mesh_imports_point_one_way():
    """front -> control -> stage: the stage server knows no engine, the control plane no
    HTTP front end."""
    wrong = sorted(f"{p.relative_to(ROOT)}: {m}"
                   for sub, banned in (("mesh/stage", ("control", "front")),
                                       ("mesh/control", ("front",)))
                   for p in sources(sub) for m in imported_modules(p, "mesh")
                   if any(m.startswith(f"skippy.mesh.{b}") for b in banned))
    assert not wrong, wrong


def test_the_command_line_modules_import_one_way():
    """cli -> service_cli -> serve_cli -> usage: no command module imports one above it."""
    order = ["cli", "service_cli", "serve_cli", "usage"]
    wrong = sorted(f"mesh/{low}.py: {m}" for i, low in enumerate(order)
                   for m in imported_modules(ROOT / "mesh" / f"{low}.py", "mesh")
                   for up in order[:i]
                   if m == f"skippy.mesh.{up}" or m.startswith(f"skippy.mesh.{up}."))
    assert not wrong, wrong
