"""The layering ARCHITECTURE.md promises, checked on the source: every library file's imports of `hybridserve`
are allowed by the "may import" table, and no library files import each other in a circle.

Rules: the library is every `.py` file of the folders `pyproject.toml` maps to `hybridserve.*`. Every import
statement counts, wherever it stands: at module level, inside a function (imported later, still a dependency),
and under `if TYPE_CHECKING:` (an annotation names the other module's type: the two files still know each other,
so such an import may neither break the table nor close a circle; a `Protocol` naming only what a module uses, or
a shared type in a module of its own, are the ways out). Third-party imports are not in the table; the torch-free
packages are checked in fresh interpreters (`tests/router/test_import_boundaries.py`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as .ci/typecheck.sh needs too

ROOT = Path(__file__).resolve().parents[1]
EVERYTHING = "everything"


@dataclass(frozen=True)
class Layer:
    """One row of the table: a package and the parts of `hybridserve` its files may import."""

    folder: str
    package: str
    may_import: tuple[str, ...]  # full module or package names, or EVERYTHING


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _full_name(name: str) -> str:
    return name if name == EVERYTHING or name.split(".")[0] == "hybridserve" else f"hybridserve.{name}"


def read_layers(text: str) -> list[Layer]:
    """The rows of ARCHITECTURE.md's table whose header has a "may import" column (rows without a package skipped)."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("|") and "may import" in line)
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    folder_col, package_col, import_col = columns.index("folder"), columns.index("package"), columns.index("may import")
    layers = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        packages = _ticked(cells[package_col])
        if not packages:
            continue
        assert len(packages) == 1, f"one package per row of the table: {line}"
        folders = _ticked(cells[folder_col])
        allowed = tuple(_full_name(n) for n in _ticked(cells[import_col]))
        layers.append(Layer(folders[0].rstrip("/"), packages[0], allowed))
    return layers


def library_modules() -> dict[str, Path]:
    """Module name -> file, for every file of the folders pyproject.toml maps to hybridserve packages."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = {}
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@dataclass(frozen=True)
class Import:
    target: str  # the library module imported (a package stands for its __init__)
    line: int


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every `hybridserve` module `module` imports, anywhere in its file (see the module docstring)."""
    is_package = path.stem == "__init__"
    found = []

    def resolve(name: str, line: int) -> None:
        if name.split(".")[0] != "hybridserve":
            return
        if name not in modules:
            raise AssertionError(f"{path.relative_to(ROOT)}:{line} imports {name}, which is no library module")
        found.append(Import(name, line))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                # `from package import module` imports that module; `from module import name` the module
                submodule = f"{base}.{alias.name}"
                resolve(submodule if submodule in modules else base, node.lineno)
    return found


def _allowed(target: str, layer: Layer) -> bool:
    return any(name == EVERYTHING or target == name or target.startswith(name + ".")
               for name in (layer.package, *layer.may_import))


def _layer_of(module: str, layers: list[Layer]) -> Layer | None:
    owners = [layer for layer in layers if module == layer.package or module.startswith(layer.package + ".")]
    return max(owners, key=lambda layer: len(layer.package), default=None)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    return read_layers((ROOT / "ARCHITECTURE.md").read_text())


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    modules = library_modules()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def test_the_table_names_every_package_with_its_folder(layers: list[Layer]) -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = config["tool"]["setuptools"]["package-dir"]
    rows = {layer.package: layer.folder for layer in layers}
    for package, folder in folders.items():
        layer = _layer_of(package, layers)
        assert layer is not None, f"{package} ({folder}/) has no row in ARCHITECTURE.md's table"
        if package in rows:
            assert rows[package] == folder, f"the table puts {package} in {rows[package]}/, pyproject in {folder}/"
    known = {n for n in folders} | {EVERYTHING}
    for layer in layers:
        for name in layer.may_import:
            assert any(name == k or name.startswith(k + ".") for k in known), f"{layer.package}: unknown {name}"


def test_every_import_is_allowed_by_the_table(layers: list[Layer], graph: dict[str, list[Import]]) -> None:
    modules = library_modules()
    wrong = []
    for module, found in graph.items():
        layer = _layer_of(module, layers)
        assert layer is not None, module
        wrong += [f"{modules[module].relative_to(ROOT)}:{i.line} {layer.package} -> {i.target}"
                  for i in found if not _allowed(i.target, layer)]
    assert not wrong, "imports ARCHITECTURE.md's table does not allow:\n" + "\n".join(sorted(wrong))


def test_no_circle_between_library_files(graph: dict[str, list[Import]]) -> None:
    edges = {module: {i.target for i in found if i.target != module} for module, found in graph.items()}
    found = circles(edges)
    assert not found, "library files that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_find_what_they_look_for() -> None:
    """The parser and the circle finder on made-up input: a check that finds nothing must be able to."""
    table = ("| folder | package | owns | may import |\n|---|---|---|---|\n"
             "| `a/` | `hybridserve.a` | x | `b.c`, `hybridserve.d`; torch |\n| `t/` | — | tests | everything |\n")
    (layer,) = read_layers(table)
    assert layer == Layer("a", "hybridserve.a", ("hybridserve.b.c", "hybridserve.d"))
    assert _allowed("hybridserve.b.c", layer) and _allowed("hybridserve.a.x", layer)
    assert not _allowed("hybridserve.b", layer) and not _allowed("hybridserve.b.cd", layer)
    assert circles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert circles({"x": {"y"}, "y": set()}) == []
