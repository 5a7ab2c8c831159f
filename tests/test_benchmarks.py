"""The benchmark scripts stay runnable and use only the library's public names."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in ("common.py", "generation_report.py"))


def private_imports(path: Path) -> list[str]:
    """``from linformer_lab... import _name`` and ``linformer_lab...._name`` attribute reads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "linformer_lab":
            found += [f"{path.name}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                      if a.name.startswith("_")]
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.append(f"{path.name}:{node.lineno} imports the private module {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "linformer_lab" and any(p.startswith("_") for p in a.name.split("."))]
    return found


def test_no_benchmark_imports_a_private_name():
    found = [line for path in sorted(BENCHMARKS.glob("*.py")) for line in private_imports(path)]
    assert not found, "benchmarks must use public names:\n" + "\n".join(found)


def test_the_checker_sees_private_imports(tmp_path):
    script = tmp_path / "b.py"
    script.write_text("from linformer_lab.models.transformer import _PrefixCache\nimport linformer_lab._x\n")
    assert len(private_imports(script)) == 2


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_parses_its_options(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_generate_revisions_reports_medians_and_ratios(tmp_path):
    """generate_revisions.py's report: per mode the median over rounds of each variant, their
    ratio, and the stepped/prefill speedup within each variant; the old revision named as a commit."""
    import argparse

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import generate_revisions
    finally:
        sys.path.remove(str(BENCHMARKS))
    runs = {"old": [{"prefill": p, "stepped": s} for p, s in ((1.0, 3.0), (2.0, 4.0), (9.0, 5.0))],
            "new": [{"prefill": p, "stepped": s} for p, s in ((0.5, 2.0), (1.5, 2.5), (0.9, 8.0))]}
    args = argparse.Namespace(rev="HEAD", commit="abc1234", batch=3, rounds=3, calls=1, threads=1, out=str(tmp_path / "g"))
    generate_revisions.write_results(args, runs)
    text = (tmp_path / "g_batch3.md").read_text()
    assert "at HEAD = abc1234 (old)" in text and f"--out {os.path.relpath(tmp_path / 'g', BENCHMARKS.parent)}" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| mode")}
    assert rows["prefill"] == ["2.000", "0.900", "0.450"]
    assert rows["stepped"] == ["4.000", "2.500", "0.625"]
    assert rows["stepped / prefill"][:2] == ["2.000", "2.778"]
