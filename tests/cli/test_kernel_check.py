"""``cli.py plugins --check`` on the kernels (linformer_lab/ops/kernel_check.py): every candidate that
runs here is compared, forward and backward, with its op's float64 reference; one that raises
(a kernel that fails to compile or launch) or disagrees is one error line naming the switch that
forces the reference, and exit code 1. On a CPU the C++ kernels are checked; the Triton kernel is
checked here through Triton's interpreter, standing in as a candidate that applies to CPU tensors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_cli

from linformer_lab.models.generation.dynamic_step import fused_steps
from linformer_lab.ops import cpu, kernel_check, kernels


@pytest.fixture(scope="module")
def built(causal_extension, lsh_extension):
    """The three C++ CPU kernels (a skip where no C++ compiler can build them)."""
    try:
        cpu.load()
    except RuntimeError as error:
        pytest.skip(f"needs the fused CPU step extension ({error})")


def _by_name(results):
    return {(r.op, r.candidate, r.device): r for r in results}


def test_every_cpu_kernel_passes_and_the_gpu_ones_say_why_not(built):
    results = _by_name(kernel_check.check_kernels(["cpu"], steps=fused_steps))
    for key in (("causal_attention", "cpp", "cpu"), ("lsh_window", "cpp", "cpu"), ("fused_step", "cpp", "cpu")):
        result = results[key]
        assert result.status == "pass" and result.error < 1e-5 <= result.allowed, result
    assert results["causal", "cuda", "cpu"].status == "not here" and "CUDA tensors" in results["causal", "cuda", "cpu"].detail
    assert results["causal_attention", "triton", "cpu"].status == "not here"
    assert not any(r.candidate == kernels.PYTORCH for r in results.values())  # the references are the yardstick


def test_the_fused_step_check_runs_the_fused_step(built, monkeypatch):
    """The fused step is reached through fast_step: the check must really take it."""
    from linformer_lab.models.generation import cpu_step

    taken, original = [], cpu_step.step
    monkeypatch.setattr(cpu_step, "step", lambda *args: taken.append(r := original(*args)) or r)
    kernel_check.check_kernels(["cpu"], steps=fused_steps)
    assert any(r is not None for r in taken)


def _patched(monkeypatch, op: str, name: str, run) -> None:
    _replaced(monkeypatch, op, name, run=run)


def _replaced(monkeypatch, op: str, name: str, **fields) -> None:
    """``op``'s candidate ``name`` with ``fields`` changed, for the test."""
    candidates = [dataclasses.replace(c, **fields) if c.name == name else c for c in kernels.CANDIDATES[op]]
    monkeypatch.setitem(kernels.CANDIDATES, op, candidates)


def test_a_kernel_that_fails_to_launch_is_one_error_line_naming_the_switch(built, monkeypatch):
    def broken(*args):
        raise RuntimeError("PTX compilation failed: out of registers\n  (a long compiler log follows)")

    _patched(monkeypatch, "causal_attention", "cpp", broken)
    code, out, err = run_cli(["plugins", "--check"])
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == ["error: kernel causal_attention=cpp on cpu float32 failed to compile or launch: RuntimeError: PTX "
                     "compilation failed: out of registers; run with LINFORMER_LAB_KERNELS=causal_attention=pytorch (or "
                     "LINFORMER_LAB_KERNELS=pytorch for every op) to use the PyTorch form"]
    assert "Traceback" not in err and "causal_attention=cpp on cpu float32: error" in out
    assert "lsh_window=cpp on cpu float32: pass" in out  # the others are still checked


def test_a_kernel_that_disagrees_fails_in_one_line(built, monkeypatch):
    right = kernels.CANDIDATES["lsh_window"][0].run

    def off_by_one_percent(*args):
        out, lse = right(*args)
        return out * 1.01, lse

    _patched(monkeypatch, "lsh_window", "cpp", off_by_one_percent)
    code, out, err = run_cli(["plugins", "--json", "--check"])
    assert code == 1
    failed = [r for r in json.loads(out)["kernel_check"] if r["status"] == "FAIL"]
    assert [(r["op"], r["candidate"]) for r in failed] == [("lsh_window", "cpp")] and failed[0]["error"] > 5e-3
    assert "error: kernel lsh_window=cpp on cpu float32 disagrees with the reference (relative error" in err
    assert "LINFORMER_LAB_KERNELS=lsh_window=pytorch" in err


@pytest.mark.slow
def test_the_triton_kernel_passes_the_check_through_the_interpreter(monkeypatch):
    """The real Triton candidate, run by Triton's interpreter on CPU tensors (conftest sets
    TRITON_INTERPRET without a GPU): what ``--check`` does to it on a GPU."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the check runs the compiled kernel")
    from linformer_lab.ops.cuda.triton_chunk import backend

    _replaced(monkeypatch, "causal_attention", "triton", accepts=lambda *args: True, available=lambda: True,
              run=backend.causal_attention)
    results = kernel_check.check_kernels(["cpu"], ops=["causal_attention"])
    triton = [r for r in results if r.candidate == "triton"]  # the CPU's own candidates are checked too
    assert [(r.candidate, r.status) for r in triton] == [("triton", "pass")], results
    assert triton[0].error < 1e-5


@pytest.mark.slow
def test_plugins_check_through_the_real_cli():
    done = subprocess.run([sys.executable, str(REPO / "cli.py"), "plugins", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kernel check (forward and backward against the float64 reference, small shapes):" in done.stdout
    for line in ("causal_attention=cpp on cpu float32: pass", "lsh_window=cpp on cpu float32: pass",
                 "fused_step=cpp on cpu float32: pass"):
        assert line in done.stdout
    assert "error:" not in done.stderr
