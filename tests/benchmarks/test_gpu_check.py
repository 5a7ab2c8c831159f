"""benchmarks/paper/gpu_check.py's dry run: every part at toy sizes on CPU, through the command line,
so the GPU check cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("part", ["kernel", "speed", "train"])
def test_dry_run_writes_its_report(part, tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", "--part", part, "--dry-run", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"== {part}" in done.stdout
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert 3 <= len(files) <= 6, files  # markdown + CSV + PNG, at most six
    assert {p.rsplit(".", 1)[-1] for p in files} == {"md", "csv", "png"}
    report = "\n".join((tmp_path / f).read_text() for f in files if f.endswith(".md"))
    if part in ("kernel", "train"):
        assert "## Targets" in report and "## Skipped" in report
    if part == "kernel":
        assert "parity: 24/24 within tolerance" in done.stdout  # fp32/fp16/bf16 x D in {8, 16} x 4 tensors
    if part == "train":
        assert "NOT met" in report or "met" in report
        assert all(f"{config}: 3 steps" in done.stdout for config in ("mnist_linear.yaml", "copy_softmax.yaml"))


def test_without_a_gpu_a_real_run_says_what_to_do(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", "--part", "kernel", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA GPU visible" in done.stderr and "--dry-run" in done.stderr
