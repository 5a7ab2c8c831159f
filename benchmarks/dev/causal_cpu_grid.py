"""Causal linear attention on CPU from feature-mapped q, k, head-to-head over a grid of shapes (issue
#23), forward+backward, fp32, 2 threads, timed interleaved in one process:

* ``kernel``: our fused C++ kernel (``ops/cpu/causal_recurrence.cpp``, the ``cpp`` candidate of the
  ``causal_attention`` op that ``linformer_lab/ops/kernels.py`` selects on CPU), given phi(q), phi(k)
  through an identity map: the numerator and the normaliser in one forward and one backward pass;
* ``chunk``: our pure-PyTorch chunked numerator (``linformer_lab.ops.linear_attention.chunk``), then
  the normaliser in PyTorch (:func:`normalised`: a cumsum of phi(k), a product, a division);
* ``fast_transformers``: fast-transformers 0.4.0's CPU numerator kernel, then the same PyTorch normaliser
  (it has no fused one).

Shapes: D = M in {16, 32, 64, 128} x B*H in {1, 8, 64, 512} (B = B*H / 8 with H = 8, or
B = H = 1) x N in {256, 4096, 65536}, less those with more than ``--max-elements`` numbers
per input tensor (memory and time: each is listed as skipped), plus the six shapes of the issue.

Also measured: the machine's fp32 GEMM rate (``torch.mm`` of two square matrices, same
threads), and per shape the kernel's FLOP rate as a fraction of it: 16 C M per position and row
(per pass a rank-1 update of a state and its product with one vector, 4 C M, for the forward and
the three backward passes: grad q, grad v, grad k; the normaliser's O(C + M) left out), and its
share of the memory bandwidth. fast-transformers' numerator does 14 C M per position.

fast-transformers lives in a separate venv (benchmarks/README.md, "fast-transformers baseline
venv"); without it the others still run. This is the project's one comparison with
fast-transformers::

    PYTHONPATH=. .bench_env/bin/python benchmarks/dev/causal_cpu_grid.py [--quick]

Before / after a change to causal_recurrence.cpp, in one run: ``--before-revision REV`` builds
the source (and the headers beside it) as at git revision REV under another module name, and
times it as "kernel before" (REV must have the fused attention, ``attention_forward``). Where that
source and its headers equal the working tree's, the current build serves for both (one build, not
two: an A/A run times one library in both slots).

Feature maps: per shape also the whole causal ``linear`` attention (feature map, numerator,
normaliser; fwd+bwd from unmapped q, k) with each map of ``--feature-maps`` (default: every
built-in map), timed in the same interleaved rounds, as ms and as a ratio to elu + 1: what a map
beyond the paper costs. A map whose features ``(B, H, N, C)`` hold more than ``--max-elements``
numbers is left out at that shape (taylor and rebased have C ~ D^2 / 2).

Results: ``benchmarks/dev/results/causal_linear_cpu_grid{_quick}{tag}.{csv,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402

RESULTS = str(common.results_dir(__file__))
HEADS = [16, 32, 64, 128]
ROWS = [1, 8, 64, 512]
LENGTHS = [256, 4096, 65536]
#: (B, H, N, D = M) of issue #23
ISSUE_SHAPES = [(4, 8, 4096, 64), (1, 8, 16384, 32), (1, 8, 4096, 32), (8, 8, 1024, 64), (2, 4, 8192, 128),
                (16, 8, 512, 32)]
#: the feature maps of the whole-attention columns (``--feature-maps``): every built-in one, elu + 1 first
FEATURE_MAPS = ("elu", "relu", "squared_relu", "sigmoid", "dpfp", "taylor", "rebased", "t2r", "hedgehog", "poly2", "favor",
                "random_fourier")


def grid_shapes(args) -> tuple[list[tuple], list[tuple]]:
    """(shapes to run, shapes skipped) as (B, H, N, D) with the issue's first, or ``--shapes`` alone."""
    if args.shapes:
        return args.shapes, []
    heads, rows, lengths = (HEADS, ROWS, LENGTHS) if not args.quick else ([16, 64], [1, 64], [256, 4096])
    grid = [((r // 8, 8) if r >= 8 else (1, 1)) + (n, d) for d in heads for r in rows for n in lengths]
    shapes = [s for s in ISSUE_SHAPES if not args.quick or s[0] * s[1] * s[2] <= 32 * 4096] + grid
    run = [s for s in shapes if s[0] * s[1] * s[2] * s[3] <= args.max_elements]
    return run, [s for s in shapes if s not in run]


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"8x8x4096x128"`` -> (8, 8, 4096, 128)."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is BxHxNxD of positive integers, e.g. 8x8x4096x128, not {text!r}")
    return tuple(int(p) for p in parts)


#: the normaliser's eps, as the layers' default
EPS = 1e-6


#: the identity as a feature map: q and k are phi(q), phi(k) already, which the fused kernel takes as
#: those of a map applied before it (no ``kernel_form``)
MAPPED_ALREADY = types.SimpleNamespace(forward_queries=lambda x: x, forward_keys=lambda x: x)


def normalised(numerator, phi_q, phi_k):
    """Eq. 9's normaliser in PyTorch: ``numerator (B, H, N, M) / (phi(q_t) . sum_{s <= t} phi(k_s) + eps)``."""
    return numerator / ((phi_q * phi_k.cumsum(2)).sum(-1, keepdim=True) + EPS)


@functools.cache
def kernel_available() -> bool:
    """Whether ``ops/kernels.py`` selects the fused C++ kernel for mapped fp32 CPU inputs (its build can be had)."""
    import torch

    from linformer_lab.ops import kernels

    x = torch.zeros(1, 1, 1, 16)
    return kernels.select("causal_attention", MAPPED_ALREADY, x, x, x).name == "cpp"


def _kernel(q, k, v):
    """Causal attention from phi(q), phi(k) on the fused C++ kernel."""
    from linformer_lab.ops.cpu import causal_recurrence

    return causal_recurrence.causal_attention(MAPPED_ALREADY, q, k, v, None, EPS)


def _kernel_before(commit: str):
    """The kernel with causal_recurrence.cpp as it was at a git ``commit`` (with the headers beside
    it then), built as a module of another name (Python keeps one module per name), or the current
    build where the sources are the same, and put in place of the current one for the whole fwd +
    bwd (``context``): before / after a change, interleaved in one process."""
    from linformer_lab.ops import cpu

    with tempfile.TemporaryDirectory(prefix="causal_recurrence_before-") as folder:  # the build is cached elsewhere
        source = os.path.join(common.export_revision(commit, folder), "linformer_lab", "ops", "cpu", "causal_recurrence.cpp")
        if not os.path.isfile(source):
            raise SystemExit(f"--before-revision: {commit} has no linformer_lab/ops/cpu/causal_recurrence.cpp")
        extension = cpu.Extension("linformer_lab_causal_recurrence_before", source, "no before / after")
        same = extension.source_digest() == cpu.CAUSAL_RECURRENCE.source_digest()
        before = cpu.CAUSAL_RECURRENCE.load() if same else extension.load()
    if not hasattr(before, "attention_forward"):
        raise SystemExit(f"--before-revision: {commit}'s causal_recurrence.cpp has no fused attention (attention_forward)")

    def run(q, k, v):
        return _kernel(q, k, v)
    run.context, run.module = (lambda: cpu.CAUSAL_RECURRENCE.substituted(before)), before
    return run


def copy_rate(torch, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second that ``y.copy_(x)`` moves (read + write) on fp32 tensors of ``mib`` MiB,
    far larger than the caches: the memory bandwidth the kernel can have."""
    x, y = torch.randn(mib << 18), torch.empty(mib << 18)
    t = common.median_seconds(lambda: y.copy_(x), repeats, warmup=2)
    return 2 * x.numel() * 4 / t


def traffic_bytes(b: int, h: int, n: int, d: int) -> int:
    """The fewest bytes one fp32 fwd + bwd must move to and from memory: reading q, k, v and
    writing out, then reading q, k, v, grad and writing three gradients: 11 tensors of B H N D."""
    return 11 * b * h * n * d * 4


def implementations(torch, before_revision: str | None = None):
    from linformer_lab.ops.linear_attention import chunk

    impls = {}
    if kernel_available():
        impls["kernel"] = _kernel
        if before_revision:
            impls["kernel_before"] = _kernel_before(before_revision)
    impls["chunk"] = lambda q, k, v: normalised(chunk.CausalDotProduct.apply(q, k, v), q, k)
    try:
        from fast_transformers.causal_product import causal_dot_product as ft

        impls["fast_transformers"] = lambda q, k, v: normalised(ft(q, k, v), q, k)
    except ImportError:
        pass
    return impls


def measure(torch, impls, shape, args) -> dict:
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(0)
    # feature-mapped (elu + 1, positive) queries and keys, as the numerator sees them
    q, k = ((torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen)) + 1).requires_grad_() for _ in range(2))
    v = torch.randn(b, h, n, d, generator=gen).requires_grad_()
    grad = torch.randn(b, h, n, d, generator=gen)

    def case(fn):
        return common.forward_backward(lambda: fn(q, k, v), (q, k, v), grad, getattr(fn, "context", contextlib.nullcontext))

    cases = {name: case(fn) for name, fn in impls.items()}
    cases.update(feature_map_cases(torch, shape, args.feature_maps, args.max_elements))
    start = time.perf_counter()
    for fn in cases.values():  # warm-up, and one call's time to size the repeats
        fn()
    once = time.perf_counter() - start
    repeats = max(3, min(args.repeats, int(args.budget / max(once, 1e-6))))
    times = common.interleaved_medians(cases, repeats, warmup=0, budget_s=args.budget)
    row = {"B": b, "H": h, "N": n, "D": d, "M": d, "repeats": len(next(iter(times.values()))["samples"]),
           "loadavg_1min": round(os.getloadavg()[0], 2)}
    if "kernel" in cases:  # the kernel's calls back to back, as in a training loop: no other code between them
        row["kernel_alone_ms"] = round(common.median_seconds(cases["kernel"], row["repeats"], warmup=1) * 1e3, 3)
    for name, t in times.items():
        row[f"{name}_ms"] = round(t["median"] * 1e3, 3)
    work = b * h * 16 * n * d * d  # the kernel's FLOPs (module docstring)
    if "kernel" in times:
        row["kernel_gflops"] = round(work / times["kernel"]["median"] / 1e9, 2)
        row["kernel_gemm_fraction"] = round(work / times["kernel"]["median"] / args.gemm_flops, 3)
        row["kernel_copy_fraction"] = round(traffic_bytes(b, h, n, d) / times["kernel"]["median"] / args.copy_bytes, 3)
        row["kernel_alone_gemm_fraction"] = round(work / (row["kernel_alone_ms"] / 1e3) / args.gemm_flops, 3)
        if "fast_transformers" in times:
            row["ft_over_kernel"] = round(times["fast_transformers"]["median"] / times["kernel"]["median"], 2)
        row["chunk_over_kernel"] = round(times["chunk"]["median"] / times["kernel"]["median"], 2)
        if "kernel_before" in times:
            row["kernel_before_over_kernel"] = round(times["kernel_before"]["median"] / times["kernel"]["median"], 2)
            if "fast_transformers" in times:
                row["ft_over_kernel_before"] = round(times["fast_transformers"]["median"] / times["kernel_before"]["median"],
                                                     2)
    if "fast_transformers" in times:
        row["ft_over_chunk"] = round(times["fast_transformers"]["median"] / times["chunk"]["median"], 2)
    for name in args.feature_maps:
        if f"map_{name}" in times and "map_elu" in times:
            row[f"map_{name}_over_elu"] = round(times[f"map_{name}"]["median"] / times["map_elu"]["median"], 2)
    return row


def feature_map_cases(torch, shape, names, max_elements: int) -> dict:
    """``map_<name>``: fwd+bwd of causal ``linear`` attention with feature map ``name`` from unmapped
    q, k ``(B, H, N, D)`` (v of D too), for each name whose features fit ``max_elements``."""
    import linformer_lab as ll

    b, h, n, d = shape
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=gen)
    cases = {}
    for name in names:
        attention = ll.build_attention("linear", causal=True, query_dim=d, feature_map=name)
        if b * h * n * attention.feature_map.output_dim > max_elements:
            continue
        cases[f"map_{name}"] = common.forward_backward(lambda attention=attention: attention(q, k, v), (q, k, v), grad)
    return cases


def write_report(args, rows, skipped, env, path_md) -> str:
    lines = [
        "# Causal linear attention on CPU from mapped q, k: fused kernel vs chunk path vs fast-transformers' numerator",
        "",
        f"Generated by `{env['command']}` on {env['date']}.",
        "",
        f"- Machine: {env['cpu']} ({env['logical_cpus']} logical CPUs), {env['threads']} torch threads, "
        f"Python {env['python']}, torch {env['torch']}, fast-transformers {env['fast_transformers']}, "
        f"OMP_WAIT_POLICY {env['omp_wait_policy']}, kernel loops for {env['isa']}.",
        f"- Load average at the start {env['load_start']}, at the end {env['load_end']} (1 / 5 / 15 min).",
        f"- fp32 GEMM rate (torch.mm, {args.gemm_size}^2, {env['threads']} threads): "
        f"{args.gemm_flops / 1e9:.1f} GFLOP/s at the start, {env['gemm_end'] / 1e9:.1f} at the end.",
        f"- Memory: `y.copy_(x)` of {args.copy_mib} MiB moves {args.copy_bytes / 1e9:.1f} GB/s (read + write). "
        "Copy fraction: the fewest bytes a fwd + bwd moves (11 tensors of B H N D: q, k, v, out; q, k, v, grad, "
        "three gradients) per second over that rate: near 1, a shape is bound by memory, not arithmetic.",
        "- Kernel alone: the kernel's calls again, back to back after the interleaved rounds (as in a training loop: no "
        "other implementation's allocations and cache traffic between them), and their GEMM fraction.",
        "- Forward+backward of causal attention from feature-mapped q, k (numerator and normaliser), fp32, D = M, "
        "median ms of interleaved calls (rounds A B C, C B A, B C A, A C B, ...). Ratios > 1: the kernel is faster. "
        "Kernel: the fused C++ kernel (causal_recurrence.cpp, the `causal_attention` op's `cpp` candidate); chunk "
        "path: the pure-PyTorch chunk.py numerator; FT: fast-transformers' numerator; both of these then the "
        "normaliser in PyTorch. GEMM fraction: the kernel's 16 C M FLOPs per position per second over the GEMM "
        "rate at the start.",
        "",
    ]
    header = ["B", "H", "N", "D", "kernel ms", "chunk path ms", "FT ms", "FT / kernel", "chunk path / kernel",
              "kernel GFLOP/s", "GEMM fraction", "copy fraction", "kernel alone ms", "alone GEMM fraction", "load"]
    table = [[r["B"], r["H"], r["N"], r["D"], common.fmt(r.get("kernel_ms"), 2), common.fmt(r.get("chunk_ms"), 2),
              common.fmt(r.get("fast_transformers_ms"), 2), common.fmt(r.get("ft_over_kernel"), 2),
              common.fmt(r.get("chunk_over_kernel"), 2), common.fmt(r.get("kernel_gflops"), 1),
              common.fmt(r.get("kernel_gemm_fraction"), 2), common.fmt(r.get("kernel_copy_fraction"), 2),
              common.fmt(r.get("kernel_alone_ms"), 2), common.fmt(r.get("kernel_alone_gemm_fraction"), 2),
              r["loadavg_1min"]] for r in rows]
    if any("kernel_before_ms" in r for r in rows):
        header += ["kernel before ms", "FT / kernel before", "kernel before / kernel"]
        for line, r in zip(table, rows):
            line += [common.fmt(r.get("kernel_before_ms"), 2), common.fmt(r.get("ft_over_kernel_before"), 2),
                     common.fmt(r.get("kernel_before_over_kernel"), 2)]
        lines[-1:-1] = [f"- Kernel before: the kernel with causal_recurrence.cpp as at revision "
                        f"`{args.before_revision_id}` (`--before-revision`), timed interleaved with the others."]
    lines.append(common.markdown_table(header, table))
    ratios = [r["ft_over_kernel"] for r in rows if "ft_over_kernel" in r]
    if ratios:
        lines += ["", f"FT / kernel: min {min(ratios):.2f}, median {sorted(ratios)[len(ratios) // 2]:.2f}, "
                      f"max {max(ratios):.2f} over {len(ratios)} shapes; below 2: "
                      + (", ".join(f"{r['B']}x{r['H']}x{r['N']}x{r['D']} ({r['ft_over_kernel']:.2f})"
                                   for r in rows if r.get("ft_over_kernel", 9) < 2) or "none") + "."]
    earlier = sorted(r["kernel_before_over_kernel"] for r in rows if "kernel_before_over_kernel" in r)
    if earlier:
        lines += ["", f"Kernel before / kernel (`--before-revision`): min {earlier[0]:.2f}, "
                      f"median {earlier[len(earlier) // 2]:.2f}, max {earlier[-1]:.2f} over {len(earlier)} shapes."]
    if args.feature_maps:
        lines += ["", "### Causal linear attention with each feature map", "",
                  "Fwd+bwd of the whole attention (feature map, numerator, normaliser) from unmapped q, k, median ms "
                  "in the same interleaved rounds, and in brackets the ratio to elu + 1 (above 1: slower); — where the "
                  f"features would hold more than {args.max_elements:,} numbers.", ""]
        maps_table = [[r["B"], r["H"], r["N"], r["D"]]
                      + [f"{common.fmt(r.get(f'map_{m}_ms'), 2)} ({common.fmt(r.get(f'map_{m}_over_elu'), 2)})"
                         if r.get(f"map_{m}_ms") else "—" for m in args.feature_maps] for r in rows]
        lines.append(common.markdown_table(["B", "H", "N", "D", *args.feature_maps], maps_table))
    if skipped:
        lines += ["", f"Skipped (more than {args.max_elements:,} numbers per input tensor): "
                      + ", ".join("x".join(map(str, s)) for s in skipped) + " (B x H x N x D)."]
    text = "\n".join(lines) + "\n"
    with open(path_md, "w") as f:
        f.write(text)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="most timed fwd+bwd calls per implementation and shape")
    p.add_argument("--budget", type=float, default=4.0, help="s of timed calls per shape (at least 3 rounds)")
    p.add_argument("--max-elements", type=int, default=1 << 25, help="numbers per input tensor above which a shape "
                   "is skipped (default 2^25: 128 MiB each, ~1 GiB for inputs, outputs and gradients)")
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--isa", choices=["avx512", "avx2", "baseline"], default=None,
                   help="run the kernel's loops for this instruction set (default: the CPU's best)")
    p.add_argument("--quick", action="store_true", help="a few small shapes, 3 repeats: a smoke run of ~1 minute")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="BxHxNxD",
                   help="only these shapes (D = M), e.g. to rerun the slow ones with more --repeats and --budget")
    p.add_argument("--feature-maps", type=_map_list, default=list(FEATURE_MAPS), metavar="A,B,...",
                   help="feature maps of the whole-attention columns (default: every built-in one; 'none': no columns)")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--before-revision", default=None, metavar="REV",
                   help="also time causal_recurrence.cpp as at this git revision (built under another module name "
                        "unless its source is the working tree's), as 'kernel before': before / after a change in one run")
    p.add_argument("--out", default=RESULTS)
    common.add_omp_wait_policy_argument(p)
    args = p.parse_args(argv)
    common.apply_omp_wait_policy(args.omp_wait_policy)
    args.before_revision_id = None
    if args.before_revision:
        try:  # resolved once, before any measuring: HEAD may move on during the run
            args.before_revision_id = common.resolve_commit(args.before_revision)
        except ValueError as error:
            raise SystemExit(f"--before-revision: {error}") from None
    if args.quick:
        args.repeats, args.budget, args.gemm_size = 3, 1.0, 1024
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    machine = common.machine_info()
    env = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cpu": _lscpu_model() or machine["cpu"], "logical_cpus": machine["logical_cpus"], "python": platform.python_version(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "fast_transformers": _ft_version(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "isa": "—",
           "load_start": " / ".join(f"{x:.2f}" for x in os.getloadavg())}
    args.gemm_flops = common.gemm_rate(args.gemm_size)
    args.copy_mib = 32 if args.quick else 256
    args.copy_bytes = copy_rate(torch, args.copy_mib)
    print(f"fp32 GEMM {args.gemm_flops / 1e9:.1f} GFLOP/s, copy {args.copy_bytes / 1e9:.1f} GB/s; {common.load_line()}",
          flush=True)
    impls = implementations(torch, args.before_revision_id)
    if "kernel" in impls:
        from linformer_lab.ops import cpu

        if args.isa:
            cpu.CAUSAL_RECURRENCE.load().set_instruction_set(args.isa)
        if args.isa and "kernel_before" in impls:
            impls["kernel_before"].module.set_instruction_set(args.isa)
        env["isa"] = cpu.CAUSAL_RECURRENCE.load().instruction_set()
    print("implementations:", ", ".join(impls), flush=True)
    shapes, skipped = grid_shapes(args)
    rows = []
    for shape in shapes:
        row = measure(torch, impls, shape, args)
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("M",)}, flush=True)
    env["gemm_end"] = common.gemm_rate(args.gemm_size)
    env["load_end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    suffix = ("_quick" if args.quick else "") + args.tag
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, f"causal_linear_cpu_grid{suffix}.csv"), rows)
    print(write_report(args, rows, skipped, env, os.path.join(args.out, f"causal_linear_cpu_grid{suffix}.md")))


def _map_list(text: str) -> list[str]:
    """``"elu,t2r"`` -> ["elu", "t2r"] (elu first, the ratios' base); ``"none"`` -> []."""
    if text == "none":
        return []
    names = [name for name in text.split(",") if name]
    return ["elu"] + [name for name in names if name != "elu"]


def _lscpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)


def _ft_version() -> str:
    try:
        from importlib.metadata import version

        return version("pytorch-fast-transformers")
    except Exception:
        return "not installed"


if __name__ == "__main__":
    main()
