"""The causal Function before and after a change, interleaved in one run, plus the cost of state in/out.

    uv run python benchmarks/causal_state_overhead.py --rev HEAD~1

Loads ``linformer_lab/ops/linear_attention/chunk.py`` as it was at ``--rev`` (git show) beside
the working tree's, and times forward+backward of the causal numerator at a few shapes:

* ``old``: the Function at ``--rev``;
* ``new``: the working tree's, called as before (no state);
* ``new+state``: the working tree's with an initial state and the final state returned (and
  a gradient flowing into both).

Calls rotate between the variants (interleaved_medians), so load changes hit all alike.
Results: ``benchmarks/results/causal_state_overhead.{csv,md}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402
from common import interleaved_medians, machine_info, markdown_table, write_csv  # noqa: E402

from linformer_lab.ops.linear_attention import causal_dot_product  # noqa: E402

CHUNK_FILE = "linformer_lab/ops/linear_attention/chunk.py"
SHAPES = [(4, 8, 784, 32, 32), (1, 8, 4096, 32, 32), (4, 8, 4096, 64, 64), (1, 8, 16384, 32, 32)]


def load_revision(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:{CHUNK_FILE}"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "chunk_old.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("chunk_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD", help="git revision of the 'old' Function")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of the shapes to run (smallest first)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "causal_state_overhead"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    old = load_revision(args.rev)
    rows = []
    for b, h, n, c, m in SHAPES[: args.shapes]:
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.rand(b, h, n, c, generator=gen).requires_grad_(True) for _ in range(2))
        v = torch.randn(b, h, n, m, generator=gen).requires_grad_(True)
        s0 = torch.randn(b, h, c, m, generator=gen).requires_grad_(True)
        g = torch.randn(b, h, n, m, generator=gen)
        g_final = torch.randn(b, h, c, m, generator=gen)

        def run_old():
            torch.autograd.backward(old.causal_dot_product(q, k, v), g)

        def run_new():
            torch.autograd.backward(causal_dot_product(q, k, v), g)

        def run_state():
            out, final = causal_dot_product(q, k, v, None, s0, True)
            torch.autograd.backward([out, final], [g, g_final])

        timed = interleaved_medians({"old": run_old, "new": run_new, "new+state": run_state}, repeats=args.repeats)
        medians = {name: t["median"] for name, t in timed.items()}
        row = {"B": b, "H": h, "N": n, "C": c, "M": m, **{f"{k}_ms": round(1e3 * t, 2) for k, t in medians.items()},
               "new_over_old": round(medians["new"] / medians["old"], 3),
               "state_over_new": round(medians["new+state"] / medians["new"], 3)}
        rows.append(row)
        print(row, flush=True)
    info = machine_info()
    write_csv(args.out + ".csv", rows)
    lines = [
        "# Causal Function: before/after and the cost of state in/out",
        "",
        f"`benchmarks/causal_state_overhead.py --rev {args.rev}` ({time.strftime('%Y-%m-%d')}); {info['cpu']}, "
        f"{args.threads} threads, torch {torch.__version__}; forward+backward, fp32, median of {args.repeats} "
        "interleaved calls.",
        "",
        markdown_table(["B", "H", "N", "C", "M", "old ms", "new ms", "new+state ms", "new / old", "new+state / new"],
                       [[r[k] for k in ("B", "H", "N", "C", "M", "old_ms", "new_ms", "new+state_ms", "new_over_old",
                                        "state_over_new")] for r in rows]),
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
