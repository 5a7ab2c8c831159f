"""Speed of the linear_cuda kernel (causal linear attention numerator, paper eq. 9) on a GPU.

Compares, for forward and forward+backward, at D = M = 64:

* ``linear_cuda``  -- linformer_lab.ops.cuda.causal_dot_product (this repository's CUDA kernel)
* ``linear_torch`` -- linformer_lab.ops.linear_attention.causal_dot_product (pure PyTorch)
* ``sdpa``         -- torch.nn.functional.scaled_dot_product_attention(is_causal=True), i.e.
                      softmax attention with FlashAttention / memory-efficient kernels
* ``fla``          -- flash-linear-attention's chunk_linear_attn(normalize=True), if installed

Each cell is the median of --repeats timed runs (CUDA events, after --warmup runs); a cell is
"OOM" when the method ran out of memory and "-" when it is not available. Results are printed as a
markdown table and written to benchmarks/paper/results/linear_cuda_<device>.{csv,md}.

    uv run python benchmarks/paper/bench_linear_cuda.py            # full grid
    uv run python benchmarks/paper/bench_linear_cuda.py --quick    # N <= 4096, fewer repeats
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (benchmarks/common.py: CSV and markdown writers shared by the benchmarks)

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _linear_cuda():
    from linformer_lab.ops import cuda

    cuda.load(verbose=True)  # build (if needed) before timing anything
    return lambda q, k, v: cuda.causal_dot_product(q, k, v)


def _linear_torch():
    try:
        from linformer_lab.ops.linear_attention import causal_dot_product
    except ImportError as err:
        return None, f"linformer_lab.ops.linear_attention not importable ({err})"
    return causal_dot_product, None


def _sdpa():
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fla():
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError as err:
        return None, f"flash-linear-attention not installed ({err.name or err})"
    params = inspect.signature(chunk_linear_attn).parameters
    if "head_first" in params:  # older releases: (B, H, T, K) with head_first=True
        return (lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, normalize=True, head_first=True)[0]), None

    # Newer releases take (B, T, H, K); the layout change is done outside the timed region by
    # prepare() below, so only the kernel is timed.
    def run(q, k, v):
        return chunk_linear_attn(q, k, v, scale=1.0, normalize=True)[0]

    run.seq_major = True  # type: ignore[attr-defined]
    return run, None


def measure(method, b, h, n, d, dtype, backward: bool, warmup: int, repeats: int):
    """(median ms, peak extra memory in MiB) of one method, or a string saying why not."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Feature-mapped inputs: positive q, k scaled so the numerator stays in range for fp16/bf16.
    q = torch.rand(b, h, n, d, device="cuda", generator=gen).div_(d).to(dtype)
    k = torch.rand(b, h, n, d, device="cuda", generator=gen).div_(n).to(dtype)
    v = torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype)
    if getattr(method, "seq_major", False):
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    grad = torch.randn_like(v) if backward else None

    def step():
        out = method(q, k, v)
        if backward:
            out.backward(grad)
            q.grad = k.grad = v.grad = None

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        ms = common.median_seconds(step, repeats, warmup, device="cuda") * 1e3
    except torch.cuda.OutOfMemoryError:
        return "OOM", None
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:  # e.g. a dtype it lacks
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        return "error: " + first_line[:80].replace("|", "/"), None
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--bh", nargs="+", default=["8x8", "1x16"], help="batch x heads pairs")
    parser.add_argument("--dim", type=int, default=64, help="D = M")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="N <= 4096, 5 repeats")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "bench_linear_cuda.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to do.",
            file=sys.stderr,
        )
        return 1
    if args.quick:
        args.n = [n for n in args.n if n <= 4096]
        args.repeats = 5

    methods: dict[str, object] = {"linear_cuda": _linear_cuda()}
    notes = []
    for name, factory in (("linear_torch", _linear_torch), ("fla", _fla)):
        fn, why = factory()
        methods[name] = fn
        if why:
            notes.append(f"`{name}` column skipped: {why}.")
    methods["sdpa"] = _sdpa()
    names = list(methods)

    device = torch.cuda.get_device_name()
    rows = []
    header = ["B", "H", "N", "dtype", "pass"] + [f"{m} ms" for m in names] + ["linear_cuda peak MiB"]
    print(f"# linear_cuda benchmark on {device}, D = M = {args.dim}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    table = []
    for bh in args.bh:
        b, h = (int(x) for x in bh.lower().split("x"))
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for n in args.n:
                for backward in (False, True):
                    pass_name = "fwd+bwd" if backward else "fwd"
                    cells, peak_cuda = [], None
                    for name in names:
                        fn = methods[name]
                        if fn is None:
                            result, peak = "-", None
                        else:
                            result, peak = measure(fn, b, h, n, args.dim, dtype, backward, args.warmup, args.repeats)
                        if name == "linear_cuda":
                            peak_cuda = peak
                        rows.append(
                            {
                                "device": device,
                                "B": b,
                                "H": h,
                                "N": n,
                                "D": args.dim,
                                "M": args.dim,
                                "dtype": dtype_name,
                                "pass": pass_name,
                                "method": name,
                                "median_ms": f"{result:.4f}" if isinstance(result, float) else result,
                                "peak_extra_mib": f"{peak:.1f}" if peak is not None else "",
                            }
                        )
                        cells.append(f"{result:.3f}" if isinstance(result, float) else result)
                        torch.cuda.empty_cache()
                    line = [str(b), str(h), str(n), dtype_name, pass_name] + cells
                    line.append(f"{peak_cuda:.0f}" if peak_cuda is not None else "")
                    table.append(line)
                    print("| " + " | ".join(line) + " |", flush=True)
    for note in notes:
        print(f"\n{note}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / ("linear_cuda_" + re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_"))
    common.write_csv(str(stem.with_suffix(".csv")), rows)
    md = [
        f"# linear_cuda benchmark: {device}",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"D = M = {args.dim}, median of {args.repeats} runs after {args.warmup} warm-up runs (CUDA events). "
        "`linear_*` compute the causal numerator of eq. 9 only; `fla` includes its normaliser; `sdpa` is "
        "causal softmax attention. Peak MiB: extra GPU memory allocated during the linear_cuda runs.",
        "",
        common.markdown_table(header, table),
        "",
        *notes,
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(md))
    print(f"\nwrote {stem.with_suffix('.csv')} and {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
