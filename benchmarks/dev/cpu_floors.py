"""Training on a CPU against its floor, on the machine at hand: one optimizer update beside the
GEMM rate it could run at.

1. **GEMM rate** (the floor): fp32 ``torch.mm`` of two 2048 x 2048 matrices, ``--threads``
   threads, GFLOP/s (``common.gemm_rate``).
2. **Training**: one optimizer update (forward, backward, gradient clipping, RAdam) of the
   paper's MNIST model (``configs/mnist_linear.yaml``, batch 10; fp32 and bf16 autocast) and of
   the CPU recipe (``configs/mnist_cpu_linear.yaml``, batch 4, fp32): images/s, and the matrix
   FLOPs per update (torch's ``FlopCounterMode``) / time as a share of the GEMM rate, with the
   operations that take the most time (torch profiler, self time).

The causal op against the GEMM rate and against fast-transformers is ``causal_cpu_grid.py``; the
RNN step against its weight-product floor is ``benchmarks/paper/generation.py --latency-only``.

    uv run python benchmarks/dev/cpu_floors.py                 # a few minutes on 2 cores
    uv run python benchmarks/dev/cpu_floors.py --quick         # smoke run
    OMP_WAIT_POLICY=PASSIVE ...   # on a loaded machine: waiting OpenMP threads sleep instead of spinning

Writes ``benchmarks/dev/results/cpu_floors[_quick].{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402
import torch  # noqa: E402

RESULTS = common.results_dir(__file__)


# ---------------------------------------------------------------- training
def training_rows(cases, repeats: int, gemm: float, profile_top: int) -> tuple[list[dict], dict]:
    from torch.utils.flop_counter import FlopCounterMode

    rows, profiles, start = [], {}, time.perf_counter()
    for config, autocast in cases:
        common.progress(len(rows), len(cases), f"timing {config}{' (bf16 autocast)' if autocast else ''}", start)
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
def report(rows: list[dict], profiles: dict, gemm: float, args, header: list[str], wall: float) -> str:
    out = [
        "# CPU training against its floor", "", *header,
        f"- {wall / 60:.1f} min; {common.load_line()} at end",
        f"- GEMM rate (fp32 mm {args.gemm_size}^2): **{gemm:.0f} GFLOP/s**; every floor below is FLOPs / this rate",
    ]
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
    parser.add_argument("--quick", action="store_true", help="small shapes, 1 repeat, the CPU recipe only")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    cases = [("mnist_linear.yaml", False), ("mnist_linear.yaml", True), ("mnist_cpu_linear.yaml", False)]
    if args.quick:
        args.repeats, args.gemm_size = 1, 512
        cases = [("mnist_cpu_linear.yaml", False)]
    header, t0 = common.provenance(__file__, args.argv), time.perf_counter()
    gemm = common.gemm_rate(args.gemm_size, max(args.repeats, 3)) / 1e9
    print(f"GEMM rate: {gemm:.0f} GFLOP/s", flush=True)
    rows, profiles = training_rows(cases, args.repeats, gemm, profile_top=6)
    text = report(rows, profiles, gemm, args, header, time.perf_counter() - t0)
    name = "cpu_floors" + ("_quick" if args.quick else "")
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, f"{name}.csv"), [{"gemm_gflops": gemm, **r} for r in rows])
    Path(args.out, f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
