"""The elu feature map's gradient: an autograd Function with a written-out backward against plain
autograd, per training update, interleaved in one process.

    uv run python benchmarks/dev/elu_function.py
    uv run python benchmarks/dev/elu_function.py --models mnist --repeats 5

Variants of ``EluFeatureMap.forward`` (fp32, same values; each swapped in before its call):

* ``function``: an ``autograd.Function`` whose forward is ``where(x > 0, x + 1, exp(x))`` and whose
  backward is ``grad * min(phi, 1)`` from the saved output (the library's ``EluPlusOne``, copied
  here so the script times it whatever the library holds);
* ``where``: ``where(x > 0, x + 1, exp(min(x, 0)))`` through autograd (the clamp keeps exp of
  the unused branch finite, so its zero gradient stays zero, not 0 * inf);
* ``elu+1``: ``F.elu(x) + 1`` through autograd (eq. 7 as written; phi rounds to 0 below about
  -17 in fp32, and sooner in half precision, which the two above avoid).

Updates (forward, backward, clipping, RAdam; fp32, random data, seed 0, the C++ causal kernel on):
``mnist``: the paper's MNIST model (``configs/mnist_linear.yaml``: 8 layers, 8 heads, d_model 256,
784 positions, batch 10); ``copy``: the copy task of ``configs/copy_linear.yaml`` (4 layers, 8
heads, d_model 256, batch 64, 32-62 symbols, 124 positions). Results: ``<--out>.{csv,md}``
(default ``benchmarks/dev/results/elu_function``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from common import (  # noqa: E402
    REPO,
    image_training_update,
    interleaved_medians,
    markdown_table,
    provenance,
    results_dir,
    write_csv,
)

from linformer_lab.data.copy import make_copy_batch  # noqa: E402
from linformer_lab.feature_maps.elu import EluFeatureMap  # noqa: E402
from linformer_lab.tasks.copy_task import CopyTask  # noqa: E402


class EluWrittenOut(torch.autograd.Function):
    """phi = elu(x) + 1 with the backward grad * min(phi, 1), which needs only phi."""

    @staticmethod
    def forward(ctx, x):
        out = torch.where(x > 0, x + 1, torch.exp(x))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out.clamp(max=1)


VARIANTS = {
    "function": EluWrittenOut.apply,
    "where": lambda x: torch.where(x > 0, x + 1, torch.exp(x.clamp_max(0.0))),
    "elu+1": lambda x: torch.nn.functional.elu(x) + 1,
}


def copy_update():
    """One training update of the copy model of configs/copy_linear.yaml (dropout as configured)."""
    with open(REPO / "configs" / "copy_linear.yaml") as f:
        spec = yaml.safe_load(f)
    data = spec["data"]["init_args"]
    torch.manual_seed(0)
    task = CopyTask(**{**spec["model"]["init_args"], "vocab_size": data["num_symbols"] + 2,
                       "sequence_length": 2 * data["max_length"] + 1})
    tokens, mask = make_copy_batch(np.random.default_rng(0), data["batch_size"], data["max_length"],
                                   data["num_symbols"], data["min_length"])
    optimizer = torch.optim.RAdam(task.parameters(), lr=1e-4)

    def update():
        optimizer.zero_grad(set_to_none=True)
        loss, _, _ = task.copy_loss(tokens, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), 1.0)
        optimizer.step()

    return update


def with_variant(update, phi):
    def call():
        original = EluFeatureMap.forward
        EluFeatureMap.forward = lambda self, x: phi(x)
        try:
            update()
        finally:
            EluFeatureMap.forward = original
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["mnist", "copy"], default=["mnist", "copy"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds per model")
    parser.add_argument("--out", default=str(results_dir(__file__) / "elu_function"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, table = [], []
    started = time.perf_counter()
    header = provenance(__file__, sys.argv[1:], rounds=f"medians of {args.repeats} interleaved rounds per model")
    for model in args.models:
        update = image_training_update("mnist_linear.yaml")[0] if model == "mnist" else copy_update()
        timed = interleaved_medians({name: with_variant(update, phi) for name, phi in VARIANTS.items()}, args.repeats)
        base = timed["function"]["median"]
        for name, result in timed.items():
            rows.append({"model": model, "variant": name, "median_ms": round(result["median"] * 1e3, 1),
                         "min_ms": round(result["min"] * 1e3, 1), "vs_function": round(result["median"] / base, 3)})
            table.append([model, name, f"{result['median'] * 1e3:.0f}", f"{result['min'] * 1e3:.0f}",
                          f"{result['median'] / base:.3f}"])
            print(" | ".join(table[-1]), flush=True)
    write_csv(args.out + ".csv", rows)
    Path(args.out + ".md").write_text(
        "# The elu map's written-out backward against autograd, per training update (fp32)\n\n" + "\n".join(header)
        + f"\n- {time.perf_counter() - started:.0f} s in all\n\n"
        + markdown_table(["model", "variant", "median ms", "min ms", "median / function"], table) + "\n")


if __name__ == "__main__":
    main()
