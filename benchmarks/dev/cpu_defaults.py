"""Two CPU micro-benchmarks of the generation path, timed as the library would run them.

    uv run python benchmarks/dev/cpu_defaults.py

1. ``CPU_MATMUL_MIN_ROWS`` (``models/generation/dynamic_step.py``): ``phi(q)^T [S | Z]`` of one fast RNN step
   as a broadcast product + sum against a batched matmul, H = 8, C = 32, M + 1 = 33, batch
   1 ... 256, with one and two intra-op threads.
2. The feed-forward in row blocks: the MNIST model's feed-forward (256 -> 1024 -> GELU -> 256)
   over 25,088 rows (64 images x 392 positions) as one call and in row blocks, without autograd;
   and GELU over the whole intermediate against a plain copy of it. The library no longer runs
   the prefill in row blocks: the gain end to end (0.956x the time of a batch-64 completion) was
   below what a change to a core file must pay (docs/ARCHITECTURE.md, "Where speed code goes").

Medians of ``--repeats`` timed calls after warm-up. Results: ``benchmarks/dev/results/cpu_defaults.{csv,md}``
(reading: benchmarks/NOTES.md, "Which kernels and threads for the RNN step?" and "Feed-forward in
row blocks?").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import machine_info, markdown_table, median_seconds, results_dir, write_csv  # noqa: E402


def step_product(repeats: int) -> list[dict]:
    import torch

    rows = []
    for batch in (1, 4, 16, 64, 256):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            phi_q, joint = torch.rand(batch, 8, 32), torch.rand(batch, 8, 32, 33)
            product_sum = median_seconds(lambda: (phi_q.unsqueeze(-1) * joint).sum(-2), repeats, warmup=20)
            matmul = median_seconds(lambda: torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2), repeats, warmup=20)
            rows.append({"part": "step product", "batch": batch, "threads": threads,
                         "product_sum_us": product_sum * 1e6, "matmul_us": matmul * 1e6})
    return rows


def feedforward_blocks(repeats: int, threads: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(25_088, 256, generator=gen)
    up_w, up_b = torch.randn(1024, 256, generator=gen) / 16, torch.randn(1024, generator=gen)
    down_w, down_b = torch.randn(256, 1024, generator=gen) / 32, torch.randn(256, generator=gen)

    def feedforward(rows):
        return F.linear(F.gelu(F.linear(rows, up_w, up_b)), down_w, down_b)

    def blocked(block):
        return torch.cat([feedforward(x[start:start + block]) for start in range(0, x.shape[0], block)])

    out = []
    out.append({"part": "feed-forward", "what": "one call, 25,088 rows",
                "ms": median_seconds(lambda: feedforward(x), repeats) * 1e3})
    for block in (512, 1024, 2048, 4096):
        out.append({"part": "feed-forward", "what": f"blocks of {block} rows",
                    "ms": median_seconds(lambda block=block: blocked(block), repeats) * 1e3})
    hidden = F.linear(x, up_w, up_b)
    out.append({"part": "feed-forward", "what": "GELU over the (25,088, 1,024) intermediate",
                "ms": median_seconds(lambda: F.gelu(hidden), repeats) * 1e3})
    out.append({"part": "feed-forward", "what": "a copy of that intermediate", "ms": median_seconds(hidden.clone, repeats) * 1e3})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200, help="timed calls of the step product (the feed-forward: a tenth)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of the feed-forward part")
    p.add_argument("--out", default=str(results_dir(__file__) / "cpu_defaults"))
    args = p.parse_args()
    import torch

    from linformer_lab.models.generation import CPU_MATMUL_MIN_ROWS

    with torch.inference_mode():
        products = step_product(args.repeats)
        blocks = feedforward_blocks(max(3, args.repeats // 10), args.threads)
    write_csv(f"{args.out}.csv", products + blocks)
    info = machine_info()
    lines = [
        "# CPU defaults: the RNN step's state product, the feed-forward in row blocks", "",
        f"`benchmarks/dev/cpu_defaults.py --repeats {args.repeats} --threads {args.threads}` ({time.strftime('%Y-%m-%d')}); "
        f"{info['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}. Medians.", "",
        "## phi(q)^T [S | Z] of one RNN step (H = 8, C = 32, M + 1 = 33), µs per call", "",
        f"The library's threshold: the batched matmul from CPU_MATMUL_MIN_ROWS = {CPU_MATMUL_MIN_ROWS} "
        "(batch x head) rows on.", "",
        markdown_table(["batch", "threads", "product + sum", "batched matmul"],
                       [[r["batch"], r["threads"], f"{r['product_sum_us']:.1f}", f"{r['matmul_us']:.1f}"] for r in products]), "",
        f"## MNIST feed-forward without autograd, {args.threads} threads, ms", "",
        markdown_table(["what", "ms"], [[r["what"], f"{r['ms']:.1f}"] for r in blocks]), "",
    ]
    Path(f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
