"""benchmarks/paper/gpu_check.py's dry run: every part at toy sizes on CPU, through the command line
(Triton's interpreter for our kernel, the eager static decoder for the graph), so the one GPU
command cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_dry_run_writes_every_table(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for part in ("tests", "kernel", "train", "generation"):
        assert f"== {part}:" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check_cpu_dry_run.csv", "gpu_check_cpu_dry_run.md"]
    report = (tmp_path / "gpu_check_cpu_dry_run.md").read_text()
    for section in ("## Targets", "## Kernels: median ms", "## Kernels: ratios", "## Training", "## Generation", "## Skipped"):
        assert section in report
    assert "--dry-run" in report and "Triton" in report and "torch" in report
    rows = list(csv.DictReader((tmp_path / "gpu_check_cpu_dry_run.csv").read_text().splitlines()))
    kernel = {r["method"] for r in rows if r["part"] == "kernel" and r["fwd_bwd_ms"]}
    assert {"ours", "ours_nomap", "sdpa"} <= kernel  # ours through the interpreter, timed fwd and fwd+bwd
    agreement = [float(r["rel_err"]) for r in rows if r["part"] == "agreement"]
    assert agreement and max(agreement) < 1e-5  # fp32 interpreted kernel against the float64 definition
    train = {(r["config"], r["batch"]) for r in rows if r["part"] == "train"}
    assert {("mnist_linear.yaml", "10"), ("mnist_softmax.yaml", "10"), ("mnist_linear.yaml", "64")} <= train
    roles = {(r["role"], r["method"]) for r in rows if r["part"] == "generation"}
    assert {("latency", "linear"), ("batch 1,000", "linear"), ("batch 1,000", "stateful-softmax"), ("largest", "linear")} <= roles
    assert "fla: needs a CUDA GPU" in report  # what did not run is said


@pytest.mark.slow
def test_without_a_gpu_a_real_run_says_what_to_do(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA GPU visible" in done.stderr and "--dry-run" in done.stderr


@pytest.mark.slow
def test_the_kernel_part_runs_alone(tmp_path):
    command = [sys.executable, "benchmarks/paper/gpu_check.py", "--parts", "kernel", "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "gpu_check_cpu_dry_run.md").read_text()
    assert "## Kernels: median ms" in report and "| ours |" in report
