"""Figure 2 of the paper (§4.1.1) at CPU scale: copy-task loss curves of softmax, linear, lsh-1, lsh-4.

Every curve is a real training run of the library through the command line,

    python cli.py fit --config configs/copy_<method>.yaml <the overrides below>

so the configs, the CopyTask, the data module and the attention backends are exactly what a user
runs; only the scale is reduced so that all four runs fit in ~5-10 minutes on a shared 2-core CPU:

    paper (Fig. 2, the authors' script)   here (defaults)
    32-62 symbols, the separator and      1-8 symbols (the model reads up to 17 positions)
    their copy: at most 128 positions
    d_model 256 (8 heads x 32)            d_model 64 (8 heads x 8); 4 layers as in the paper
    batch 64                              batch 32
    lr 1e-3 -> 1e-4 after 3000 updates    lr 1e-3 -> 1e-4 after 500 updates, 800 updates in all
    lsh: chunks of 32, 64 buckets         chunks of 4, 4 buckets: as in the paper ~4 positions per
                                          bucket and several chunks (4; paper 8) per sequence

Writes benchmarks/paper/results/<--name>.{csv,png,md} (default figure2_copy): the logged training
loss every 10 updates, the validation loss/accuracy every --val-every, and the exact commands; and
<name>_runs.csv (updates, seconds and command of each run). Run logs go to --log-root/<method>
(default logs/figure2_copy/, emptied first).

    uv run python benchmarks/paper/figure2_copy.py               # the defaults above, 2 runs at a time
    uv run python benchmarks/paper/figure2_copy.py --steps 100   # smoke run

The paper's length as the authors' script has it (``--min-length 32 --max-length 62``), or up to
128 symbols (about twice the paper's positions), two methods at a time (each invocation adds its
methods to the same results with --merge; --max-minutes stops a run at a wall-clock limit and
keeps its curve):

    uv run python benchmarks/paper/figure2_copy.py --name figure2_copy_len62 --min-length 32 --max-length 62 \
        --batch-size 64 --steps 10000 --decay-at 3000 --val-every 500 --val-batches 20 \
        --d-model 64 --n-heads 2 --methods softmax linear --max-minutes 55
    uv run python benchmarks/paper/figure2_copy.py --name figure2_copy_len128 --max-length 128 \
        --batch-size 64 --steps 10000 --decay-at 3000 --val-every 500 --val-batches 20 \
        --bucket-size 32 --n-buckets 64 --methods linear softmax --max-minutes 80
    uv run python benchmarks/paper/figure2_copy.py --name figure2_copy_len128 ... --methods lsh1 lsh4 --merge

On a GPU the paper's own model fits: d_model 256 (8 heads of 32) and the dropout 0.1 of the authors'
script, the four methods at once on one GPU (``--accelerator cuda``; ``--precision`` as Lightning's):

    python benchmarks/paper/figure2_copy.py --name figure2_copy_gpu --accelerator cuda --jobs 4 --dropout 0.1 \
        --min-length 32 --max-length 62 --batch-size 64 --steps 10000 --decay-at 3000 --val-every 500 \
        --val-batches 20 --d-model 256 --n-heads 8 --bucket-size 32 --n-buckets 64

(the committed figure2_copy_gpu.md ran with ``--max-length 128`` instead, before the authors' lengths
were known here).

**The paper's shape, both recipes, fp32 and bf16** (``--paper``; ``figure2_matrix.py``): softmax and
linear at 32-62 symbols, d_model 256 (8 heads), batch 64, dropout 0.1, 10,000 updates, with our
recipe (``configs/copy_*.yaml``) and the authors' (``configs/copy_authors_*.yaml``), each in
``32-true`` and ``bf16-mixed``: eight runs at once on one GPU, each logging its training loss
with dropout (``train/loss``) and, on the same batch and weights, without (``train/loss_no_dropout``).
``--quick`` is the same matrix at toy size on CPU (seconds a run; CI runs it):

    python benchmarks/paper/figure2_copy.py --paper --accelerator cuda --jobs 8 --max-minutes 120
    uv run python benchmarks/paper/figure2_copy.py --quick --out benchmarks/paper/results/figure2_quick

Runs longer than a sitting (lsh at length 128 on a CPU: hours to days): every run writes its
``last.ckpt`` every --save-every updates (default --val-every); ``--resume`` continues each method
from it (a new version in the same folder; a fresh run where there is none), and ``--from-logs``
writes the results from the log folders as they stand, a run still going or killed included (its
seconds: Lightning's Timer in the newest checkpoint, over all invocations; it exists with
--max-minutes, which with --resume is the limit of the whole run):

    uv run python benchmarks/paper/figure2_copy.py --name figure2_copy_len128 ... --methods lsh1 lsh4 \
        --log-root logs/figure2_len128_lsh --save-every 50 --max-minutes 6000 --resume --merge
    uv run python benchmarks/paper/figure2_copy.py --name figure2_copy_len128 ... --methods lsh1 lsh4 \
        --log-root logs/figure2_len128_lsh --save-every 50 --max-minutes 6000 --resume --merge --from-logs
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import figure2_matrix  # noqa: E402 (the helper beside this script: --paper, --quick)
from common import machine_info, metric_rows, results_dir  # noqa: E402

RESULTS = results_dir(__file__)
METHODS = ("softmax", "linear", "lsh1", "lsh4")
COLORS = {"softmax": "tab:blue", "linear": "tab:orange", "lsh1": "tab:green", "lsh4": "tab:red"}


def run_command(method: str, args, log_root: Path) -> list[str]:
    """The ``cli.py fit`` command line of one method."""
    root = log_root / method
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root), "name": ""}}
    recipe = "authors_" if getattr(args, "recipe", "ours") == "authors" else ""
    command = [
        sys.executable, "cli.py", "fit", "--config", f"configs/copy_{recipe}{method}.yaml",
        f"--data.max_length={args.max_length}", f"--data.batch_size={args.batch_size}",
        f"--data.min_length={args.min_length}", f"--model.dropout={args.dropout}",
        f"--data.train_batches_per_epoch={args.steps}", f"--data.val_batches={args.val_batches}",
        f"--model.d_model={args.d_model}", f"--model.n_heads={args.n_heads}", f"--model.lr_decay_steps={args.decay_at}",
        f"--trainer.max_steps={args.steps}", f"--trainer.accelerator={args.accelerator}", "--trainer.devices=1",
        f"--trainer.precision={args.precision}", f"--trainer.val_check_interval={args.val_every}",
        f"--trainer.log_every_n_steps={args.log_every}", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}", f"--trainer.logger={json.dumps(logger)}",
        # last.ckpt only (no best copies), every --save-every updates: the resume point of --resume
        "--checkpoint.save_top_k=0", f"--checkpoint.every_n_train_steps={args.save_every}",
    ]
    if args.max_minutes:
        # Lightning's wall-clock limit: the run stops at the first update past it, its curve kept.
        # Its Timer is restored from the checkpoint, so a resumed run's limit counts the earlier time too.
        days, seconds = divmod(round(args.max_minutes * 60), 24 * 3600)
        hours, seconds = divmod(seconds, 3600)
        minutes, seconds = divmod(seconds, 60)
        command.append(f"--trainer.max_time={days:02d}:{hours:02d}:{minutes:02d}:{seconds:02d}")
    if args.resume and list((REPO / root).glob("version_*/checkpoints/last.ckpt")):
        command.append("--ckpt_path=last")
    if method.startswith("lsh"):
        lsh = {"n_hashes": int(method[3:]), "bucket_size": args.bucket_size, "n_buckets": args.n_buckets}
        command.append(f"--model.attention.kwargs={json.dumps(lsh)}")
    if getattr(args, "loss_without_dropout", False):  # figure2_matrix.py's callback (PYTHONPATH: train())
        callback = {"class_path": "figure2_matrix.LossWithoutDropout"}
        command.append(f"--trainer.callbacks+={json.dumps(callback)}")
    return command


def train(method: str, args, log_root: Path) -> dict:
    command = run_command(method, args, log_root)
    # One intra-op thread per run: on a shared 2-core machine, 2 threads per process make small
    # tensor ops wait on each other (we measured 100x slower element-wise ops under load).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if result.returncode != 0:
        raise RuntimeError(f"{method} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    run = logged_run(method, command, log_root)
    print(f"{method}: {seconds:.0f} s", flush=True)
    return {**run, "seconds": run["seconds"] if run["seconds"] is not None else seconds}


def logged_run(method: str, command: list[str], log_root: Path) -> dict:
    """One method's curve as its run folder holds it: the metrics of every version in numeric order
    (a resumed version re-logs the updates its killed one made past the checkpoint, and wins), and
    its training seconds from the Timer state in the newest ``last.ckpt`` (the time of the updates
    that checkpoint holds, over all invocations; None without a checkpoint or a --max-minutes)."""
    import torch

    root = REPO / log_root / method
    by_step: dict[tuple[int, str], dict] = {}
    for row in metric_rows(root):
        values = {k: float(v) for k, v in row.items() if v != ""}
        kind = "val" if "val/loss" in values else "train"  # a step logs its training loss and, some, a validation
        by_step.setdefault((int(values["step"]), kind), {}).update(values)
    if not by_step:
        raise RuntimeError(f"{method}: no metrics under {root}")
    rows = [by_step[key] for key in sorted(by_step)]
    seconds = None
    checkpoints = sorted(root.glob("version_*/checkpoints/last.ckpt"), key=os.path.getmtime)
    if checkpoints:
        # tensors and plain data only: a checkpoint found under the log root runs no code
        state = torch.load(checkpoints[-1], map_location="cpu", weights_only=True).get("callbacks", {})
        timers = [v for k, v in state.items() if k.startswith("Timer")]
        seconds = timers[0]["time_elapsed"]["train"] if timers else None
    return {"method": method, "command": command, "seconds": seconds, "rows": rows}


def time_limit_seconds(command: list[str]) -> float | None:
    """The ``--trainer.max_time=DD:HH:MM:SS`` of a run's command in seconds, or None."""
    for arg in command:
        if arg.startswith("--trainer.max_time="):
            days, hours, minutes, seconds = (int(x) for x in arg.split("=", 1)[1].split(":"))
            return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return None


def torch_version() -> str:
    import torch

    return torch.__version__


def device_line(args) -> str:
    """Where the runs trained, for the report: the CPU model, and the GPU's name when they ran on one."""
    cpu = f"{machine_info()['cpu']}, {os.cpu_count()} logical CPUs"
    if args.accelerator == "cuda":
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "a GPU (not visible to the report)"
        return f"{gpu} (host: {cpu})"
    return cpu


def updates(run: dict) -> int:
    return max(int(r["step"]) + 1 for r in run["rows"])


KEYS = {"train_loss": "train/loss", "val_loss": "val/loss", "val_accuracy": "val/accuracy",
        "train_loss_no_dropout": "train/loss_no_dropout"}


def earlier_runs(out: Path, name: str, skip: list[str]) -> list[dict]:
    """The runs of other methods in ``<name>.csv`` / ``<name>_runs.csv`` (a previous invocation's), for --merge."""
    if not (out / f"{name}_runs.csv").exists():
        return []
    with open(out / f"{name}_runs.csv") as f:
        runs = {r["method"]: {"method": r["method"], "command": shlex.split(r["command"]), "seconds": float(r["seconds"]),
                              "rows": []} for r in csv.DictReader(f) if r["method"] not in skip}
    with open(out / f"{name}.csv") as f:
        for r in csv.DictReader(f):
            if r["method"] in runs:
                row = {KEYS[k]: float(r[k]) for k in KEYS if r.get(k)}  # older files lack the last column
                runs[r["method"]]["rows"].append({"step": float(r["step"]) - 1, **row})
    return list(runs.values())


def write_results(runs: list[dict], args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = args.name
    # CSV: one row per (method, step) with whatever was logged at that step.
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "step", *KEYS])
        for run in runs:
            merged: dict[int, dict] = {}
            for row in run["rows"]:
                merged.setdefault(int(row["step"]) + 1, {}).update(row)  # step column is 0-based
            for step in sorted(merged):
                r = merged[step]
                values = (f"{r[k]:.5f}" if k in r else "" for k in KEYS.values())
                writer.writerow([run["method"], step, *values])
    with open(out / f"{name}_runs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "updates", "seconds", "command"])
        for run in runs:
            command = shlex.join(["python", *run["command"][1:]])  # the interpreter's path says nothing of the run
            writer.writerow([run["method"], updates(run), f"{run['seconds']:.0f}", command])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Copy accuracy is drawn as its complement on a log scale: near 1 the curves of every method
    # overlap on a linear axis, and 0.99 against 0.999 is the difference Fig. 2 is about. An exact
    # 1.0 (no copied symbol wrong in the validation batches) is drawn at 1e-5.
    fig, (ax_train, ax_val, ax_err) = plt.subplots(1, 3, figsize=(16, 4))

    def curve(run: dict, key: str, value=lambda v: v) -> tuple[list, list]:
        """(updates, values) of one logged metric; two empty lists keep a method in the legend."""
        points = [(int(r["step"]) + 1, value(r[key])) for r in run["rows"] if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    for run in runs:
        m = run["method"]
        label = {"lsh1": "lsh-1", "lsh4": "lsh-4"}.get(m, m)
        ax_train.plot(*curve(run, "train/loss"), color=COLORS[m], label=label, linewidth=1)
        if any("train/loss_no_dropout" in r for r in run["rows"]):
            ax_train.plot(*curve(run, "train/loss_no_dropout"), "--", color=COLORS[m], label=f"{label}, no dropout",
                          linewidth=1)
        ax_val.plot(*curve(run, "val/loss"), "o-", color=COLORS[m], label=label)
        ax_err.plot(*curve(run, "val/accuracy", lambda a: max(1.0 - a, 1e-5)), "o-", color=COLORS[m], label=label)
    panels = ((ax_train, "training loss (every 10 updates)", "cross-entropy on the copy"),
              (ax_val, f"validation loss ({args.val_batches} batches)", "cross-entropy on the copy"),
              (ax_err, "validation copy error (1 - copy accuracy)", "share of copied symbols wrong"))
    for ax, title, ylabel in panels:
        ax.set_yscale("log")
        ax.set_xlabel("gradient steps")
        ax.set_ylabel(ylabel)
        ax.axvline(args.decay_at, color="gray", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    scale = "on a GPU" if args.accelerator == "cuda" else "at CPU scale"
    lengths = f"{args.min_length}-{args.max_length} symbols"
    fig.suptitle(f"Copy task (Fig. 2 {scale}): {lengths}, d_model {args.d_model} "
                 f"({args.n_heads} heads of {args.d_model // args.n_heads}), "
                 f"batch {args.batch_size}")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)

    def last(run, key):
        values = curve(run, key)[1]
        return values[-1] if values else float("nan")

    def mean_last_train(run, n=5):
        values = [r["train/loss"] for r in run["rows"] if "train/loss" in r][-n:]
        return sum(values) / len(values) if values else float("nan")  # a run shorter than the logging interval

    def stopped_by(run):
        if updates(run) >= args.steps:
            return f"{args.steps} updates"
        limit = time_limit_seconds(run["command"])
        if limit is not None and run["seconds"] >= limit - 60:  # stops at the first update past the limit
            return f"time limit ({run['seconds'] / 60:.0f} min)"
        return "not finished (continues with --resume)"  # still going, or stopped by a signal

    methods = [run["method"] for run in runs]
    kept = [m for m in methods if m not in args.methods]  # by --merge, from an earlier invocation
    lines = [
        f"# Figure 2 (copy task) {scale}",
        "",
        "Produced by `" + " ".join(["uv run python benchmarks/paper/figure2_copy.py", *map(shlex.quote, sys.argv[1:])]) + "`"
        + (f" with the runs of {', '.join(kept)} kept from an earlier invocation (--merge)" if kept else "") + ".",
        f"Written on {device_line(args)}, torch {torch_version()}, "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "Paper §4.1.1 (the authors' script): 32-62 symbols of 10, the separator and their copy in at most 128",
        "positions, 4 layers x 8 heads, d_model 256, dropout 0.1, batch 64, RAdam lr 1e-3 -> 1e-4 after 3000 updates;",
        "linear converges smoothly to softmax's loss, lsh stays above.",
        f"Here: {args.min_length} to {args.max_length} symbols, d_model {args.d_model} ({args.n_heads} heads of "
        f"{args.d_model // args.n_heads}), batch {args.batch_size}, at most {args.steps} updates"
        + (f" or {args.max_minutes:g} minutes" if args.max_minutes else "") + ", "
        f"lr drop after {args.decay_at}; "
        + (f"lsh chunks of {args.bucket_size}, {args.n_buckets} buckets; " if any(m.startswith("lsh") for m in methods) else "")
        + f"dropout {args.dropout:g}; "
        + (f"precision {args.precision} on one GPU." if args.accelerator == "cuda" else
           f"precision {args.precision} on CPU, one thread per run."),
        "",
        "Copy accuracy: the share of the symbols of the copied half predicted exactly (argmax).",
        "",
        "| method | updates | stopped by | final val loss | final val copy accuracy | train loss (mean of last 5 logged) "
        "| wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(f"| {run['method']} | {updates(run)} | {stopped_by(run)} | {last(run, 'val/loss'):.4f} | "
                     f"{last(run, 'val/accuracy'):.4f} | {mean_last_train(run):.4f} | {run['seconds']:.0f} s |")
    ranking = sorted(runs, key=lambda run: last(run, "val/loss"))
    lines += [
        "",
        "Final validation loss, lowest first: " + " < ".join(f"{r['method']} ({last(r, 'val/loss'):.3f})" for r in ranking) + ".",
        f"Wall times are of runs sharing the machine ({args.jobs} runs at a time"
        + (", one GPU" if args.accelerator == "cuda" else "") + "), not a speed benchmark.",
    ]
    lines += ["", f"![curves]({name}.png)", "", "Exact commands (run from the repository root, OMP_NUM_THREADS=1):", ""]
    for run in runs:
        shown = ["python", *[a for a in run["command"][1:]]]
        lines += ["```", " ".join(shlex.quote(a) for a in shown), "```"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--decay-at", type=int, default=500, help="update after which lr drops 1e-3 -> 1e-4")
    parser.add_argument("--max-length", type=int, default=8, help="most symbols of a sequence (the model reads 2n+1)")
    parser.add_argument("--min-length", type=int, default=1,
                        help="fewest symbols of a sequence (default 1); the authors' script draws 32-62 symbols, so "
                             "that a whole example fits in 128 positions (configs/copy_*.yaml do the same)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-heads", type=int, default=8,
                        help="attention heads (the paper's 8); each head has d_model / n_heads dimensions")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--bucket-size", type=int, default=4)
    parser.add_argument("--n-buckets", type=int, default=4)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu",
                        help="where every run trains (cuda: all --jobs runs share one GPU)")
    parser.add_argument("--precision", default="32-true", help="Lightning's trainer.precision (default 32-true, fp32)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="the model's dropout (default 0.0; the authors' copy script and configs/copy_*.yaml: 0.1)")
    parser.add_argument("--recipe", choices=("ours", "authors"), default="ours",
                        help="configs/copy_<method>.yaml (ours) or configs/copy_authors_<method>.yaml (linear, softmax)")
    parser.add_argument("--loss-without-dropout", action="store_true",
                        help="also log train/loss_no_dropout: the training loss of the same batch in eval mode")
    parser.add_argument("--paper", action="store_true",
                        help="the paper's shape, both recipes, fp32 and bf16 (figure2_matrix.py; module docstring)")
    parser.add_argument("--quick", action="store_true", help="--paper's matrix at toy size on CPU (seconds a run)")
    parser.add_argument("--recipes", nargs="+", choices=("ours", "authors"), default=["ours", "authors"],
                        help="--paper/--quick: the recipes of the matrix")
    parser.add_argument("--precisions", nargs="+", choices=("32-true", "bf16-mixed"), default=["32-true", "bf16-mixed"],
                        help="--paper/--quick: the precisions of the matrix")
    parser.add_argument("--log-every", type=int, default=10, help="updates between logged training losses")
    parser.add_argument("--log-root", type=Path, default=Path("logs/figure2_copy"),
                        help="where the runs log, relative to the repository root; <root>/<method> is emptied first")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="figure2_copy", help="results are <out>/<name>.{csv,md,png} and <name>_runs.csv")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop each run after this much wall clock (Lightning's max_time), keeping its curve")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite <name>.{md,png} from <name>.csv and <name>_runs.csv (nothing is trained)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other methods' runs already in <name>.csv (runs of an earlier invocation)")
    parser.add_argument("--save-every", type=int, default=None,
                        help="write each run's last.ckpt every this many updates (default: --val-every)")
    parser.add_argument("--resume", action="store_true",
                        help="continue each method's run from the last.ckpt in its log folder (a fresh run where "
                             "there is none) instead of emptying the folder; --max-minutes then counts the earlier time")
    parser.add_argument("--from-logs", action="store_true",
                        help="write the results of --methods from their log folders as they stand (a run still "
                             "going or killed: its updates and seconds up to its last checkpoint); nothing is trained")
    args = parser.parse_args(argv)
    if args.recipe == "authors" and any(m.startswith("lsh") for m in args.methods):
        parser.error("--recipe authors has configs for linear and softmax only (configs/copy_authors_*.yaml)")
    if args.paper or args.quick:
        figure2_matrix.preset(args, parser)
    args.val_every = min(args.val_every, args.steps)
    args.save_every = args.save_every or args.val_every
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.paper or args.quick:
        figure2_matrix.run(args, SimpleNamespace(train=train, write_results=write_results, updates=updates,
                                                 device_line=device_line))
        return
    if args.report_only:
        runs = sorted(earlier_runs(args.out, args.name, skip=[]), key=lambda run: METHODS.index(run["method"]))
        write_results(runs, args, args.out)
        print((args.out / f"{args.name}.md").read_text())
        return

    log_root = args.log_root
    if args.from_logs:
        runs = [logged_run(m, run_command(m, args, log_root), log_root) for m in args.methods]
        for run in runs:
            run["seconds"] = run["seconds"] if run["seconds"] is not None else float("nan")
    else:
        if not args.resume:
            for method in args.methods:  # a fresh version_0 per method: our own scratch space
                shutil.rmtree(REPO / log_root / method, ignore_errors=True)
        print(f"logging runs under {REPO / log_root}", flush=True)
        # The slowest runs first, so the two workers finish together.
        order = sorted(args.methods, key=lambda m: ["lsh4", "linear", "lsh1", "softmax"].index(m))
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            finished = {r["method"]: r for r in pool.map(lambda m: train(m, args, log_root), order)}
        runs = [finished[m] for m in args.methods]
    if args.merge:
        kept = earlier_runs(args.out, args.name, skip=args.methods)
        runs = sorted(kept + runs, key=lambda run: METHODS.index(run["method"]))
    write_results(runs, args, args.out)
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
