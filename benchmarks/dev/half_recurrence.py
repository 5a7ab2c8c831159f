"""The causal op on half-precision CPU inputs: one bf16-autocast training update (forward +
backward) of the numerator on the PyTorch reference (what such inputs ran before the recurrence
took them) and on the C++ recurrence (which runs them as float32), interleaved in one process,
CPU time per update.

    OMP_NUM_THREADS=1 python benchmarks/dev/half_recurrence.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from linformer_lab.ops import kernels

SHAPES = [(16, 8, 4096, 32), (4, 4, 784, 32)]  # a large shape; the MNIST CPU recipe's (configs/mnist_cpu_linear.yaml)


def update(candidate: kernels.Candidate, q, k, v, grad) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = candidate.run(q, k, v)
        out.backward(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    by_name = {c.name: c for c in kernels.CANDIDATES["causal"]}
    for b, h, n, d in SHAPES:
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.rand(b, h, n, d, generator=gen).bfloat16().requires_grad_() for _ in range(2))
        v = torch.randn(b, h, n, d, generator=gen).bfloat16().requires_grad_()
        grad = torch.randn(b, h, n, d, generator=gen).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert kernels.select("causal", q, k, v).name == "recurrence"
        calls = max(1, int(2e6 // (b * h * n * d)))  # repeats per timing: about 2 M inputs' worth
        times = {"reference": [], "recurrence": []}
        for name in times:
            update(by_name[name], q, k, v, grad)  # warm-up: builds, pools, first-touch pages
        for _ in range(args.rounds):
            for name, spent in times.items():
                start = time.process_time()
                for _ in range(calls):
                    update(by_name[name], q, k, v, grad)
                spent.append((time.process_time() - start) / calls * 1e3)
        ref, rec = (statistics.median(times[name]) for name in ("reference", "recurrence"))
        print(f"({b}, {h}, {n}, {d}) bf16 autocast fwd+bwd, {args.threads} thread(s), {calls} calls x "
              f"{args.rounds} rounds: reference {ref:.2f} ms, recurrence {rec:.2f} ms, "
              f"recurrence / reference {rec / ref:.3f}; reference min-max {min(times['reference']):.2f}-"
              f"{max(times['reference']):.2f}, recurrence {min(times['recurrence']):.2f}-{max(times['recurrence']):.2f}")


if __name__ == "__main__":
    main()
