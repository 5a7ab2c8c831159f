"""The command line's wing imports one way, and its light answers stay light.

``linformer_lab/cli/`` has an order, bottom to top (:data:`ORDER`, as its ``__init__`` draws it):
each module imports only modules below it, imports inside functions included, so no module low in
the order calls up into one above it (the entry once lived beside the argv helpers, which then
imported it back to run anything). ``python cli.py --help`` and ``plugins``, as a user types them,
import neither Lightning nor torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

WING = REPO / "linformer_lab" / "cli"

#: The modules of ``linformer_lab/cli/``, bottom to top.
ORDER = ["args", "config_help", "checks", "callbacks", "checkpoints", "export", "lightning_cli", "entry"]


def wing_imports(path: Path, wing: Path = WING) -> list[tuple[int, str]]:
    """(line, module of the wing) for every import of one in ``path``; ``"__init__"`` for the package
    itself (``from linformer_lab.cli import main``: a name it could only get from the top of the wing)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{alias.name}" if node.module == "linformer_lab.cli" else node.module
                     for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["linformer_lab", "cli"]:
                inner = parts[2] if len(parts) > 2 and (wing / f"{parts[2]}.py").is_file() else "__init__"
                found.append((node.lineno, inner))
    return found


def upward_imports(wing: Path = WING, order: list[str] = ORDER) -> list[str]:
    rank = {name: i for i, name in enumerate(order)}
    rank["__init__"] = len(order)  # a name of the package itself would come from its top
    bad = []
    for path in sorted(wing.glob("*.py")):
        if path.stem == "__init__":
            continue
        assert path.stem in rank, f"{path.name} has no place in ORDER (tests/cli/test_cli_imports.py); add it"
        for line, target in wing_imports(path, wing):
            if rank[target] >= rank[path.stem]:
                bad.append(f"cli/{path.name}:{line} imports {target} (not below it)")
    return bad


def test_the_wing_imports_one_way():
    bad = upward_imports()
    assert not bad, "imports against the order of linformer_lab/cli/ (its __init__ draws it):\n" + "\n".join(bad)
    assert set(ORDER) == {p.stem for p in WING.glob("*.py")} - {"__init__"}
    assert not wing_imports(WING / "__init__.py"), "the package's __init__ imports nothing of the wing"


def test_the_order_check_sees_a_call_up_the_wing(tmp_path):
    (tmp_path / "low.py").write_text("def run():\n    from linformer_lab.cli.high import go\n")
    (tmp_path / "high.py").write_text("from linformer_lab.cli import low\nfrom linformer_lab.cli import main\n")
    bad = upward_imports(tmp_path, ["low", "high"])
    assert bad == ["cli/high.py:2 imports __init__ (not below it)", "cli/low.py:2 imports high (not below it)"], bad


HEAVY = ("lightning", "torch", "pytorch_lightning", "lightning_fabric")


@pytest.mark.slow
@pytest.mark.parametrize("command", [["--help"], ["plugins"]])
def test_cli_py_help_and_plugins_import_neither_lightning_nor_torch(command, tmp_path):
    """As the user types it: ``python -X importtime`` lists every module the command imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "cli.py"), *command],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", done.stderr, re.M)}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert {"linformer_lab"} <= imported  # the listing was read
