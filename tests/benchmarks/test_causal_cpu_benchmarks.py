"""The causal CPU benchmarks (benchmarks/dev/causal_cpu_grid.py, causal_cpu_layer.py) stay runnable:
their options, and each script's report at a small shape."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from test_benchmarks import REPO, _import_script


def test_causal_grid_shapes_option_runs_only_those_shapes():
    """causal_cpu_grid.py --shapes: the named shapes and nothing else; a malformed one is a clear error."""
    causal_cpu_grid = _import_script("causal_cpu_grid", "dev")
    import argparse

    args = argparse.Namespace(shapes=[causal_cpu_grid.parse_shape("8x8x4096x128"), causal_cpu_grid.parse_shape("1X8X65536X64")],
                              quick=False, max_elements=1 << 25)
    assert causal_cpu_grid.grid_shapes(args) == ([(8, 8, 4096, 128), (1, 8, 65536, 64)], [])
    full, _ = causal_cpu_grid.grid_shapes(argparse.Namespace(shapes=None, quick=False, max_elements=1 << 25))
    assert len(full) > 40 and full[:6] == causal_cpu_grid.ISSUE_SHAPES
    for bad in ("8x8x4096", "8x8x0x16", "axbxcxd"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxHxNxD"):
            causal_cpu_grid.parse_shape(bad)


@pytest.mark.slow
def test_causal_grid_times_an_earlier_revision_beside_the_current_one(tmp_path):
    """causal_cpu_grid.py --before-revision: causal_recurrence.cpp as at a revision (here HEAD: the
    current build serves where the working tree's source is the same, so at most one build) runs as
    'kernel before', interleaved, with its ratio in the report; a revision git cannot read is a clear
    error before any measuring. Through the script's command line; no feature-map columns (seconds
    of whole-attention timings that this test reads nothing of)."""
    command = [sys.executable, "benchmarks/dev/causal_cpu_grid.py", "--shapes", "1x2x256x16", "--repeats", "3",
               "--budget", "0.05", "--gemm-size", "128", "--feature-maps", "none", "--out", str(tmp_path), "--tag", "_t",
               "--before-revision"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    done = subprocess.run(command + [head], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "causal_linear_cpu_grid_t.md").read_text()
    assert f"causal_recurrence.cpp as at revision `{head}`" in report
    assert "kernel before / kernel" in report and "Kernel before / kernel (`--before-revision`): min" in report
    row = next(csv.DictReader((tmp_path / "causal_linear_cpu_grid_t.csv").open()))
    assert float(row["kernel_before_ms"]) > 0 and float(row["kernel_before_over_kernel"]) > 0
    assert "copy fraction" in report and 0 < float(row["kernel_copy_fraction"]) < 10  # a share of the memory bandwidth
    assert "alone GEMM fraction" in report and float(row["kernel_alone_ms"]) > 0 and float(row["kernel_alone_gemm_fraction"]) > 0
    missing = subprocess.run(command + ["no-such-revision"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert missing.returncode != 0 and "--before-revision: git cannot resolve the revision 'no-such-revision'" in missing.stderr
    assert "GEMM" not in missing.stdout  # refused before the machine's rates were measured


@pytest.mark.slow
def test_causal_layer_benchmark_times_the_layer_before_and_after_and_the_kernel(tmp_path):
    """causal_cpu_layer.py in-process on one small shape (D = 7: the kernel row zero-padded): the
    layer after and before, the fused kernel alone on mapped q, k, and their ratios, in the csv and
    the report."""
    import torch

    layer = _import_script("causal_cpu_layer", "dev")
    threads = torch.get_num_threads()
    try:
        layer.main(["--shapes", "1x2x64x7", "--repeats", "3", "--budget", "0.05", "--out", str(tmp_path), "--tag", "_t"])
    finally:
        torch.set_num_threads(threads)  # the script sets its own
    row = next(csv.DictReader((tmp_path / "causal_cpu_layer_t.csv").open()))
    for key in ("kernel_ms", "layer_after_ms", "layer_before_ms", "after_over_kernel", "before_over_after"):
        assert float(row[key]) > 0, key
    report = (tmp_path / "causal_cpu_layer_t.md").read_text()
    assert "| B | H | N | D | kernel ms | layer after ms | layer before ms |" in report and "Layer after / kernel: min" in report
