"""Which MNIST recipe learns most in an hour of one CPU core? One probe per lever.

    uv run python benchmarks/dev/mnist_probes.py                        # every probe, 2 at a time
    uv run python benchmarks/dev/mnist_probes.py --probes base lr_1e-3 --updates 300
    uv run python benchmarks/dev/mnist_probes.py --probes base lr_1e-3 --updates 300 --collect   # tables only

Each probe is ``cli.py fit --config mnist_cpu_linear.yaml`` with the first recipe's settings
(:data:`BASE_ARGS`: the ``base`` probe) and one or two changes, for ``--updates`` updates with the
cosine schedule ending there, on one torch thread, two probes at a time. The base is fixed here,
not read from the config, so a row of the results keeps its meaning when the recipe moves on
(the recipe as committed is ``row_column_batch4``). Recorded: validation
bits/dim (first ``--val-images`` validation images) every ``--eval-every`` updates, the training
bits/dim over the last 50 logged updates, and seconds per update. The levers: learning rate,
width against depth, batch size, schedule. Results: ``benchmarks/dev/results/mnist_probes.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import machine_info, markdown_table, results_dir, torch_info, write_csv  # noqa: E402

#: The first recipe (4 x 128, d_ff 512, batch 16, one position vector per pixel, RAdam 3e-3, 100
#: warm-up updates, cosine): every probe starts from it.
BASE_ARGS = ["--model.position_embedding=pixel", "--data.batch_size=16", "--model.lr=0.003",
             "--model.warmup_steps=100", "--model.lr_schedule=cosine", "--model.n_layers=4", "--model.d_model=128",
             "--model.n_heads=4", "--model.d_ff=512"]

#: The committed recipe's changes to BASE_ARGS (configs/mnist_cpu_linear.yaml).
RECIPE_ARGS = ["--model.position_embedding=row_column", "--data.batch_size=4", "--model.lr=0.0015", "--model.warmup_steps=200"]

PROBES = {
    "base": ("4 x 128 (d_ff 512), batch 16, RAdam 3e-3, 100 warm-up, cosine", []),
    "lr_1e-3": ("learning rate 1e-3", ["--model.lr=0.001"]),
    "lr_1e-2": ("learning rate 1e-2", ["--model.lr=0.01"]),
    "row_column": ("row + column position embeddings", ["--model.position_embedding=row_column"]),
    "row_column_lr_1e-2": ("row + column position embeddings, learning rate 1e-2",
                           ["--model.position_embedding=row_column", "--model.lr=0.01"]),
    "constant_lr": ("constant learning rate (the paper's schedule), no warm-up",
                    ["--model.lr_schedule=constant", "--model.warmup_steps=0"]),
    "shallow": ("2 layers x 128", ["--model.n_layers=2"]),
    "narrow": ("4 layers x 96 (3 heads, d_ff 384)", ["--model.d_model=96", "--model.n_heads=3", "--model.d_ff=384"]),
    "deep_narrow": ("6 layers x 96 (3 heads, d_ff 384)",
                    ["--model.n_layers=6", "--model.d_model=96", "--model.n_heads=3", "--model.d_ff=384"]),
    "batch8": ("8 images per batch", ["--data.batch_size=8"]),
    "row_column_batch8": ("row + column position embeddings, 8 images per batch, twice the updates (the same images)",
                          ["--model.position_embedding=row_column", "--data.batch_size=8"]),
    "row_column_batch4": ("row + column position embeddings, 4 images per batch, 4x the updates (the same images)",
                          ["--model.position_embedding=row_column", "--data.batch_size=4"]),
    "row_column_deep_narrow": ("row + column position embeddings, 6 layers x 96 (3 heads, d_ff 384)",
                               ["--model.position_embedding=row_column", "--model.n_layers=6", "--model.d_model=96",
                                "--model.n_heads=3", "--model.d_ff=384"]),
    "batch32": ("32 images per batch", ["--data.batch_size=32"]),
    # Head width at the committed recipe's settings: linear attention's memory of the past is one
    # (head dim x head dim) state per head, so fewer, wider heads hold more at the same d_model.
    "recipe": ("the committed recipe: row + column, 4 images per batch, RAdam 1.5e-3, 200 warm-up (4 heads of 32)",
               RECIPE_ARGS),
    "recipe_heads2": ("the committed recipe with 2 heads of 64", [*RECIPE_ARGS, "--model.n_heads=2"]),
    "recipe_heads1": ("the committed recipe with 1 head of 128", [*RECIPE_ARGS, "--model.n_heads=1"]),
}
#: Images per batch of the probes that change it.
BATCH = {name: int(arg.split("=")[1]) for name, (_, args) in PROBES.items()
         for arg in args if arg.startswith("--data.batch_size=")}


def updates_of(name: str, args) -> tuple[int, int]:
    """(updates, evaluation interval) of a probe: a probe with B images per batch runs 16 / B times
    the updates, so every probe sees the same images."""
    scale = 16 / BATCH.get(name, 16)
    return round(args.updates * scale), max(1, round(args.eval_every * scale))


def run_probe(name: str, args, out: Path) -> subprocess.Popen:
    root = out / name
    updates, eval_every = updates_of(name, args)
    command = [
        sys.executable, str(REPO / "cli.py"), "fit", "--config", "mnist_cpu_linear.yaml", *BASE_ARGS, *PROBES[name][1],
        f"--trainer.max_steps={updates}", f"--trainer.val_check_interval={eval_every}",
        f"--data.limit_val={args.val_images}", f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false", "--checkpoint.enabled=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def summarize(name: str, root: Path, seconds: float, updates: int) -> dict:
    rows = []
    for metrics in sorted(root.glob("version_*/metrics.csv")):
        with open(metrics) as f:
            rows += [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    val = {int(r["step"]) + 1: r["val/bits_per_dim"] for r in rows if "val/bits_per_dim" in r}
    train = [r["train/bits_per_dim"] for r in rows if "train/bits_per_dim" in r][-2:]
    row = {"probe": name, "change": PROBES[name][0], "seconds_per_update": round(seconds / updates, 2),
           "train_bpd_last": round(sum(train) / len(train), 3) if train else None}
    row.update({f"val_bpd_{step}": round(value, 3) for step, value in sorted(val.items())})
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    parser.add_argument("--updates", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--val-images", type=int, default=256)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--collect", action="store_true", help="write the tables from finished probes, run nothing")
    parser.add_argument("--note", default="", help="a sentence for the report (e.g. what else loaded the machine)")
    parser.add_argument("--workdir", default="logs/mnist_probes")
    parser.add_argument("--out", default=str(results_dir(__file__) / "mnist_probes"))
    args = parser.parse_args(argv)

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    pending, running, rows = ([] if args.collect else list(args.probes)), {}, []
    if args.collect:  # the tables from finished probes in --workdir, nothing run
        for name in args.probes:
            seconds = float((workdir / name / "seconds.txt").read_text())
            rows.append(summarize(name, workdir / name, seconds, updates_of(name, args)[0]))
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            running[name] = (run_probe(name, args, workdir), time.perf_counter())
        time.sleep(5)
        for name, (proc, start) in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                seconds = time.perf_counter() - start
                if proc.returncode != 0:
                    print(f"{name}: exit {proc.returncode}, see {workdir / name}.log", flush=True)
                    continue
                (workdir / name / "seconds.txt").write_text(f"{seconds:.1f}\n")
                rows.append(summarize(name, workdir / name, seconds, updates_of(name, args)[0]))
                print(rows[-1], flush=True)

    write_csv(f"{args.out}.csv", rows)
    steps = sorted({k for r in rows for k in r if k.startswith("val_bpd_")}, key=lambda k: int(k.rsplit("_", 1)[1]))
    header = ["probe", "change", "s/update", "train bits/dim (last)"] + [f"val @{k.rsplit('_', 1)[1]}" for k in steps]
    table = [[r["probe"], r["change"], r["seconds_per_update"], r["train_bpd_last"]] + [r.get(k, "") for k in steps]
             for r in rows]
    info, versions = machine_info(), torch_info()
    Path(f"{args.out}.md").write_text(
        f"# MNIST CPU probes\n\n{info['cpu']}, {info['logical_cpus']} logical CPUs, torch {versions['torch']}, "
        f"{time.strftime('%Y-%m-%d')}, load average at the end {info['loadavg']}.\n\n"
        f"Command: `python benchmarks/dev/mnist_probes.py {' '.join(argv or sys.argv[1:])}`; "
        f"{args.updates} updates each (probes with B images per batch: 16 / B times as many, the same images), "
        f"one torch thread, {args.parallel} probes at a time; validation bits/dim on the "
        f"first {args.val_images} validation images (seconds per update include validation and start-up).\n\n"
        + markdown_table(header, table) + "\n" + (f"\n{args.note}\n" if args.note else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
