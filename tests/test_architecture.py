"""The package's layers import only downward (docs/ARCHITECTURE.md).

Read from the source with ``ast``, so imports inside functions (the usual way to hide a cycle)
count too. The layers, bottom to top::

    registry, utils  <  feature_maps, ops  <  attention  <  models, data  <  tasks  <  cli, checkpoints

A module may import its own layer and the layers below it. Nothing imports the package root
``linformer_lab`` (its ``__init__``) from inside the package: the root only re-exports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "linformer_lab"

LAYER_OF = {
    "registry": 0, "utils": 0, "validation": 0,
    "feature_maps": 1, "ops": 1,
    "attention": 2,
    "models": 3, "data": 3,
    "tasks": 4,
    "cli": 5, "cli_args": 5, "checkpoints": 5,
}


def _layer(module: str) -> int | None:
    """``linformer_lab.a.b`` -> the layer of ``a``; None for the package root."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] not in LAYER_OF:
        raise AssertionError(f"{module}: top-level module {parts[1]!r} has no layer in LAYER_OF; "
                             "add it (and to docs/ARCHITECTURE.md)")
    return LAYER_OF[parts[1]]


def _module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, package_dir: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every first-party import in the file, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    name = _module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "linformer_lab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "linformer_lab":
                found.append((node.lineno, module))
    return found


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Every import that points to a higher layer or to the package root, as readable lines."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        importer = _module_name(path, package)
        own = _layer(importer)
        if own is None:  # the root __init__ re-exports; it may import anything
            continue
        for line, module in _imports(path, package):
            target = _layer(module)
            if target is None:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports the package root ({module})")
            elif target > own:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports {module} (layer {target} > {own})")
    return bad


def test_no_upward_imports():
    bad = upward_imports()
    assert not bad, "imports against the layer order (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_checker_sees_nested_and_relative_imports(tmp_path):
    pkg = tmp_path / "linformer_lab"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "a.py").write_text(
        "def f():\n    from linformer_lab.tasks import x\n    import linformer_lab\n    from ..models import y\n"
    )
    bad = upward_imports(pkg)
    assert len(bad) == 3, bad
    assert any("linformer_lab.tasks" in b for b in bad)
    assert any("package root" in b for b in bad)
    assert any("linformer_lab.models" in b for b in bad)


#: Folders whose Python files stay under MAX_LINES: the library, the benchmarks and the tests.
SMALL_FILE_ROOTS = ("linformer_lab", "benchmarks", "tests")
MAX_LINES = 460


def python_files(roots=SMALL_FILE_ROOTS, repo: Path = PACKAGE.parent) -> list[Path]:
    return sorted(p for root in roots for p in (repo / root).rglob("*.py"))


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_files_stay_small(path):
    # A file past this is split along its seams (docs/ARCHITECTURE.md, "Where things live"):
    # a library module by concern, a benchmark into its measurement and its report, a test file
    # by the part of the code it tests, with shared helpers in conftest.py or a helper module.
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines; split it along its seams"


def test_the_size_rule_covers_benchmarks_and_tests():
    covered = {p.relative_to(PACKAGE.parent).parts[0] for p in python_files()}
    assert covered == set(SMALL_FILE_ROOTS)
    assert any(p.parent.name in ("paper", "dev") for p in python_files(("benchmarks",)))  # the rooms' subfolders too
