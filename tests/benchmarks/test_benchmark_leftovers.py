"""What running the benchmarks leaves behind (issue 43, item 9): a smoke run (``--quick``) writes
no file that git would show as new, and a report module run by mistake names no missing module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("written", [
    "benchmarks/paper/results/scaling_cpu_quick.csv",  # scaling.py --quick: scaling_<device>_quick<tag>.*
    "benchmarks/paper/results/scaling_cpu_quick.png",
    "benchmarks/paper/results/generation_cpu_quick.md",  # generation.py --quick: generation_<device>_quick[_tag].*
    "benchmarks/paper/results/generation_cpu_quick_mnist_trained.csv",
    "benchmarks/dev/results/cpu_floors_quick.md",
    "benchmarks/dev/results/generate_revisions_batch1.md",  # compare_revisions.py: one commit's before/after
    "benchmarks/dev/results/causal_state_overhead.csv",
    "benchmarks/dev/results/train_revisions_mnist_cpu_linear.md",
])
def test_quick_results_are_ignored_by_git(written):
    done = subprocess.run(["git", "check-ignore", "-q", written], cwd=REPO)
    assert done.returncode == 0, f"{written} would show as an untracked file after a --quick run"


def test_a_full_runs_results_are_not_ignored():
    done = subprocess.run(["git", "check-ignore", "-q", "benchmarks/paper/results/generation_cpu.md"], cwd=REPO)
    assert done.returncode == 1


@pytest.mark.slow
@pytest.mark.parametrize("module", ["benchmarks/paper/generation_report.py", "benchmarks/paper/speech_table3_report.py"])
def test_a_report_module_run_directly_imports_cleanly(module):
    done = subprocess.run([sys.executable, module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
