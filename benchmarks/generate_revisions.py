"""``PixelTransformer.generate`` at a git revision against the working tree, interleaved in one run.

    uv run python benchmarks/generate_revisions.py --rev HEAD~1
    uv run python benchmarks/generate_revisions.py --rev HEAD~1 --batch 64 --rounds 3

The before/after check for changes to the generation path (the RNN step, sampling, prefill):
``git archive`` puts the package as it was at ``--rev`` in a temporary folder; each round then
runs one child process per variant (old, new, alternating, so a change of machine load hits
both alike). A child builds the paper's MNIST model (8 layers, 8 heads, d_model 256, 10
logistics, linear attention, seed 0; untrained: the cost does not depend on the weights),
warms up, and times ``--calls`` completions of the bottom half given the top half, with the
prefix prefilled in one pass (``prefill=True``) and stepped (``prefill=False``). Reported:
the median over rounds of each child's median, and new/old time ratios.
Results: ``benchmarks/results/generate_revisions_batch<B>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import machine_info, markdown_table, write_csv  # noqa: E402

VARIANTS = ("old", "new")
MODES = ("prefill", "stepped")


def child(batch: int, calls: int, threads: int) -> dict:
    """Runs in a process whose ``linformer_lab`` is one variant's; prints the medians."""
    import torch

    from linformer_lab.models.pixel_transformer import PixelTransformer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = PixelTransformer("linear", n_layers=8, n_heads=8, d_model=256, d_ff=1024, num_mixtures=10).eval()
    prefix = torch.randint(0, 256, (batch, 1, 14, 28), dtype=torch.uint8)
    seconds = {mode: [] for mode in MODES}
    for call in range(calls + 1):  # the first call of each mode warms up
        for mode in MODES:
            start = time.perf_counter()
            model.generate(batch, 1.0, prefix=prefix, prefill=mode == "prefill", generator=torch.Generator().manual_seed(call))
            if call:
                seconds[mode].append(time.perf_counter() - start)
    import linformer_lab

    return {"package": str(Path(linformer_lab.__file__).parents[1]), **{mode: statistics.median(s) for mode, s in seconds.items()}}


def export_revision(rev: str, folder: str) -> str:
    archive = subprocess.run(["git", "archive", rev, "linformer_lab"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD", help="git revision of the 'old' variant")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="child processes per variant, alternating")
    p.add_argument("--calls", type=int, default=3, help="timed completions per mode in each child")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "generate_revisions"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.batch, args.calls, args.threads)))
        return

    # the revision as a commit, resolved once: HEAD may move on while the rounds run
    args.commit = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="generate_revisions_") as folder:
        runs = run_rounds(args, {"old": export_revision(args.commit, folder), "new": str(REPO)})
    write_results(args, runs)


def run_rounds(args, roots: dict[str, str]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            env = {**os.environ, "PYTHONPATH": roots[variant]}
            command = [sys.executable, __file__, "--child", "--batch", str(args.batch), "--calls", str(args.calls),
                       "--threads", str(args.threads)]
            out = subprocess.run(command, env=env, cwd=roots[variant], capture_output=True, text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            if Path(runs[variant][-1]["package"]).resolve() != Path(roots[variant]).resolve():
                raise RuntimeError(f"the {variant} child imported linformer_lab from {runs[variant][-1]['package']}, not {roots[variant]}")
            print(f"round {round_ + 1} {variant}: {runs[variant][-1]}", flush=True)
    return runs


def write_results(args, runs: dict[str, list[dict]]) -> None:

    median = {v: {m: statistics.median(r[m] for r in runs[v]) for m in MODES} for v in VARIANTS}
    rows = [{"mode": m, "old_s": median["old"][m], "new_s": median["new"][m], "new_over_old": median["new"][m] / median["old"][m]}
            for m in MODES]
    rows.append({"mode": "stepped / prefill", "old_s": median["old"]["stepped"] / median["old"]["prefill"],
                 "new_s": median["new"]["stepped"] / median["new"]["prefill"], "new_over_old": float("nan")})
    info = machine_info()
    import torch

    out = Path(f"{args.out}_batch{args.batch}")
    # --out as the command was given, relative to the repository
    default_out = REPO / "benchmarks" / "results" / "generate_revisions"
    out_option = "" if Path(args.out).resolve() == default_out else f" --out {os.path.relpath(args.out, REPO)}"
    write_csv(str(out.with_suffix(".csv")), rows)
    lines = [
        f"# generate() at {args.rev} = {args.commit} (old) and the working tree (new), interleaved", "",
        f"`benchmarks/generate_revisions.py --rev {args.rev} --batch {args.batch} --rounds {args.rounds} --calls {args.calls}"
        f"{out_option}` "
        f"({time.strftime('%Y-%m-%d')}); {info['cpu']}, {os.cpu_count()} cores, {args.threads} torch threads, "
        f"torch {torch.__version__}. Paper MNIST model, linear attention, completion of the bottom half, batch {args.batch}; "
        "seconds per completion (median over rounds of each child's median); the last row is the speedup of the "
        "prefill over stepping the prefix within each variant.", "",
        markdown_table(["mode", "old", "new", "new / old"],
                       [[r["mode"], f"{r['old_s']:.3f}", f"{r['new_s']:.3f}", "" if r["mode"].startswith("stepped /") else f"{r['new_over_old']:.3f}"]
                        for r in rows]), "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
