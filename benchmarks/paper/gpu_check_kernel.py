"""The GPU kernel benchmark: causal attention kernels against kernels, forward and forward+backward,
on the grid of the project's GPU issue, bf16, interleaved; where our fwd+bwd spends its time,
kernel by kernel, and how many kernels it launches; the HBM roofline fraction of our forward at
B2 T16384 H16 D128. The kernel part of ``gpu_check.py``, which also runs it alone (``--parts kernel``).

Methods, each on inputs already in its own layout (the layout change is not timed):

* ``ours``: ``linformer_lab.ops.cuda.triton_chunk.chunk_linear_attention`` on contiguous
  ``(B, T, H, D)`` (``head_first=False``), elu + 1 and the normaliser fused;
* ``ours_prev``: the same kernel at an earlier revision (``gpu_check.py --export-previous REV``
  writes it into the cache folder; ``gpu_check_cache.previous_kernel``), called through its launch
  functions under a plain ``autograd.Function``: without the ``torch.library`` operator layer of
  ``ours`` (its operators would clash with the working tree's), so at host-bound shapes it is
  charged a little less host time than ``ours``;
* ``ours_nomap``: ``ours`` with ``feature_map=None`` (inputs taken as mapped), fla's function;
* ``fla``: flash-linear-attention's ``chunk_linear_attn(normalize=True, scale=1)`` on contiguous
  ``(B, T, H, D)``, its own layout (its normaliser is a separate PyTorch pass);
* ``cuda_old``: the ``.cu`` numerator kernel (``ops.cuda.causal_dot_product``) with elu and the
  normaliser in PyTorch, ``(B, H, T, D)``, as the module ran it before;
* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` (FlashAttention), ``(B, H, T, D)``.

Each cell is the median over rounds of CUDA-event times, the methods of a round interleaved
(A B C, C B A, ...). Three rounds (:data:`ROUNDS`), each a comparison of its own, in the order of
what they decide: ours beside its previous revision and SDPA over the whole grid (the 10 % rule
applied to what this run shows), the roofline shape first; ours beside fla, longest sequences
first, at the shapes the budget still holds (fla's first call at a new shape autotunes for
minutes without an earlier run's Triton cache); ours beside the ``.cu`` numerator, once its build
(started by ``gpu_check.py`` beside this part) is done, shortest sequences first (where launch costs
weigh most: the shapes that decide whether the ``.cu`` goes) and at :data:`CU_SHAPE_S` a shape.
``--dry-run`` runs the same code on the CPU at toy sizes in fp32, with Triton's interpreter for
ours (``TRITON_INTERPRET=1``, set before Triton is imported).

    PYTHONPATH=. python3 benchmarks/paper/gpu_check.py --parts kernel --out DIR [--budget-s 200]
    uv run python benchmarks/paper/gpu_check.py --parts kernel --dry-run --out DIR
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402
import gpu_check_cache  # noqa: E402

#: (B, T, H, D) of the issue's grid; the last two are the MNIST model's attention.
GRID = [(8, 1024, 8, 64), (4, 2048, 16, 128), (4, 4096, 64, 128), (1, 8192, 96, 128), (2, 16384, 16, 128),
        (10, 784, 8, 32), (64, 784, 8, 32)]
DRY_GRID = [(1, 32, 1, 16)]
ROOFLINE_SHAPE = (2, 16384, 16, 128)
#: Seconds planned for fla's first forward and first forward+backward at the first new shape,
#: without autotune results in Triton's cache (an H200 with fla 0.6: 70 s at B8 T1024, 98 s at B2
#: T16384) and with them (not yet measured); each later shape plans what the one before took.
FLA_FIRST_CALL_S = {False: 110, True: 25}
#: Seconds planned per shape of a round without fla: the first calls of ours at a new width
#: (compilation; the previous revision also autotunes: 13.2 s over two widths on an H200) and 7
#: rounds of 3 calls of each method (at most ~0.2 s each at the grid's largest shapes).
SHAPE_S = 12
#: Seconds planned per shape of the ``.cu`` round: two methods already compiled and built, 21 calls
#: of each pass; estimated, not measured, from the ``.cu``'s 10.5 / 26 ms fwd / fwd+bwd at B2 T16384
#: H16 D128 on an H200 (issue 53): about 1 s there, 2 s at the grid's largest (B4 T4096 H64 D128),
#: so that what fla's round leaves covers the grid.
CU_SHAPE_S = 5
#: The interleaved timing rounds in the order they run: the methods each times together (those
#: found here), and its name in the report.
ROUNDS = {"kernel": ("ours", "ours_prev", "sdpa"), "kernel_fla": ("ours", "ours_nomap", "fla"),
          "kernel_cu": ("ours", "cuda_old")}
ROUND_NAMES = {"kernel": "beside the previous revision, SDPA", "kernel_fla": "beside fla",
               "kernel_cu": "beside the .cu numerator"}
#: the comparisons of the issue's targets and of the 10 % rule: (ours, against, pass)
RATIOS = (("ours", "ours_prev", "fwd_bwd"), ("ours", "fla", "fwd_bwd"), ("ours_nomap", "fla", "fwd_bwd"),
          ("ours", "sdpa", "fwd_bwd"), ("ours", "cuda_old", "fwd_bwd"), ("ours", "ours_prev", "fwd"),
          ("ours", "fla", "fwd"), ("ours", "sdpa", "fwd"))
#: Where the orchestrator's builds of the compiled extensions report they are done (in the work folder).
PREBUILD_FILE = "prebuild.json"


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


def methods(device: str, previous: Path | None = None) -> tuple[dict, dict]:
    """``({name: (fn(q, k, v), layout)}, {name: why not})``; layout ``"bthd"`` or ``"bhtd"``.
    ``previous``: the folder of an exported earlier revision of our kernel (``ours_prev``). The
    ``.cu`` numerator is not among them: :func:`cuda_numerator` loads it once it is built."""
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
    if "ours" in found and previous is not None and (Path(previous) / "__init__.py").is_file():
        try:
            found["ours_prev"] = (gpu_check_cache.previous_kernel(Path(previous))[0], "bthd")
        except Exception as err:  # noqa: BLE001 - an export that does not load: reported, the others go on
            missing["ours_prev"] = f"the exported kernel in {Path(previous).name} does not load: {type(err).__name__}: {err}"
    elif "ours" in found:
        missing["ours_prev"] = "no earlier revision exported (gpu_check.py --export-previous REV, then --cache)"
    if device == "cuda":
        fla, why = _fla()
        if fla is None:
            missing["fla"] = why
        else:
            found["fla"] = (fla, "bthd")
    else:
        missing["fla"] = missing["cuda_old"] = "needs a CUDA GPU (dry run)"
    found["sdpa"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "bhtd")
    return found, missing


def cuda_numerator(device: str, work: Path | None, budget) -> tuple | None:
    """The ``.cu`` numerator as a method ``(fn, "bhtd")``, once ``gpu_check.py``'s build of it is done
    (waited for within the budget; building it here too would race that build), or None with the
    reason among the budget's skips (a CPU's: :func:`methods` gave it)."""
    import torch
    import torch.nn.functional as F

    from linformer_lab.ops import cuda as cuda_ops

    if device != "cuda":
        return None
    if not cuda_ops.is_available():
        budget.skipped.append("kernel method cuda_old: linear_cuda cannot be built here (no nvcc or GPU)")
        return None
    done = Path(work or ".") / PREBUILD_FILE
    while not done.exists() and budget.left() > SHAPE_S:
        time.sleep(1)
    if not done.exists():
        budget.skipped.append("kernel method cuda_old: its build was not done within the part's budget")
        return None
    try:
        cuda_ops.load()  # built: loaded from the build cache
    except RuntimeError as err:
        budget.skipped.append(f"kernel method cuda_old: {str(err)[:200]}")
        return None

    def cuda_old(q, k, v, eps=1e-6):
        phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
        numerator = cuda_ops.causal_dot_product(phi_q, phi_k, v)
        den = torch.einsum("bhtd,bhtd->bht", phi_q.float(), phi_k.float().cumsum(2))
        return (numerator.float() / (den.unsqueeze(-1) + eps)).to(v.dtype)

    return cuda_old, "bhtd"


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


def time_shape(shape, found: dict, dtype, device: str, rounds: int, inner: int, part: str = "kernel") -> list[dict]:
    """Median ms of every method and pass at one shape, interleaved (rows of ``part``, the round);
    a failing method gets a note."""
    import torch

    timer = common.Timer(device)
    calls, rows = {}, {}
    for name, (fn, layout) in found.items():
        row = rows[name] = {"part": part, "method": name, "B": shape[0], "T": shape[1], "H": shape[2], "D": shape[3],
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


def kernel_profile(shape, fn, dtype, device: str, method: str = "ours", steps: int = 3) -> list[dict]:
    """Where one fwd+bwd of ``fn`` at ``shape`` spends its time, kernel by kernel (torch.profiler;
    on a CPU, the operators): ``{kernel, calls, ms, share}`` per step, the longest 12 first; then a
    row of part ``launches``: the kernels (on a CPU, operators) one forward and one backward run."""
    inputs, grad = _inputs(shape, "bthd", dtype, device, seed=3)
    calls = _calls(fn, inputs, grad)
    calls["fwd_bwd"]()  # compiled and tuned already, but its allocations are not profiled either
    counts, rows = {}, []
    for key in ("fwd", "fwd_bwd"):
        events, own = _profile(calls[key], device, steps)
        counts[key] = sum(e.count for e in events) / steps
        total = sum(own(e) for e in events)
        rows = [{"part": "kernel_profile", "method": method, **dict(zip("BTHD", shape)), "kernel": e.key[:80],
                 "calls": e.count / steps, "ms": own(e) / steps / 1e3, "share": own(e) / total}
                for e in events if own(e) > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:12] + [
        {"part": "launches", "method": method, **dict(zip("BTHD", shape)), "fwd": counts["fwd"],
         "bwd": counts["fwd_bwd"] - counts["fwd"], "unit": "kernels" if device == "cuda" else "operators"}]


def _profile(call, device: str, steps: int):
    """``(events, own time of an event)`` of ``steps`` calls: the GPU's kernels, or a CPU's operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    return [e for e in prof.key_averages() if e.device_type == kind], own


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
    """One small shape, normwise relative errors: ours and its previous revision against float64
    PyTorch (forward), the previous revision against ours (forward, and the largest of the three
    gradients'), ours without a map against fla (the same function)."""
    import torch
    import torch.nn.functional as F

    # on a CPU, chunks of both revisions' kernels (64 positions) and several super-chunks
    shape = (2, 256, 4, 64) if device == "cuda" else (1, 136, 2, 8)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    (q, k, v), grad = _inputs(shape, "bthd", dtype, device, seed=11)
    phi_q, phi_k = (F.elu(x.double()) + 1 for x in (q, k))
    scores = torch.einsum("bthd,bshd->bhts", phi_q, phi_k).tril()
    want = torch.einsum("bhts,bshd->bthd", scores, v.double()) / (scores.sum(-1).transpose(1, 2).unsqueeze(-1) + 1e-6)

    def error(got, reference):
        got, reference = got.detach().double(), reference.detach().double()
        return float((got - reference).norm() / reference.norm())

    with torch.no_grad():
        for name in ("ours", "ours_prev"):
            if name in found:
                rows.append({"part": "agreement", "method": f"{name} vs float64 definition",
                             "rel_err": error(found[name][0](q, k, v), want)})
        if "ours_nomap" in found and "fla" in found:
            rows.append({"part": "agreement", "method": "ours_nomap vs fla (normalize, scale 1)",
                         "rel_err": error(found["ours_nomap"][0](q, k, v), found["fla"][0](q, k, v))})
    if "ours" in found and "ours_prev" in found:
        out, grads = {}, {}
        for name in ("ours", "ours_prev"):
            out[name] = found[name][0](q, k, v)
            grads[name] = torch.autograd.grad(out[name], (q, k, v), grad)
        rows.append({"part": "agreement", "method": "ours_prev vs ours", "rel_err": error(out["ours_prev"], out["ours"])})
        rows.append({"part": "agreement", "method": "ours_prev vs ours, gradients of q, k, v (the largest)",
                     "rel_err": max(error(a, b) for a, b in zip(grads["ours_prev"], grads["ours"]))})
    return rows


def measure(device: str, budget, dry_run: bool, work: Path | None = None,
            previous: Path | None = None) -> tuple[list[str], list[dict]]:
    """The kernel part: ``(summary lines, rows)``; rows of parts ``agreement``, ``previous``,
    ``bandwidth``, the rounds of :data:`ROUNDS`, ``roofline``, ``kernel_profile``, ``launches``,
    ``compile``. ``work``: the folder of ``gpu_check.py``'s builds (:data:`PREBUILD_FILE`);
    ``previous``: an exported earlier revision of our kernel."""
    import torch

    found, missing = methods(device, previous)
    for name, why in missing.items():
        budget.skipped.append(f"kernel method {name}: {why}")
    rows = budget.keep(agreement(found, device))
    if "ours_prev" in found and previous is not None:
        rows += budget.keep([{"part": "previous", "method": "ours_prev",
                              "revision": gpu_check_cache.exported_revision(previous)}])
    grid = DRY_GRID if dry_run else GRID
    dtype = torch.float32 if dry_run else torch.bfloat16
    rounds, inner = (1, 1) if dry_run else (7, 3)
    # profiled steps per pass: a dry run's only show that the rows come (each interpreted step costs ~0.5 s)
    profile_steps = 1 if dry_run else 3
    bandwidth = copy_bandwidth(device)  # first: the roofline row needs it as soon as its shape is timed
    rows += budget.keep([{"part": "bandwidth", "method": "device copy", "bandwidth_gb_s": bandwidth / 1e9}])

    compiled = set()  # compile rows kept so far: after each round, the new ones (a part stopped later keeps them)

    def run_round(part, members, shapes, need, profiled=()):
        nonlocal rows
        members = {name: entry for name, entry in members.items() if name in ROUNDS[part]}
        for shape in shapes:
            if not budget.allows(2 if dry_run else need, f"{ROUND_NAMES[part]}: timings at {shape}"):
                continue
            got = budget.keep(time_shape(shape, members, dtype, device, rounds, inner, part))
            rows += got
            if part == "kernel" and shape == ROOFLINE_SHAPE and (top := roofline(rows, bandwidth)):
                rows += budget.keep([top])
            for name in profiled if shape == ROOFLINE_SHAPE or dry_run else ():  # which kernels the time goes to
                if name in members:
                    try:
                        rows += budget.keep(kernel_profile(shape, members[name][0], dtype, device, name, profile_steps))
                    except Exception as err:  # noqa: BLE001 - a profiler that cannot run here: no rows
                        budget.skipped.append(f"kernel profile of {name} at {shape}: {type(err).__name__}: {str(err)[:160]}")
            # fla's first call at the next shape: planned at what it took at this one
            first = [r.get("first_fwd_s", 0) + r.get("first_fwd_bwd_s", 0) for r in got if r["method"] == "fla"]
            need = max(first[0] + SHAPE_S, SHAPE_S) if first and first[0] else need
        new = [r for r in compile_rows() if tuple(r.values()) not in compiled]
        compiled.update(tuple(r.values()) for r in new)
        rows += budget.keep(new)

    # every method but fla and the .cu numerator, the roofline's shape first: nothing here waits
    # on a compiler for long, so the whole grid comes before fla's first calls
    run_round("kernel", found, sorted(grid, key=lambda s: s != ROOFLINE_SHAPE), SHAPE_S, ("ours", "ours_prev"))
    if "fla" in found:  # longest sequences first: fla's first call at a new shape may autotune for minutes
        run_round("kernel_fla", found, sorted(grid, key=lambda s: -s[1]),
                  FLA_FIRST_CALL_S[gpu_check_cache.autotune_results() > 0], ("fla",))
    if "ours" in found and (numerator := cuda_numerator(device, work, budget)):
        run_round("kernel_cu", {**found, "cuda_old": numerator}, sorted(grid, key=lambda s: s[1]), CU_SHAPE_S)
    top = roofline(rows, bandwidth)
    summary = [f"kernel timings at {len([r for r in rows if r['part'] == 'kernel' and r['method'] == 'sdpa'])} shapes, "
               f"methods {', '.join(found)}"]
    if top:
        summary.append(f"roofline B2 T16384 H16 D128 fwd: {top['fraction']:.1%} of {top['bandwidth_gb_s']:.0f} GB/s")
    return summary, rows


def compile_rows() -> list[dict]:
    """Our kernels' compilations in this process (``launch.compile_report``: each kernel's first
    launch at a specialisation; nothing is autotuned) and those of the previous revision's
    (its ``tuning_report`` where it autotuned): method, kernel, key, config, seconds."""
    try:
        from linformer_lab.ops.cuda.triton_chunk import launch
    except ImportError:  # no triton: nothing was compiled
        return []
    previous = sys.modules.get(f"{gpu_check_cache.PREVIOUS_PACKAGE}.launch")
    reports = {"ours": launch.compile_report()}
    if previous is not None:
        reports["ours_prev"] = (getattr(previous, "compile_report", None) or previous.tuning_report)()
    return [{"part": "compile", "method": method, "kernel": t["kernel"], "key": str(t["key"]), "config": t["config"],
             "seconds": float(t["seconds"])} for method, report in reports.items() for t in report]
