"""Fig. 2 (the copy task) at the paper's shape as a matrix of runs, ``figure2_copy.py --paper``:
our recipe and the authors' (configs/copy_*.yaml, configs/copy_authors_*.yaml), in fp32 and bf16,
softmax and linear, all through ``cli.py fit`` at once; each run also logs its training loss
without dropout (:class:`LossWithoutDropout`). ``--quick`` runs the same matrix at toy size on
the CPU (what tests/benchmarks/test_figure2_copy.py runs).

Writes, under ``--out``: for each recipe and precision the figure2_copy report
(``<name>_<recipe>_<fp32|bf16>.{csv,md,png}``, ``..._runs.csv``), and ``<name>.md`` /
``<name>_summary.csv``: one row per run (updates, seconds, the last training losses with and
without dropout, the final validation loss and copy accuracy), the recipes side by side.
"""

from __future__ import annotations

import copy
import csv
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[2]
#: The paper's copy task (§4.1.1, the authors' script): 32-62 symbols, 4 layers x 8 heads of 32,
#: batch 64, lr 1e-3 -> 1e-4 after 3,000 updates, dropout 0.1, 10,000 updates.
PAPER = dict(min_length=32, max_length=62, d_model=256, n_heads=8, batch_size=64, steps=10000, decay_at=3000,
             val_every=500, val_batches=20, dropout=0.1)
#: The same matrix at toy size: seconds a run on a CPU.
QUICK = dict(min_length=2, max_length=6, d_model=16, n_heads=2, batch_size=4, steps=4, decay_at=2, val_every=2,
             val_batches=1, dropout=0.1, accelerator="cpu", log_every=1)
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16"}
METHODS = ["softmax", "linear"]  # the methods with an authors' config


class LossWithoutDropout(L.Callback):
    """Logs ``train/loss_no_dropout`` at the steps Lightning logs: the training loss of the batch
    about to be trained on, computed first in eval mode (every dropout off), with the same weights
    and the precision's autocast; beside ``train/loss``, which the update computes with dropout."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1):  # Lightning drops step metrics between logs
            return
        tokens, target_mask = batch
        pl_module.eval()
        try:
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                loss, _, _ = pl_module.copy_loss(tokens, target_mask,
                                                 score_separator=pl_module.hparams.get("score_separator", False))
        finally:
            pl_module.train()
        pl_module.log("train/loss_no_dropout", loss, batch_size=len(tokens))


def preset(args, parser) -> None:
    """``--paper`` / ``--quick``: their sizes where the command line kept the defaults (a flag
    given wins), softmax and linear, the no-dropout loss, their own names."""
    for key, value in (QUICK if args.quick else PAPER).items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)
    if args.methods == parser.get_default("methods"):
        args.methods = list(METHODS)
    args.loss_without_dropout = True
    kind = "quick" if args.quick else "paper"
    if args.name == parser.get_default("name"):
        args.name = f"figure2_{kind}"
    if args.log_root == parser.get_default("log_root"):
        args.log_root = Path(f"logs/figure2_{kind}")


def variants(args) -> list[tuple[object, Path]]:
    """``(args of one recipe and precision, its log root)`` for every cell of the matrix."""
    out = []
    for recipe in args.recipes:
        for precision in args.precisions:
            label = PRECISIONS[precision]
            variant = copy.copy(args)
            variant.recipe, variant.precision, variant.name = recipe, precision, f"{args.name}_{recipe}_{label}"
            out.append((variant, args.log_root / f"{recipe}_{label}"))
    return out


def _mean_last(run: dict, key: str, n: int = 5) -> float | None:
    values = [r[key] for r in run["rows"] if key in r][-n:]
    return sum(values) / len(values) if values else None


def _last(run: dict, key: str) -> float | None:
    values = [r[key] for r in run["rows"] if key in r]
    return values[-1] if values else None


def run(args, script) -> list[dict]:
    """Train the matrix (``--jobs`` runs at a time), write every report; returns the summary rows.
    ``script``: figure2_copy.py's ``train``, ``write_results``, ``updates`` and ``device_line``."""
    cells = variants(args)
    jobs = []
    for variant, root in cells:
        for method in args.methods:
            if not args.resume:
                shutil.rmtree(REPO / root / method, ignore_errors=True)
            jobs.append((variant, root, method))

    def train(job):
        variant, root, method = job
        try:
            return script.train(method, variant, root), None
        except RuntimeError as err:  # one failed run is reported; the others' curves are kept
            return None, str(err).strip().splitlines()[0][:300]

    print(f"{len(jobs)} runs, {args.jobs} at a time, logging under {REPO / args.log_root}", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        finished = list(pool.map(train, jobs))
    summary = []
    for variant, _ in cells:
        runs = []
        for (job_variant, _, method), (result, error) in zip(jobs, finished):
            if job_variant is not variant:
                continue
            row = {"recipe": variant.recipe, "precision": variant.precision, "method": method}
            if result is None:
                summary.append({**row, "error": error})
                continue
            runs.append(result)
            summary.append({**row, "updates": script.updates(result), "seconds": result["seconds"],
                            "train_loss": _mean_last(result, "train/loss"),
                            "train_loss_no_dropout": _mean_last(result, "train/loss_no_dropout"),
                            "val_loss": _last(result, "val/loss"), "val_accuracy": _last(result, "val/accuracy")})
        if runs:
            script.write_results(runs, variant, args.out)
    write_summary(summary, args, script.device_line(args))
    return summary


FIELDS = ["recipe", "precision", "method", "updates", "seconds", "train_loss", "train_loss_no_dropout", "val_loss",
          "val_accuracy", "error"]


def write_summary(summary: list[dict], args, device: str) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{args.name}_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(summary)

    def cell(value, digits=4):
        return "—" if value is None else f"{value:.{digits}f}"

    lines = [f"# Figure 2 (copy task): our recipe and the authors', fp32 and bf16{' (quick: toy size)' if args.quick else ''}",
             "", "Produced by `python benchmarks/paper/figure2_copy.py " + shlex.join(sys.argv[1:]) + "` on "
             f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.", "",
             f"{args.min_length}-{args.max_length} symbols, d_model {args.d_model} ({args.n_heads} heads), batch "
             f"{args.batch_size}, dropout {args.dropout:g}, at most {args.steps} updates"
             + (f" or {args.max_minutes:g} minutes" if args.max_minutes else "") + f", {args.jobs} runs at a time. "
             "Ours: configs/copy_<method>.yaml; the authors': configs/copy_authors_<method>.yaml (per-parameter "
             "clipping 1.0, decoupled weight decay 0.01, attention dropout 0.1 for softmax, post-norm + ReLU, a "
             "concatenated sinusoid, the separator scored in the training loss, so its training loss has a floor "
             "the copy alone has not). Training losses: the mean of the last 5 logged, with dropout (as trained) and "
             "without (the same batches in eval mode); validation: the copy alone, comparable across recipes.", "",
             "| recipe | precision | method | updates | train loss | train loss, no dropout | val loss | "
             "val copy accuracy | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['precision']} | {r['method']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['recipe']} | {r['precision']} | {r['method']} | {r['updates']} | {cell(r['train_loss'])} | "
                     f"{cell(r['train_loss_no_dropout'])} | {cell(r['val_loss'])} | {cell(r['val_accuracy'])} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", "Each recipe and precision: `" + f"{args.name}_<recipe>_<fp32|bf16>.md" + "` (curves, commands)."]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
