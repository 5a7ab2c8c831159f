"""The causal linear-attention *layer* on CPU against its bare kernel (issue #45): forward+backward of
``LinearAttention(causal=True)`` (elu + 1) before and after the fused C++ kernel, the numerator
kernel alone, and fast-transformers 0.4.0's ``CausalLinearAttention`` layer, fp32, timed
interleaved in one process (1 thread by default).

* ``layer after``: the layer as it runs now: the ``cpp`` candidate of the ``causal_attention`` op
  (``ops/cpu/causal_recurrence.cpp``'s ``attention_forward`` / ``attention_backward``: phi, the
  numerator and the normaliser in one forward and one backward);
* ``layer before``: the same layer with ``LINFORMER_LAB_KERNELS=causal_attention=reference``, the
  path before the fused kernel: the elu map, the recurrence for the numerator and the normaliser
  in PyTorch (cumsum, product, division) and their gradients;
* ``kernel``: the bare numerator (``cpu_kernel.causal_dot_product``) on feature-mapped q, k, what the
  layer must stay within 1.3x of;
* ``FT layer``: fast-transformers' layer with its own elu feature map, on its layout (B, N, H, D),
  with its full-length mask objects (no padding).

Shapes: the six of issue #23 and the grid of ``causal_cpu_grid.py`` (D = M in {16, 32, 64, 128} x
B*H in {1, 8, 64, 512} x N in {256, 4096, 65536}), less those with more than ``--max-elements``
numbers per input tensor (listed as skipped); ``--quick``: the quick grid (the six and eight
small ones).

fast-transformers lives in a separate venv (benchmarks/README.md, "fast-transformers baseline
venv"); without it the others still run::

    PYTHONPATH=. .bench_env/bin/python benchmarks/dev/causal_cpu_layer.py [--quick]

Results: ``benchmarks/dev/results/causal_cpu_layer{_quick}{tag}.{csv,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402
from causal_cpu_grid import _ft_version, _lscpu_model, grid_shapes, parse_shape  # noqa: E402

RESULTS = str(common.results_dir(__file__))


@contextlib.contextmanager
def switched(value: str):
    """``LINFORMER_LAB_KERNELS=value`` within the block (the dispatch reads it at every selection)."""
    from linformer_lab.ops import kernels

    before = os.environ.get(kernels.SWITCH)
    os.environ[kernels.SWITCH] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[kernels.SWITCH]
        else:
            os.environ[kernels.SWITCH] = before


def ft_layer(torch, d: int):
    """fast-transformers' causal layer and its mask objects' makers, or None where it is not installed."""
    try:
        from fast_transformers.attention.causal_linear_attention import CausalLinearAttention
        from fast_transformers.masking import LengthMask, TriangularCausalMask
    except ImportError:
        return None
    layer = CausalLinearAttention(d)
    return lambda q, k, v: layer(q, k, v, TriangularCausalMask(q.shape[1]),
                                 LengthMask(torch.full((q.shape[0],), q.shape[1], dtype=torch.long)),
                                 LengthMask(torch.full((q.shape[0],), q.shape[1], dtype=torch.long)))


def measure(torch, shape, args) -> dict:
    from linformer_lab.attention.linear import LinearAttention
    from linformer_lab.ops.linear_attention import cpu_kernel

    b, h, n, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=gen)
    # the bare kernel's inputs: feature-mapped, as the numerator sees them
    phi_q, phi_k = ((torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen)) + 1).requires_grad_()
                    for _ in range(2))
    layer = LinearAttention(causal=True, query_dim=d)
    cases = {
        "kernel": common.forward_backward(lambda: cpu_kernel.causal_dot_product(phi_q, phi_k, v), (phi_q, phi_k, v), grad),
        "layer_after": common.forward_backward(lambda: layer(q, k, v), (q, k, v), grad),
        "layer_before": common.forward_backward(lambda: layer(q, k, v), (q, k, v), grad,
                                                lambda: switched("causal_attention=reference")),
    }
    ft = ft_layer(torch, d)
    if ft is not None:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        grad_t = grad.transpose(1, 2).contiguous()
        cases["ft_layer"] = common.forward_backward(lambda: ft(qt, kt, vt), (qt, kt, vt), grad_t)
    round_s = common.Timer()(lambda: [fn() for fn in cases.values()])  # a warm-up round, timed to size the rest
    repeats = max(3, min(args.repeats, int(args.budget / max(round_s, 1e-6))))
    times = common.interleaved_medians(cases, repeats, warmup=0, budget_s=args.budget)
    row = {"B": b, "H": h, "N": n, "D": d, "repeats": len(next(iter(times.values()))["samples"]),
           "loadavg_1min": round(os.getloadavg()[0], 2)}
    for name, t in times.items():
        row[f"{name}_ms"] = round(t["median"] * 1e3, 3)
    ms = {name: t["median"] for name, t in times.items()}
    row["after_over_kernel"] = round(ms["layer_after"] / ms["kernel"], 3)
    row["before_over_kernel"] = round(ms["layer_before"] / ms["kernel"], 3)
    row["before_over_after"] = round(ms["layer_before"] / ms["layer_after"], 3)
    if "ft_layer" in ms:
        row["ft_over_after"] = round(ms["ft_layer"] / ms["layer_after"], 3)
        row["ft_over_before"] = round(ms["ft_layer"] / ms["layer_before"], 3)
    return row


def summary(rows, key: str) -> str:
    values = sorted(r[key] for r in rows if key in r)
    if not values:
        return "—"
    return f"min {values[0]:.2f}, median {values[len(values) // 2]:.2f}, max {values[-1]:.2f}"


def write_report(args, rows, skipped, env, path_md) -> str:
    lines = [
        "# Causal linear-attention layer on CPU: fused kernel vs the path before it vs the bare kernel vs "
        "fast-transformers' layer",
        "",
        f"Generated by `{env['command']}` on {env['date']}.",
        "",
        f"- Machine: {env['cpu']} ({env['logical_cpus']} logical CPUs), {env['threads']} torch threads, "
        f"Python {env['python']}, torch {env['torch']}, fast-transformers {env['fast_transformers']}, kernel loops "
        f"for {env['isa']}.",
        f"- Load average at the start {env['load_start']}, at the end {env['load_end']} (1 / 5 / 15 min): the "
        "machine was shared; the implementations are timed interleaved (rounds A B C D, D C B A, ...), so the "
        "ratios hold where the absolute times drift.",
        "- Forward+backward, fp32, D = M, median ms. Layer after: `LinearAttention(causal=True)` (elu + 1) on the "
        "fused C++ kernel; layer before: the same layer with `LINFORMER_LAB_KERNELS=causal_attention=reference` "
        "(elu map, the recurrence for the numerator, the normaliser in PyTorch); kernel: the bare numerator on "
        "feature-mapped q, k; FT layer: fast-transformers' `CausalLinearAttention` (its elu map and normaliser, "
        "layout B N H D).",
        "",
    ]
    header = ["B", "H", "N", "D", "kernel ms", "layer after ms", "layer before ms", "FT layer ms", "after / kernel",
              "before / kernel", "before / after", "FT / after", "load"]
    table = [[r["B"], r["H"], r["N"], r["D"], common.fmt(r.get("kernel_ms"), 2), common.fmt(r.get("layer_after_ms"), 2),
              common.fmt(r.get("layer_before_ms"), 2), common.fmt(r.get("ft_layer_ms"), 2),
              common.fmt(r.get("after_over_kernel"), 2), common.fmt(r.get("before_over_kernel"), 2),
              common.fmt(r.get("before_over_after"), 2), common.fmt(r.get("ft_over_after"), 2), r["loadavg_1min"]]
             for r in rows]
    lines.append(common.markdown_table(header, table))
    lines += ["", f"Layer after / kernel: {summary(rows, 'after_over_kernel')} over {len(rows)} shapes "
                  f"(the issue's bound: 1.3); above 1.3: "
                  + (", ".join(f"{r['B']}x{r['H']}x{r['N']}x{r['D']} ({r['after_over_kernel']:.2f})"
                               for r in rows if r["after_over_kernel"] > 1.3) or "none") + ".",
              "", f"Layer before / kernel: {summary(rows, 'before_over_kernel')}.",
              "", f"Layer before / layer after (the fused kernel's gain): {summary(rows, 'before_over_after')}.",
              "", f"FT layer / layer after: {summary(rows, 'ft_over_after')}; FT layer / layer before: "
                  f"{summary(rows, 'ft_over_before')}."]
    if skipped:
        shapes = ", ".join("x".join(map(str, s)) for s in skipped)
        lines += ["", f"Not run (B x H x N x D; over {args.max_elements:,} numbers per input tensor): {shapes}."]
    Path(path_md).write_text("\n".join(lines) + "\n")
    return Path(path_md).read_text()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick grid of causal_cpu_grid.py: the issue's six shapes "
                   "and eight of D = 16, 64 x B*H = 1, 64 x N = 256, 4096")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="BxHxNxD", help="only these shapes")
    p.add_argument("--max-elements", type=int, default=1 << 22, help="numbers per input tensor above which a shape "
                   "is not run (default 2^22: at one thread the larger ones take minutes each)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7, help="most timed rounds per shape")
    p.add_argument("--budget", type=float, default=4.0, help="seconds of timed rounds per shape (3 rounds at least)")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from linformer_lab.ops import cpu

    torch.set_num_threads(args.threads)
    machine = common.machine_info()
    env = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cpu": _lscpu_model() or machine["cpu"], "logical_cpus": machine["logical_cpus"],
           "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "fast_transformers": _ft_version(), "isa": cpu.CAUSAL_RECURRENCE.load().instruction_set(),
           "load_start": " / ".join(f"{x:.2f}" for x in os.getloadavg())}
    shapes, skipped = grid_shapes(args)
    rows = []
    for shape in shapes:
        row = measure(torch, shape, args)
        rows.append(row)
        print(row, flush=True)
    env["load_end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    suffix = ("_quick" if args.quick else "") + args.tag
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, f"causal_cpu_layer{suffix}.csv"), rows)
    print(write_report(args, rows, skipped, env, os.path.join(args.out, f"causal_cpu_layer{suffix}.md")))


if __name__ == "__main__":
    main()
