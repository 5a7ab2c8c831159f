"""Does a trained copy-task model read the future? Teacher-forced copy loss against prefix-only.

Teacher forcing computes every position's prediction in one forward over the whole sequence.
For softmax and linear attention the prediction at position t is a function of tokens <= t
only. lsh is causal per position, but *which* earlier keys share a chunk with position t
depends on where every token hashes, later ones included (``ops/lsh.py``): the token to be
predicted can move chunk borders, so a lsh model can in principle learn to read something of it.

This script measures how much a trained model uses that: for the copy positions of a few
validation batches it computes the loss and copy accuracy three ways,

* teacher-forced: ``model(tokens[:, :-1])``, as training and validation do;
* another future: the prediction at t with every token after t taken from another sequence of
  the batch (same length, same chunking, only the future's content differs);
* prefix-only: the prediction at t from ``model(tokens[:, :t + 1])``, so nothing after t exists,
  as in generation (for lsh this also changes the number of chunks: out of the training
  distribution as well as without the future).

For softmax and linear the three agree to rounding (a control). For lsh, forced against another
future is what its teacher-forced numbers owe to the future's content.

    uv run python benchmarks/dev/copy_prefix_only.py CKPT [CKPT ...] --batches 4 --name copy_prefix_only

The table names each run by the folder above its ``version_N/checkpoints/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import machine_info, results_dir  # noqa: E402

from linformer_lab.attention.config import AttentionConfig  # noqa: E402
from linformer_lab.data.copy import CopyDataModule  # noqa: E402
from linformer_lab.tasks.checkpoint_files import load_checkpoint_header  # noqa: E402
from linformer_lab.tasks.copy_task import CopyTask  # noqa: E402

RESULTS = results_dir(__file__)


@torch.no_grad()
def three_losses(model: CopyTask, tokens: torch.Tensor, mask: torch.Tensor) -> dict:
    """Sums over the copy targets of one batch: cross-entropy and correct argmax, teacher-forced,
    with another future and prefix-only. ``tokens, mask (B, N)``; ``mask`` marks the copy
    positions (the targets)."""
    inputs, targets, is_target = tokens[:, :-1], tokens[:, 1:], mask[:, 1:]
    forced = model(inputs)  # (B, N-1, vocab)
    other, prefix = torch.empty_like(forced), torch.empty_like(forced)
    others = inputs.roll(1, dims=0)  # row r's future from row r-1
    for t in range(inputs.shape[1]):
        if is_target[:, t].any():  # only where some row predicts a copy token
            mixed = torch.cat([inputs[:, : t + 1], others[:, t + 1:]], dim=1)
            other[:, t] = model(mixed)[:, t]
            prefix[:, t] = model(inputs[:, : t + 1])[:, t]
    result = {"count": int(is_target.sum())}
    for name, logits in (("forced", forced), ("other", other), ("prefix", prefix)):
        chosen, wanted = logits[is_target], targets[is_target]
        result[f"{name}_loss"] = float(F.cross_entropy(chosen.double(), wanted, reduction="sum"))
        result[f"{name}_correct"] = int((chosen.argmax(-1) == wanted).sum())
    return result


def measure(checkpoint: Path, batches: int) -> dict:
    # the header first: it refuses a file holding anything but tensors and plain data (which the
    # full load below, weights_only=True too, would also refuse, less clearly)
    saved = load_checkpoint_header(str(checkpoint))  # memory-mapped: the weights are not read yet
    model = CopyTask.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    data_args = {k: v for k, v in saved["datamodule_hyper_parameters"].items() if not k.startswith("_")}
    data = CopyDataModule(**{**data_args, "val_batches": batches, "num_workers": 0})
    data.setup("validate")
    totals: dict = {}
    start = time.perf_counter()
    for tokens, mask in data.val_dataloader():
        for key, value in three_losses(model, tokens, mask).items():
            totals[key] = totals.get(key, 0) + value
    attention = AttentionConfig.coerce(model.hparams.attention)
    n = totals["count"]
    return {
        "checkpoint": checkpoint, "backend": attention.backend + (f" ({attention.kwargs})" if attention.kwargs else ""),
        "updates": saved["global_step"], "targets": n, "seconds": time.perf_counter() - start,
        **{f"{k}_loss": totals[f"{k}_loss"] / n for k in ("forced", "other", "prefix")},
        **{f"{k}_accuracy": totals[f"{k}_correct"] / n for k in ("forced", "other", "prefix")},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path, help="CopyTask checkpoints (.ckpt)")
    parser.add_argument("--batches", type=int, default=4, help="validation batches per checkpoint (default 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="copy_prefix_only", help="writes <out>/<name>.md")
    args = parser.parse_args(argv)
    for path in args.checkpoints:
        if not path.is_file():
            parser.error(f"no checkpoint at {path}")
    rows = [measure(path, args.batches) for path in args.checkpoints]
    lines = [
        "# Copy task: teacher-forced against prefix-only predictions",
        "",
        "Produced by `uv run python benchmarks/dev/copy_prefix_only.py " + " ".join(sys.argv[1:]) + "`",
        f"on {machine_info()['cpu']}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.",
        "",
        "Teacher-forced: one forward over the whole sequence, as in training. Another future: the",
        "prediction at t with the tokens after t taken from another sequence of the batch. Prefix-only:",
        "the prediction at t from the tokens up to t alone, as in generation. All over the copy positions",
        f"of the first {args.batches} validation batches of each checkpoint's data module.",
        "",
        "| run | attention | updates | copy tokens | loss: forced / another future / prefix-only "
        "| accuracy: forced / another future / prefix-only | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        losses = " / ".join(f"{r[f'{k}_loss']:.4f}" for k in ("forced", "other", "prefix"))
        accuracies = " / ".join(f"{r[f'{k}_accuracy']:.4f}" for k in ("forced", "other", "prefix"))
        lines.append(f"| {r['checkpoint'].parent.parent.parent.name} | {r['backend']} | {r['updates']} | {r['targets']} "
                     f"| {losses} | {accuracies} | {r['seconds']:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
