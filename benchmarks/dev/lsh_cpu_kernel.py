"""lsh attention on CPU: the C++ window step (``ops/cpu/lsh_window.cpp``) against the pure-PyTorch
one it replaced (``LINFORMER_LAB_KERNELS=lsh_window=reference``), interleaved in one process.

    uv run python benchmarks/dev/lsh_cpu_kernel.py --threads 1

1. The attention alone, forward + backward, float32: the copy task of Fig. 2 at 1 to 128
   symbols (64 x 2 heads x 256 positions x 32, chunks of 32), the paper's MNIST model (8 heads
   of 32, 783 positions, chunks of 29: run-time sizes) and a long sequence (8 x 4,096 x 32).
2. End to end, one training update (forward, backward, RAdam) of the Fig. 2 model at 1 to 128
   symbols (d_model 64, 2 heads, 4 layers, batch 64, lsh-4), the run that needed this kernel.

Medians of ``--repeats`` interleaved calls (:func:`common.interleaved_medians`). Results:
``benchmarks/dev/results/lsh_cpu_kernel.{csv,md}`` (reading: benchmarks/NOTES.md, "A C++ window step for lsh on CPU?").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import (  # noqa: E402
    command_line,
    forward_backward,
    interleaved_medians,
    load_line,
    machine_info,
    markdown_table,
    results_dir,
    write_csv,
)

PATHS = {"pytorch": "lsh_window=reference", "kernel": ""}
#: (what, batch, heads, positions, head size, chunk)
ATTENTION_SHAPES = [
    ("copy task, 1-128 symbols", 64, 2, 256, 32, 32),
    ("paper MNIST model, batch 4", 4, 8, 783, 32, 29),
    ("long sequence", 1, 8, 4096, 32, 32),
]


def on_path(path: str, fn):
    """``fn`` run with step 4 of lsh attention on ``path`` (the switch is read at every call)."""
    def call():
        os.environ["LINFORMER_LAB_KERNELS"] = PATHS[path]
        return fn()
    return call


def attention_rows(repeats: int) -> list[dict]:
    import torch

    from linformer_lab.ops import kernels
    from linformer_lab.ops.lsh import lsh_attention

    rows = []
    for what, b, h, n, d, chunk in ATTENTION_SHAPES:
        for n_hashes in (1, 4):
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(b, h, n, d, generator=gen, requires_grad=True)
            v = torch.randn(b, h, n, d, generator=gen, requires_grad=True)
            rotations = torch.randn(d, n_hashes, 32, generator=gen)
            grad = torch.randn(b, h, n, d, generator=gen)
            call = forward_backward(lambda: lsh_attention(q, v, rotations, chunk, True, window=kernels.lsh_window),
                                    (q, v), grad)
            timed = interleaved_medians({p: on_path(p, call) for p in PATHS}, repeats)
            rows.append({"part": "attention fwd+bwd", "what": what, "shape": f"{b}x{h}x{n}x{d}", "chunk": chunk,
                         "n_hashes": n_hashes, **{f"{p}_ms": timed[p]["median"] * 1e3 for p in PATHS}})
            print(rows[-1], flush=True)
    return rows


def training_rows(repeats: int) -> list[dict]:
    import numpy as np
    import torch

    from linformer_lab.data.copy import make_copy_batch
    from linformer_lab.tasks.copy_task import CopyTask

    torch.manual_seed(0)
    model = CopyTask(attention={"backend": "lsh", "kwargs": {"n_hashes": 4, "bucket_size": 32, "n_buckets": 64}},
                     d_model=64, n_heads=2, dropout=0.0)
    tokens, mask = make_copy_batch(np.random.default_rng(0), 64, 128, 10)
    optimizer = torch.optim.RAdam(model.parameters(), 1e-3)

    def update():
        loss, _, _ = model.copy_loss(tokens, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    timed = interleaved_medians({p: on_path(p, update) for p in PATHS}, repeats)
    row = {"part": "training update", "what": "Fig. 2 model, 1-128 symbols, lsh-4", "shape": "64x2x256x32", "chunk": 32,
           "n_hashes": 4, **{f"{p}_ms": timed[p]["median"] * 1e3 for p in PATHS}}
    print(row, flush=True)
    return [row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per path and shape")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument("--out", default=str(results_dir(__file__) / "lsh_cpu_kernel"))
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = attention_rows(args.repeats) + training_rows(max(3, args.repeats // 2))
    write_csv(f"{args.out}.csv", rows)
    info = machine_info()
    table = [[r["part"], r["what"], r["shape"], r["chunk"], r["n_hashes"], f"{r['pytorch_ms']:.1f}",
              f"{r['kernel_ms']:.1f}", f"{r['pytorch_ms'] / r['kernel_ms']:.2f}x"] for r in rows]
    lines = [
        "# lsh attention on CPU: the C++ window step against the PyTorch one", "",
        f"`{command_line('benchmarks/dev/lsh_cpu_kernel.py', sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}); "
        f"{info['cpu']}, {os.cpu_count()} logical CPUs, {args.threads} intra-op thread(s), torch {torch.__version__}; "
        f"{load_line()} at the end. Float32, causal; medians of interleaved calls, ms.", "",
        markdown_table(["part", "what", "B x H x N x D", "chunk", "rounds", "PyTorch step", "C++ step", "speed-up"], table),
        "",
    ]
    Path(f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
