"""Does bf16 autocast pay for training on this CPU? One optimizer update (forward, backward,
clipping, RAdam; ``common.image_training_update``) of a CPU recipe's MNIST model in fp32 and under
bf16 autocast, interleaved in one process (``common.interleaved_medians``: a change of load hits
both alike), with the CPU's bf16 units as the CLI's precision rule reads them
(``linformer_lab.ops.cpu.isa.bf16_units``).

    OMP_NUM_THREADS=1 uv run python benchmarks/dev/bf16_update.py
    uv run python benchmarks/dev/bf16_update.py --quick      # smoke run

Writes ``benchmarks/dev/results/bf16_update[_quick].md`` (reading: benchmarks/NOTES.md, "Is bf16
worth it on CPU?").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402

RESULTS = common.results_dir(__file__)
CONFIGS = ("mnist_cpu_linear.yaml", "mnist_cpu_softmax.yaml")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help="image configs under configs/")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds (each times both)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per config; at least 3 rounds")
    parser.add_argument("--quick", action="store_true", help="3 rounds of the first config")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch

    from linformer_lab.ops.cpu.isa import bf16_units

    torch.set_num_threads(args.threads)
    if args.quick:
        args.configs, args.repeats, args.budget = args.configs[:1], 3, 10.0
    header, start = common.provenance(__file__, argv), time.perf_counter()
    rows = []
    for config in args.configs:
        fp32, batch, _ = common.image_training_update(config, autocast=False)
        bf16, _, _ = common.image_training_update(config, autocast=True)
        timed = common.interleaved_medians({"fp32": fp32, "bf16": bf16}, args.repeats, warmup=2, budget_s=args.budget)
        a, b = timed["fp32"], timed["bf16"]
        rows.append([config, batch, len(a["samples"]), f"{a['median']:.3f}", f"{b['median']:.3f}",
                     f"{b['median'] / a['median']:.2f}", f"{min(y / x for x, y in zip(a['samples'], b['samples'])):.2f}"
                     f"-{max(y / x for x, y in zip(a['samples'], b['samples'])):.2f}"])
        print(f"{config}: fp32 {a['median']:.3f} s, bf16 autocast {b['median']:.3f} s", flush=True)
    text = "\n".join([
        "# One update in fp32 and under bf16 autocast", "", *header,
        f"- bf16 units here (ops/cpu/isa.py: bf16_units): {bf16_units() or 'none'}; "
        f"{args.threads} torch thread(s); {(time.perf_counter() - start) / 60:.1f} min; {common.load_line()} at end", "",
        common.markdown_table(["config", "batch", "rounds", "fp32 s/update", "bf16 s/update", "bf16 / fp32",
                               "per round"], rows), ""])
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "bf16_update" + ("_quick" if args.quick else "") + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
