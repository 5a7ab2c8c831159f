"""The GPU kernel benchmark: causal attention kernels against kernels, forward and forward+backward,
on the grid of the project's GPU issue, bf16, interleaved; the HBM roofline fraction of our
forward at B2 T16384 H16 D128. The kernel part of ``gpu_check.py``, which also runs it alone
(``--parts kernel``).

Methods, each on inputs already in its own layout (the layout change is not timed):

* ``ours``: ``linformer_lab.ops.cuda.triton_chunk.chunk_linear_attention`` on contiguous
  ``(B, T, H, D)`` (``head_first=False``), elu + 1 and the normaliser fused;
* ``ours_nomap``: the same with ``feature_map=None`` (inputs taken as mapped), fla's function;
* ``fla``: flash-linear-attention's ``chunk_linear_attn(normalize=True, scale=1)`` on contiguous
  ``(B, T, H, D)``, its own layout (its normaliser is a separate PyTorch pass);
* ``cuda_old``: the earlier ``linear_cuda`` numerator kernel (``ops.cuda.causal_dot_product``)
  with elu and the normaliser in PyTorch, ``(B, H, T, D)``, as the module ran it before;
* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` (FlashAttention), ``(B, H, T, D)``.

Each cell is the median over rounds of CUDA-event times, the methods interleaved within a round
(A B C, C B A, ...). Two rounds per shape: every method but fla over the whole grid first, then
ours beside fla, longest sequences first, at the shapes the budget still holds (fla's first call
at a new shape autotunes for minutes); a ratio against fla comes from the second round.
``--dry-run`` runs the same code on the CPU at toy sizes in fp32, with Triton's interpreter for
ours (``TRITON_INTERPRET=1``, set before Triton is imported).

    PYTHONPATH=. python3 benchmarks/paper/gpu_check.py --parts kernel --out DIR [--budget-s 200]
    uv run python benchmarks/paper/gpu_check.py --parts kernel --dry-run --out DIR
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

#: (B, T, H, D) of the issue's grid; the last two are the MNIST model's attention.
GRID = [(8, 1024, 8, 64), (4, 2048, 16, 128), (4, 4096, 64, 128), (1, 8192, 96, 128), (2, 16384, 16, 128),
        (10, 784, 8, 32), (64, 784, 8, 32)]
DRY_GRID = [(1, 32, 1, 16)]
ROOFLINE_SHAPE = (2, 16384, 16, 128)
#: Seconds planned for fla's first forward and first forward+backward at a new shape, without an
#: earlier run's autotune results (an H200 with fla 0.6: 86 s at B8 T1024, 105 s at B2 T16384) and
#: with them (not yet measured: a compile of the chosen configs only).
FLA_FIRST_CALL_S = {False: 110, True: 25}
#: Set by gpu_check.py when it restored an earlier run's autotune results.
RESTORED_TUNING = "LINFORMER_LAB_RESTORED_TUNING"
METHODS = ("ours", "ours_nomap", "fla", "cuda_old", "sdpa")
#: The two interleaved timing rounds, as the report names them.
ROUND_NAMES = {"kernel": "all but fla", "kernel_fla": "beside fla"}
#: the comparisons of the issue's targets: (ours, against, pass)
RATIOS = (("ours", "fla", "fwd_bwd"), ("ours_nomap", "fla", "fwd_bwd"), ("ours", "sdpa", "fwd_bwd"),
          ("ours", "cuda_old", "fwd_bwd"), ("ours", "fla", "fwd"), ("ours", "sdpa", "fwd"))


def _fla():
    """fla's ``chunk_linear_attn`` as ``f(q, k, v)`` on ``(B, T, H, D)``, or the reason it is missing."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as err:  # noqa: BLE001 - any import failure: reported, the others go on
        return None, f"fla not importable: {type(err).__name__}: {str(err)[:120]}"
    params = inspect.signature(chunk_linear_attn).parameters
    extra = {"head_first": False} if "head_first" in params else {}
    if "scale" in params:
        extra["scale"] = 1.0

    def run(q, k, v):
        out = chunk_linear_attn(q, k, v, normalize=True, **extra)
        return out[0] if isinstance(out, tuple) else out

    return run, None


def methods(device: str) -> tuple[dict, dict]:
    """``({name: (fn(q, k, v), layout)}, {name: why not})``; layout ``"bthd"`` or ``"bhtd"``."""
    import torch
    import torch.nn.functional as F

    found, missing = {}, {}
    try:
        from linformer_lab.ops.cuda import triton_chunk

        why = triton_chunk.unavailable_reason() if device == "cuda" else None
        if why is None:
            found["ours"] = (lambda q, k, v: triton_chunk.chunk_linear_attention(q, k, v, head_first=False), "bthd")
            found["ours_nomap"] = (lambda q, k, v: triton_chunk.chunk_linear_attention(
                q, k, v, feature_map=None, head_first=False), "bthd")
        else:
            missing["ours"] = missing["ours_nomap"] = why
    except ImportError as err:
        missing["ours"] = missing["ours_nomap"] = f"linformer_lab.ops.cuda.triton_chunk not importable ({err})"
    if device == "cuda":
        fla, why = _fla()
        if fla is None:
            missing["fla"] = why
        else:
            found["fla"] = (fla, "bthd")
        from linformer_lab.ops import cuda as cuda_ops

        if cuda_ops.is_available():
            cuda_ops.load()

            def cuda_old(q, k, v, eps=1e-6):
                phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
                numerator = cuda_ops.causal_dot_product(phi_q, phi_k, v)
                den = torch.einsum("bhtd,bhtd->bht", phi_q.float(), phi_k.float().cumsum(2))
                return (numerator.float() / (den.unsqueeze(-1) + eps)).to(v.dtype)

            found["cuda_old"] = (cuda_old, "bhtd")
        else:
            missing["cuda_old"] = "linear_cuda cannot be built here (no nvcc or GPU)"
    else:
        missing["fla"] = missing["cuda_old"] = "needs a CUDA GPU (dry run)"
    found["sdpa"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "bhtd")
    return found, missing


def _inputs(shape, layout: str, dtype, device: str, seed: int):
    import torch

    b, t, h, d = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    # positive keys/queries of moderate size: valid inputs for the methods without a feature map too
    q, k = (torch.rand(b, t, h, d, generator=gen, device=device).div_(d**0.5) for _ in range(2))
    v = torch.randn(b, t, h, d, generator=gen, device=device)
    grad = torch.randn(b, t, h, d, generator=gen, device=device)
    if layout == "bhtd":
        q, k, v, grad = (x.transpose(1, 2) for x in (q, k, v, grad))
    q, k, v, grad = (x.to(dtype).contiguous() for x in (q, k, v, grad))
    return [x.requires_grad_() for x in (q, k, v)], grad


def _calls(fn, inputs, grad):
    import torch

    q, k, v = inputs

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        fn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None

    return {"fwd": forward, "fwd_bwd": forward_backward}


def time_shape(shape, found: dict, dtype, device: str, rounds: int, inner: int) -> list[dict]:
    """Median ms of every method and pass at one shape, interleaved; a failing method gets a note."""
    import torch

    timer = common.Timer(device)
    calls, rows = {}, {}
    for name, (fn, layout) in found.items():
        row = rows[name] = {"part": "kernel", "method": name, "B": shape[0], "T": shape[1], "H": shape[2], "D": shape[3],
                            "dtype": str(dtype).split(".")[-1], "layout": layout}
        try:
            inputs, grad = _inputs(shape, layout, dtype, device, seed=hash(shape) % 1000)
            for key, call in _calls(fn, inputs, grad).items():
                start = time.perf_counter()
                call()  # warm-up: compilation, autotuning
                if device == "cuda":
                    torch.cuda.synchronize()
                row[f"first_{key}_s"] = time.perf_counter() - start  # Triton: compile and autotune included
                calls[name, key] = call
        except Exception as err:  # noqa: BLE001 - reported in the table, the other methods go on
            row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            if device == "cuda":
                torch.cuda.empty_cache()
    samples = {key: [] for key in calls}
    keys = list(calls)
    for r in range(rounds):
        order = keys[::-1] if r % 2 else keys
        for key in order:
            samples[key].append(timer(lambda key=key: [calls[key]() for _ in range(inner)]) / inner)
    for (name, key), s in samples.items():
        rows[name][f"{key}_ms"] = statistics.median(s) * 1e3
    return list(rows.values())


def kernel_profile(shape, fn, dtype, device: str, steps: int = 3) -> list[dict]:
    """Where one fwd+bwd of ``fn`` at ``shape`` spends its time, kernel by kernel (torch.profiler;
    on a CPU, the operators): ``{kernel, calls, ms}`` per step, the longest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    inputs, grad = _inputs(shape, "bthd", dtype, device, seed=3)
    step = _calls(fn, inputs, grad)["fwd_bwd"]
    step()  # compiled and tuned already, but its allocations are not profiled either
    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in events)
    rows = [{"part": "kernel_profile", "method": "ours", **dict(zip("BTHD", shape)), "kernel": e.key[:80],
             "calls": e.count / steps, "ms": own(e) / steps / 1e3, "share": own(e) / total} for e in events if own(e) > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:12]


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = common.median_seconds(lambda: dst.copy_(src), 10, 2, device)
    return 2 * n / seconds


def roofline(rows: list[dict], bandwidth: float) -> dict | None:
    """Our forward at :data:`ROOFLINE_SHAPE` against moving q, k, v in and out once at ``bandwidth``."""
    b, t, h, d = ROOFLINE_SHAPE
    row = next((r for r in rows if r["method"] == "ours" and (r["B"], r["T"], r["H"], r["D"]) == ROOFLINE_SHAPE
                and r.get("fwd_ms")), None)
    if row is None:
        return None
    floor_ms = 4 * b * t * h * d * 2 / bandwidth * 1e3  # bf16: read q, k, v, write out
    return {"part": "roofline", "method": "ours", "fwd_ms": row["fwd_ms"], "floor_ms": floor_ms,
            "bandwidth_gb_s": bandwidth / 1e9, "fraction": floor_ms / row["fwd_ms"]}


def agreement(found: dict, device: str) -> list[dict]:
    """Ours without a map against fla (the same function) and ours against float64 PyTorch, one
    small shape: normwise relative error of the forward."""
    import torch
    import torch.nn.functional as F

    shape = (2, 256, 4, 64) if device == "cuda" else (1, 24, 1, 8)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    (q, k, v), _ = _inputs(shape, "bthd", dtype, device, seed=11)
    phi_q, phi_k = (F.elu(x.double()) + 1 for x in (q, k))
    v64 = v.double()
    scores = torch.einsum("bthd,bshd->bhts", phi_q, phi_k).tril()
    want = torch.einsum("bhts,bshd->bthd", scores, v64) / (scores.sum(-1).transpose(1, 2).unsqueeze(-1) + 1e-6)
    with torch.no_grad():
        if "ours" in found:
            got = found["ours"][0](q, k, v).double()
            rows.append({"part": "agreement", "method": "ours vs float64 definition",
                         "rel_err": float((got - want).norm() / want.norm())})
        if "ours_nomap" in found and "fla" in found:
            a, b = found["ours_nomap"][0](q, k, v).double(), found["fla"][0](q, k, v).double()
            rows.append({"part": "agreement", "method": "ours_nomap vs fla (normalize, scale 1)",
                         "rel_err": float((a - b).norm() / b.norm())})
    return rows


def measure(device: str, budget, dry_run: bool) -> tuple[list[str], list[dict]]:
    """The kernel part: ``(summary lines, rows)``; rows of parts ``kernel``, ``roofline``, ``agreement``."""
    import torch

    found, missing = methods(device)
    for name, why in missing.items():
        budget.skipped.append(f"kernel method {name}: {why}")
    rows = budget.keep(agreement(found, device))
    grid = DRY_GRID if dry_run else GRID
    dtype = torch.float32 if dry_run else torch.bfloat16
    rounds, inner = (1, 1) if dry_run else (7, 3)
    bandwidth = copy_bandwidth(device)  # first: the roofline row needs it as soon as its shape is timed
    rows += budget.keep([{"part": "bandwidth", "method": "device copy", "bandwidth_gb_s": bandwidth / 1e9}])
    # fla last, beside ours, longest sequences first: its first call at a new shape autotunes for
    # 86-105 s on an H200 (unless an earlier run's autotune results were restored), so the grid
    # without it comes first and fla gets the shapes that fit
    without_fla = {name: entry for name, entry in found.items() if name != "fla"}
    for shape in sorted(grid, key=lambda s: s != ROOFLINE_SHAPE):  # the roofline's shape first
        if budget.allows(2 if dry_run else 12, f"kernel timings at {shape}"):
            rows += budget.keep(time_shape(shape, without_fla, dtype, device, rounds, inner))
            if shape == ROOFLINE_SHAPE and (top := roofline(rows, bandwidth)):
                rows += budget.keep([top])
            if "ours" in found and (shape == ROOFLINE_SHAPE or dry_run):  # which of our kernels the time goes to
                try:
                    rows += budget.keep(kernel_profile(shape, found["ours"][0], dtype, device))
                except Exception as err:  # noqa: BLE001 - a profiler that cannot run here: the table stays empty
                    budget.skipped.append(f"kernel profile at {shape}: {type(err).__name__}: {str(err)[:160]}")
    beside_fla = {name: found[name] for name in ("ours", "ours_nomap", "fla") if name in found}
    if "fla" in beside_fla:
        need = 2 if dry_run else FLA_FIRST_CALL_S[bool(os.environ.get(RESTORED_TUNING))]
        for shape in sorted(grid, key=lambda s: -s[1]):
            if budget.allows(need, f"fla beside ours at {shape}"):
                rows += budget.keep([{**r, "part": "kernel_fla"}
                                     for r in time_shape(shape, beside_fla, dtype, device, rounds, inner)])
    rows += budget.keep(tuning_rows())
    top = roofline(rows, bandwidth)
    summary = [f"kernel timings at {len([r for r in rows if r['part'] == 'kernel' and r['method'] == 'sdpa'])} shapes, "
               f"methods {', '.join(found)}"]
    if top:
        summary.append(f"roofline B2 T16384 H16 D128 fwd: {top['fraction']:.1%} of {top['bandwidth_gb_s']:.0f} GB/s")
    return summary, rows


def tuning_rows() -> list[dict]:
    """The Triton kernels' compilations so far (``launch.compile_report``; nothing is autotuned):
    kernel, key, config, seconds."""
    try:
        from linformer_lab.ops.cuda.triton_chunk import launch
    except ImportError:  # no triton: nothing was compiled
        return []
    return [{"part": "tuning", "method": t["kernel"], "key": str(t["key"]), "config": t["config"],
             "seconds": float(t["seconds"])} for t in launch.compile_report()]


def first_call_seconds(rows: list[dict], method: str = "ours") -> float:
    """Seconds the first calls of ``method`` took beyond their steady-state time, over every shape
    and pass: Triton's compilation and autotuning."""
    return sum(r.get(f"first_{key}_s", 0) - r.get(f"{key}_ms", 0) / 1e3 for r in rows
               if r["part"] == "kernel" and r["method"] == method for key in ("fwd", "fwd_bwd"))


def by_shape(rows: list[dict], part: str) -> dict:
    """``{(B, T, H, D): {method: row}}`` of one timing round: ``kernel`` (every method but fla)
    or ``kernel_fla`` (ours beside fla)."""
    out: dict = {}
    for r in rows:
        if r["part"] == part:
            out.setdefault((r["B"], r["T"], r["H"], r["D"]), {})[r["method"]] = r
    return out


def rounds_against(rows: list[dict]) -> Callable[[str], dict]:
    """``other -> {shape: {method: row}}``: the round a ratio of ours to ``other`` comes from (both
    timed in one interleaved round): ``kernel_fla`` for fla, ``kernel`` for the rest."""
    rounds = {part: by_shape(rows, part) for part in ROUND_NAMES}
    return lambda other: rounds["kernel_fla" if other == "fla" else "kernel"]


def ratio_rows(rows: list[dict]) -> list[list]:
    """Per shape: ours / other for each of :data:`RATIOS` (below 1: ours is faster), each ratio
    from one interleaved round (:func:`rounds_against`)."""
    against = rounds_against(rows)
    out = []
    for shape in sorted(set(against("sdpa")) | set(against("fla")), key=lambda s: (s[1], s)):
        cells = []
        for ours, other, key in RATIOS:
            m = against(other).get(shape, {})
            a, b = m.get(ours, {}).get(f"{key}_ms"), m.get(other, {}).get(f"{key}_ms")
            cells.append(common.fmt(a / b, 2) if a and b else "—")
        out.append(["×".join(map(str, shape)), *cells])
    return out


def report_lines(rows: list[dict]) -> list[str]:
    """Markdown of the kernel part: agreement, timings, ratios, roofline."""
    md = ["## Kernels: agreement (normwise relative error of the forward)", "",
          common.markdown_table(["check", "rel. error"], [[r["method"], f"{r['rel_err']:.2e}"] for r in rows
                                                         if r["part"] == "agreement"]), "",
          "## Kernels: median ms (interleaved rounds, CUDA events)", "",
          common.markdown_table(["round", "method", "B", "T", "H", "D", "dtype", "layout", "fwd", "fwd+bwd", "note"],
                                [[ROUND_NAMES[r["part"]], r["method"], r["B"], r["T"], r["H"], r["D"], r["dtype"], r["layout"],
                                  common.fmt(r.get("fwd_ms"), 3), common.fmt(r.get("fwd_bwd_ms"), 3), r.get("note", "")]
                                 for r in rows if r["part"] in ROUND_NAMES]), "",
          "## Kernels: ratios (time of ours / time of the other; below 1 ours is faster)", "",
          common.markdown_table(["B×T×H×D", *[f"{a}/{b} {k.replace('_', '+')}" for a, b, k in RATIOS]], ratio_rows(rows)), ""]
    md += ["## Kernels: first call (compilation and, for Triton, autotuning at each new shape), seconds", "",
           common.markdown_table(["method", "B×T×H×D", "fwd first", "fwd+bwd first", "fwd steady ms", "fwd+bwd steady ms"],
                                 [[r["method"], "×".join(str(r[k]) for k in "BTHD"), common.fmt(r.get("first_fwd_s"), 2),
                                   common.fmt(r.get("first_fwd_bwd_s"), 2), common.fmt(r.get("fwd_ms"), 3),
                                   common.fmt(r.get("fwd_bwd_ms"), 3)] for r in rows
                                  if r["part"] == "kernel" or (r["part"] == "kernel_fla" and r["method"] == "fla")]), "",
           f"First calls of ours, all shapes: {first_call_seconds(rows):.1f} s (the compile and autotune time, "
           "less the calls' own time).", ""]
    profiled = [r for r in rows if r["part"] == "kernel_profile"]
    md += ["## Kernels: where our fwd+bwd spends its time (torch.profiler, per step)", "",
           common.markdown_table(["B×T×H×D", "kernel", "calls", "ms", "share"],
                                 [["×".join(str(r[k]) for k in "BTHD"), r["kernel"], common.fmt(r["calls"], 1),
                                   common.fmt(r["ms"], 3), f"{r['share']:.0%}"]
                                  for r in profiled]), ""]
    tunings = [r for r in rows if r["part"] == "tuning"]
    md += ["## Kernels: autotuning (configs timed at each new key), seconds", "",
           common.markdown_table(["kernel", "key", "chosen config", "seconds"],
                                 [[r["method"], r["key"], r["config"], common.fmt(r["seconds"], 2)] for r in tunings]), "",
           f"Autotuning in all: {sum(r['seconds'] for r in tunings):.1f} s over {len(tunings)} keys.", ""]
    for r in rows:
        if r["part"] == "roofline":
            md += [f"Roofline: ours forward at B2 T16384 H16 D128 {r['fwd_ms']:.3f} ms against {r['floor_ms']:.3f} ms for "
                   f"reading q, k, v and writing the output once at the measured copy bandwidth "
                   f"({r['bandwidth_gb_s']:.0f} GB/s): **{r['fraction']:.1%}** of the roofline.", ""]
    return md
