"""CPU speed against its floors, on the machine at hand: the three hot paths of linear attention
on a CPU, each beside the cheapest it could be here.

1. **GEMM rate** (the floor of everything below): fp32 ``torch.mm`` of two 2048 x 2048 matrices,
   ``--threads`` threads, GFLOP/s.
2. **Causal op**: ``linformer_lab.ops.linear_attention.causal_dot_product`` forward + backward,
   fp32, at the shapes of the CPU-speed issue. FLOP rate = the FLOPs of the algorithm the C++
   kernel runs (``causal_cpu_grid.kernel_flops``: the recurrence's 16 C M per position, or the
   chunked algorithm's at the chunk kernel's chunk length) / time, as a share of the GEMM
   rate; fast-transformers 0.4.0's CPU kernel beside it, interleaved, when ``fast_transformers``
   is importable (benchmarks/README.md, "fast-transformers baseline venv": how it builds on CPU).
3. **RNN step**: one MNIST image at batch 1 from the paper's model (8 x 256, random weights):
   linear in RNN mode and stateful softmax (KV cache), whole ``generate`` calls interleaved, beside
   the weight-product floor (``generation.matvec_floor``: only the four weight products of every
   layer, once per sub-pixel).
4. **Training**: one optimizer update (forward, backward, gradient clipping, RAdam) of the
   paper's MNIST model (``configs/mnist_linear.yaml``, batch 10; fp32 and bf16 autocast) and of
   the CPU recipe (``configs/mnist_cpu_linear.yaml``, batch 4, fp32): images/s, and the matrix
   FLOPs per update (torch's ``FlopCounterMode``) / time as a share of the GEMM rate, with the
   operations that take the most time (torch profiler, self time).

    uv run python benchmarks/paper/cpu_floors.py                 # ~5 min on 2 cores
    uv run python benchmarks/paper/cpu_floors.py --quick         # smoke run (~1 min)
    PYTHONPATH=. .bench_env/bin/python benchmarks/paper/cpu_floors.py   # with fast-transformers
    OMP_WAIT_POLICY=PASSIVE ...   # on a loaded machine: waiting OpenMP threads sleep instead of spinning

Writes ``benchmarks/paper/results/cpu_floors[_quick].{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "paper"))

import causal_cpu_grid  # noqa: E402  (its FLOP count and GEMM rate)
import common  # noqa: E402
import torch  # noqa: E402

RESULTS = REPO / "benchmarks" / "paper" / "results"
#: (B, H, N, D = M): the six shapes of the CPU-speed issue
CAUSAL_SHAPES = [(4, 8, 4096, 64), (1, 8, 16384, 32), (1, 8, 4096, 32), (8, 8, 1024, 64), (2, 4, 8192, 128),
                 (16, 8, 512, 32)]


class _NoBar:  # generation.py's measurement functions report progress to a bar
    def set_postfix_str(self, *_):
        pass

    def update(self, *_):
        pass


# ---------------------------------------------------------------- 2. causal op
def causal_rows(shapes, repeats: int, gemm: float) -> list[dict]:
    from linformer_lab.ops.linear_attention import causal_dot_product

    try:
        from fast_transformers.causal_product import causal_dot_product as ft_causal
    except ImportError:
        ft_causal = None
    rows = []
    for b, h, n, d in shapes:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.rand(b, h, n, d, generator=gen).requires_grad_() for _ in range(3))
        grad = torch.randn(b, h, n, d, generator=gen)

        def fwd_bwd(fn):
            return common.forward_backward(lambda: fn(q, k, v), (q, k, v), grad)

        fns = {"ours": fwd_bwd(causal_dot_product)}
        if ft_causal is not None:
            fns["fast_transformers"] = fwd_bwd(ft_causal)
        times = common.interleaved_medians(fns, repeats)
        ours = times["ours"]["median"]
        work = b * h * causal_cpu_grid.kernel_flops(n, d, d)[0]  # the algorithm the kernel runs for (D, D)
        ft = times.get("fast_transformers", {}).get("median")
        rows.append(dict(path="causal op", case=f"B={b} H={h} N={n} D=M={d}", seconds=ours,
                         floor_seconds=work / (gemm * 1e9), gflops=work / ours / 1e9, gemm_share=work / ours / (gemm * 1e9),
                         fast_transformers_seconds=ft, speedup_vs_ft=ft / ours if ft else None))
    return rows


# ---------------------------------------------------------------- 3. RNN step
def step_rows(repeats: int) -> list[dict]:
    import generation

    timer = common.Timer("cpu")
    models = {(m, "model"): generation.build_model(m, "mnist", "cpu") for m in ("linear", "stateful-softmax")}
    times = generation.measure_recurrent(models, 1, repeats, timer, _NoBar())
    floor = generation.matvec_floor(models["linear", "model"], 1, repeats, timer)
    rows = []
    for method in ("linear", "stateful-softmax"):
        seconds = times[method, "model"]["seconds"]
        rows.append(dict(path="RNN step", case=f"MNIST paper model, {method}, batch 1, one image", seconds=seconds,
                         floor_seconds=floor, floor_ratio=seconds / floor))
    rows[1]["vs_linear"] = rows[1]["seconds"] / rows[0]["seconds"]
    return rows


# ---------------------------------------------------------------- 4. training
def training_rows(cases, repeats: int, gemm: float, profile_top: int) -> tuple[list[dict], dict]:
    from torch.utils.flop_counter import FlopCounterMode

    rows, profiles = [], {}
    for config, autocast in cases:
        update, batch, _ = common.image_training_update(config, autocast)
        update()
        with FlopCounterMode(display=False) as counter:
            update()
        flops = counter.get_total_flops()
        seconds = common.median_seconds(update, repeats, warmup=1)
        case = f"{config}, batch {batch}, {'bf16 autocast' if autocast else 'fp32'}"
        rows.append(dict(path="training", case=case, seconds=seconds, images_per_s=batch / seconds,
                         floor_seconds=flops / (gemm * 1e9), gflops=flops / seconds / 1e9,
                         gemm_share=flops / seconds / (gemm * 1e9)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            update()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        profiles[case] = [(e.key, e.count, e.self_cpu_time_total / total) for e in events[:profile_top]]
    return rows, profiles


# ---------------------------------------------------------------- report
def report(rows: list[dict], profiles: dict, gemm: float, args, wall: float, load_start: str) -> str:
    info, versions = common.machine_info(), common.torch_info()
    ft = next((r for r in rows if r.get("fast_transformers_seconds")), None)
    out = [
        "# CPU speed against its floors", "",
        f"- machine: {info['cpu']}, {info['logical_cpus']} logical CPUs; torch {versions['torch']}, "
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
        f"{time.strftime('%Y-%m-%d')}",
        f"- command: `python benchmarks/paper/cpu_floors.py {' '.join(args.argv)}`; {wall / 60:.1f} min; "
        f"{load_start} at start, {common.load_line()} at end",
        f"- GEMM rate (fp32 mm {args.gemm_size}^2): **{gemm:.0f} GFLOP/s**; every floor below is FLOPs / this rate, "
        "or for the RNN step the weight products alone",
        "- fast-transformers: " + ("0.4.0's CPU kernel, interleaved with ours" if ft else "not importable here (no comparison)"),
        "", "## Causal op (forward + backward, fp32)", "",
        common.markdown_table(
            ["shape", "ours ms", "GFLOP/s", "share of GEMM rate", "fast-transformers ms", "ours faster by"],
            [[r["case"], f"{1e3 * r['seconds']:.1f}", f"{r['gflops']:.3g}", f"{100 * r['gemm_share']:.2g} %",
              common.fmt(r["fast_transformers_seconds"] and 1e3 * r["fast_transformers_seconds"]),
              f"{r['speedup_vs_ft']:.2f}x" if r.get("speedup_vs_ft") else "—"] for r in rows if r["path"] == "causal op"]),
        "", "FLOPs per row, forward + backward, of the algorithm the kernel runs (causal_cpu_grid.py's `kernel_flops`): "
        "16 C M per position for the recurrence (C and M multiples of a register width), else "
        "L^2 (4C + 3M) + 14 L C M per chunk of L positions.",
    ]
    steps = [r for r in rows if r["path"] == "RNN step"]
    if steps:
        out += ["", "## RNN step (MNIST paper model, batch 1, one whole image)", "",
                common.markdown_table(["method", "s / image", "weight-product floor s", "÷ floor", "÷ linear"],
                                      [[r["case"].split(", ")[1], f"{r['seconds']:.3f}", f"{r['floor_seconds']:.3f}",
                                        f"{r['floor_ratio']:.2f}x", f"{r.get('vs_linear', 1.0):.2f}x"] for r in steps])]
    train = [r for r in rows if r["path"] == "training"]
    if train:
        out += ["", "## Training (one update: forward, backward, clipping, RAdam)", "",
                common.markdown_table(["case", "s / update", "images/s", "matrix GFLOP/s", "share of GEMM rate"],
                                      [[r["case"], f"{r['seconds']:.3f}", f"{r['images_per_s']:.3g}", f"{r['gflops']:.3g}",
                                        f"{100 * r['gemm_share']:.2g} %"] for r in train]),
                "", "Where an update's time goes (torch profiler, self CPU time of one update):", ""]
        for case, top in profiles.items():
            out.append(f"- {case}: " + ", ".join(f"{name} {100 * share:.0f} % ({count}x)" for name, count, share in top))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument("--parts", nargs="+", default=["causal", "step", "training"], choices=["causal", "step", "training"])
    parser.add_argument("--quick", action="store_true", help="small shapes, 1 repeat, the CPU recipe only")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    shapes, cases = CAUSAL_SHAPES, [("mnist_linear.yaml", False), ("mnist_linear.yaml", True), ("mnist_cpu_linear.yaml", False)]
    if args.quick:
        args.repeats, args.gemm_size = 1, 512
        shapes, cases = [(1, 2, 256, 16), (2, 2, 512, 32)], [("mnist_cpu_linear.yaml", False)]
    load_start, t0 = common.load_line(), time.perf_counter()
    gemm = causal_cpu_grid.gemm_rate(torch, args.gemm_size, max(args.repeats, 3)) / 1e9
    print(f"GEMM rate: {gemm:.0f} GFLOP/s", flush=True)
    rows, profiles = [], {}
    if "causal" in args.parts:
        rows += causal_rows(shapes, args.repeats, gemm)
    if "step" in args.parts:
        rows += step_rows(max(1, args.repeats // 2))
    if "training" in args.parts:
        found, profiles = training_rows(cases, args.repeats, gemm, profile_top=6)
        rows += found
    text = report(rows, profiles, gemm, args, time.perf_counter() - t0, load_start)
    name = "cpu_floors" + ("_quick" if args.quick else "")
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, f"{name}.csv"), [{"gemm_gflops": gemm, **r} for r in rows])
    Path(args.out, f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
