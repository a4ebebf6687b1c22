"""The distribution ships every module: a wheel built from pyproject.toml holds each
package folder (subpackages included) and the data files the code reads at run time."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    tool = _tool()
    folders = {}
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            folders[".".join([name, *rel.parts])] = init.parent
    missing = sorted(set(folders) - set(tool["packages"]))
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"


def _folder(package_dir: dict, package: str) -> Path:
    top = max((name for name in package_dir if package.startswith(name)), key=len)
    return ROOT / package_dir[top] / Path(*package[len(top):].split(".")[1:])


def test_package_data_exists():
    tool = _tool()
    for package, patterns in tool["package-data"].items():
        folder = _folder(tool["package-dir"], package)
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: no file matches {pattern}"


def test_every_kernel_source_ships():
    """A node that installs the wheel compiles our kernels from these files."""
    from skippy.stages import qkernel
    shipped = set(_tool()["package-data"]["skippy.stages"])
    missing = sorted({p.name for p in (*qkernel.SOURCES, *qkernel.HEADERS)} - shipped)
    assert not missing, f"pyproject.toml package-data lacks {missing}"
