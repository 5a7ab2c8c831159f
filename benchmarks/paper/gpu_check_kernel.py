"""The kernel part of benchmarks/paper/gpu_check.py: build ``linear_cuda`` and run its tests, parity
against the PyTorch path, timings against PyTorch, SDPA and flash-linear-attention, and the
sequence length from which it beats SDPA. On the CPU (``--dry-run``) the chunked PyTorch path
stands in for the kernel at toy sizes."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: The linear_cuda test files (build, CPU emulation, GPU), run on the GPU node.
CUDA_TESTS = ["tests/ops/test_linear_cuda_build.py", "tests/ops/test_linear_cuda_emulation.py", "tests/ops/test_linear_cuda_gpu.py"]
#: (B, T, H, D) of the kernel timings (bf16), as in the issue.
TIMING_SHAPES = [(8, 1024, 8, 64), (4, 2048, 16, 128), (4, 4096, 64, 128), (1, 8192, 96, 128), (2, 16384, 16, 128)]
PARITY_DIMS = (32, 64, 128, 256)
PARITY_LENGTH = 65_536


def _rel_err(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _feature_inputs(b, h, n, d, m, dtype, device, seed=0):
    """Feature-mapped (positive) q, k and values v, ``(B, H, N, D|M)``, leaves with grads."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    q = (torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen, device=device)) + 1) / d**0.5
    k = (torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen, device=device)) + 1) / d**0.5
    v = torch.randn(b, h, n, m, generator=gen, device=device)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _numerator_and_grads(fn, q, k, v, grad_out):
    import torch

    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return [out.detach(), *grads]


def kernel_parity(device: str, dry_run: bool, budget) -> list[dict]:
    """linear_cuda (or, on CPU, the chunked PyTorch path) against the reference: forward and
    the gradients of q, k, v, normwise relative error, per dtype and head size."""
    import torch

    from linformer_lab.ops.linear_attention import causal_dot_product
    from linformer_lab.ops.linear_attention.naive import causal_dot_product_naive

    if device == "cuda":
        from linformer_lab.ops import cuda as cuda_ops

        fast, reference, label = cuda_ops.causal_dot_product, causal_dot_product, "linear_cuda vs PyTorch linear"
        n, dims = PARITY_LENGTH, PARITY_DIMS
    else:
        fast, reference, label = causal_dot_product, causal_dot_product_naive, "PyTorch linear vs naive"
        n, dims = 64, (8, 16)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for d in dims:
            if not budget.allows(20 if device == "cuda" else 1, f"parity {dtype} D={d}"):
                continue
            q, k, v = _feature_inputs(1, 2, n, d, d, dtype, device)
            grad_out = torch.randn_like(v)
            got = _numerator_and_grads(fast, q, k, v, grad_out)
            # the reference sees the same (rounded) inputs in fp32 (float64 on CPU)
            ref_dtype = torch.float32 if device == "cuda" else torch.float64
            leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
            want = _numerator_and_grads(reference, *leaves, grad_out.to(ref_dtype))
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            for name, g, w in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
                err = _rel_err(g, w)
                rows.append({"kind": "parity", "check": label, "dtype": str(dtype).split(".")[-1], "D": d, "N": n,
                             "tensor": name, "rel_err": err, "ok": err <= tolerance})
    return rows


def _initial_state_supported() -> bool:
    from linformer_lab.ops.linear_attention import causal_linear_attention

    return "initial_state" in inspect.signature(causal_linear_attention).parameters


def _time_methods(shape, device: str, dtype, repeats: int) -> list[dict]:
    """Median fwd and fwd+bwd seconds of each method at one (B, T, H, D)."""
    import torch
    import torch.nn.functional as F

    import linformer_lab as ll

    b, t, h, d = shape
    methods = {"linear": ll.build_attention("linear", causal=True, query_dim=d).to(device)}
    if device == "cuda":
        methods["linear_cuda"] = ll.build_attention("linear_cuda", causal=True, query_dim=d).to(device)
    methods["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        from fla.ops.linear_attn import chunk_linear_attn

        def fla(q, k, v):  # fla takes and returns (B, T, H, D); ours are (B, H, T, D)
            out = chunk_linear_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), normalize=True)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        if device == "cuda":
            methods["fla_chunk"] = fla
    except Exception:  # noqa: BLE001 - optional comparison
        pass
    rows = []
    for name, fn in methods.items():
        q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, t, d, device=device, dtype=dtype)

        def forward(fn=fn, q=q, k=k, v=v):
            with torch.no_grad():
                fn(q, k, v)

        def forward_backward(fn=fn, q=q, k=k, v=v, grad=grad):
            torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

        row = {"kind": "time", "method": name, "B": b, "T": t, "H": h, "D": d, "dtype": str(dtype).split(".")[-1]}
        try:
            row["fwd_ms"] = common.median_seconds(forward, repeats, 1, device) * 1e3
            row["fwd_bwd_ms"] = common.median_seconds(forward_backward, repeats, 1, device) * 1e3
        except torch.OutOfMemoryError:
            row["note"] = "out of memory"
            torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001 - reported in the table, the other methods go on
            row["note"] = f"{type(err).__name__}: {err}"[:200]
        rows.append(row)
    return rows


def measure(device: str, budget) -> tuple[list[str], list[dict], int | None]:
    """Build and test (on a GPU), parity, timings and the SDPA crossover: ``(summary lines, rows, crossover T)``."""
    import torch

    summary, rows = [], []
    if device == "cuda":
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        from linformer_lab.ops import cuda as cuda_ops

        t0 = time.monotonic()
        cuda_ops.load(verbose=True)  # builds for this GPU's architecture unless a cached build fits
        summary.append(f"linear_cuda built/loaded in {time.monotonic() - t0:.0f} s")
        if budget.allows(120, "CUDA tests"):
            done = subprocess.run([sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "-p", "no:cacheprovider"],
                                  cwd=REPO, capture_output=True, text=True, timeout=max(90, budget.left() * 0.5))
            last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            summary.append(f"tests/ops/test_linear_cuda_*.py: {last}")
            rows.append({"kind": "tests", "result": last, "ok": done.returncode == 0})
    else:
        budget.skipped.append("building linear_cuda and the CUDA tests (no GPU in a dry run)")
    parity = kernel_parity(device, device != "cuda", budget)
    rows += parity
    bad = [r for r in parity if not r["ok"]]
    summary.append(f"parity: {len(parity) - len(bad)}/{len(parity)} within tolerance"
                   + (f"; worst {max(r['rel_err'] for r in bad):.2g}" if bad else ""))
    if not _initial_state_supported():
        budget.skipped.append("initial-state parity (the ops take no initial state yet)")

    shapes = TIMING_SHAPES if device == "cuda" else [(1, 64, 2, 8), (1, 128, 2, 8)]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    repeats = 10 if device == "cuda" else 2
    for shape in shapes:
        if budget.allows(30 if device == "cuda" else 1, f"timing {shape}"):
            rows += _time_methods(shape, device, dtype, repeats)
    # crossover: the shortest T at which linear(_cuda) fwd+bwd beats SDPA
    sweep = [2**p for p in range(9, 16)] if device == "cuda" else [32, 64, 128]
    ours = "linear_cuda" if device == "cuda" else "linear"
    crossover = None
    for t in sweep:
        if not budget.allows(20 if device == "cuda" else 1, f"crossover T={t}"):
            break
        timed = {r["method"]: r for r in _time_methods((1, t, 16 if device == "cuda" else 2, 64 if device == "cuda" else 8),
                                                        device, dtype, repeats)}
        for r in timed.values():
            r["kind"] = "sweep"
        rows += timed.values()
        if crossover is None and timed[ours].get("fwd_bwd_ms", 1e30) < timed["sdpa"].get("fwd_bwd_ms", 0):
            crossover = t
    summary.append(f"{ours} fwd+bwd beats SDPA from T = {crossover}" if crossover
                   else f"{ours} did not beat SDPA up to T = {sweep[-1]}")
    return summary, rows, crossover


def report_lines(rows: list[dict], crossover: int | None, device: str) -> list[str]:
    """The markdown of the kernel part after its header: parity, timings, targets."""
    parity = [r for r in rows if r["kind"] == "parity"]
    md = ["## Parity (normwise relative error)", "",
           common.markdown_table(["check", "dtype", "D", "N", "tensor", "rel. error", "ok"],
                                 [[r["check"], r["dtype"], r["D"], r["N"], r["tensor"], f"{r['rel_err']:.2e}", r["ok"]]
                                  for r in parity]), ""]
    timings = [r for r in rows if r["kind"] == "time"]
    md += ["## Timings (median ms)", "",
           common.markdown_table(["method", "B", "T", "H", "D", "fwd", "fwd+bwd", "note"],
                                 [[r["method"], r["B"], r["T"], r["H"], r["D"], common.fmt(r.get("fwd_ms"), 3),
                                   common.fmt(r.get("fwd_bwd_ms"), 3), r.get("note", "")] for r in timings]), ""]
    return md + _kernel_targets(rows, crossover, device)


def _kernel_targets(rows, crossover, device) -> list[str]:
    parity_ok = all(r["ok"] for r in rows if r["kind"] == "parity")
    lines = ["## Targets", "", "| target | result |", "|---|---|",
             f"| linear_cuda matches the PyTorch path at every size and dtype | {'met' if parity_ok else 'NOT met'} |"]
    timings = [r for r in rows if r["kind"] == "time" and r["T"] >= 4096]
    by_shape: dict = {}
    for r in timings:
        by_shape.setdefault((r["B"], r["T"], r["H"], r["D"]), {})[r["method"]] = r.get("fwd_bwd_ms")
    if device == "cuda" and by_shape:
        vs_fla = [s for s, m in by_shape.items() if m.get("fla_chunk") and m.get("linear_cuda")]
        if vs_fla:
            met = all(by_shape[s]["linear_cuda"] <= by_shape[s]["fla_chunk"] for s in vs_fla)
            lines.append(f"| fwd+bwd no slower than fla's chunk kernel at T >= 4096 | {'met' if met else 'NOT met'} |")
        else:
            notes = sorted({r["note"] for r in timings if r["method"] == "fla_chunk" and r.get("note")})
            why = f"fla failed: {notes[0][:120]}" if notes else "fla not importable"
            lines.append(f"| fwd+bwd no slower than fla's chunk kernel at T >= 4096 | not measured ({why}) |")
        met = all((m.get("linear_cuda") or 1e30) < (m.get("sdpa") or 0) for m in by_shape.values())
        lines.append(f"| faster than SDPA from T = 4096 | {'met' if met else 'NOT met'} (crossover T = {crossover}) |")
    else:
        lines.append("| kernel timings against fla and SDPA | not measured (no GPU) |")
    return lines + [""]


def plot_sweep(rows, path: Path) -> None:
    plt = common.pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in rows}):
        points = [(r["T"], r["fwd_bwd_ms"]) for r in rows if r["method"] == method and r.get("fwd_bwd_ms")]
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="fwd+bwd (ms)", title="causal attention")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

