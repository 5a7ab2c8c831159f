"""The causal numerator on CPU at C, M that do not fill whole SIMD registers: the register
recurrence on zero-padded inputs against the chunked C++ kernel (causal_dot.cpp) that served
these sizes before, forward+backward, fp32, interleaved in one run.

    uv run python benchmarks/dev/odd_sizes.py                 # 1 and 2 threads, the default shapes
    uv run python benchmarks/dev/odd_sizes.py --threads 1 --repeats 5

Variants per shape (each through autograd, from contiguous (B, H, N, C) inputs):

* ``chunk``: causal_dot.cpp as it was at ``--chunk-rev`` (default: the last commit that has it),
  built from that revision's source under another module name, with its chunk rule
  (32 up to min(C, M) = 32, else 64);
* ``padded``: :func:`linformer_lab.ops.linear_attention.cpu_kernel.causal_dot_product`, what the
  library runs: C and M zero-padded to the register width that ``cpu_kernel.recurrence_dims``
  picks (the fewest vector FMAs per position);
* ``pad<W>``: the recurrence on inputs padded to a multiple of W elements, for every other width
  the CPU has (the check of that choice).

Shapes: head sizes D = 7, 12, 33, 65 (C = M = D), and poly2's features at D = 32 (C = 1 + 32 +
32 * 33 / 2 = 561, M = 32). Results: ``<--out>.{csv,md}`` (default
``benchmarks/dev/results/odd_sizes``): the median per variant and its ratio to ``chunk``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path

import torch  # noqa: E402
from common import REPO, interleaved_medians, markdown_table, provenance, results_dir, write_csv  # noqa: E402

from linformer_lab.ops import cpu  # noqa: E402
from linformer_lab.ops.linear_attention import cpu_kernel  # noqa: E402

CHUNK_SOURCE = "linformer_lab/ops/cpu/causal_dot.cpp"
#: (label, B, H, N, C, M)
SHAPES = [("D=7", 4, 8, 1024, 7, 7), ("D=12", 4, 8, 1024, 12, 12), ("D=33", 4, 8, 1024, 33, 33),
          ("D=65", 2, 8, 1024, 65, 65), ("poly2 D=32", 2, 4, 1024, 561, 32)]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def chunk_revision(rev: str | None) -> str:
    """``rev`` as a commit, or the last commit holding causal_dot.cpp (the parent of the one that
    deleted it)."""
    if rev is not None:
        return git("rev-parse", "--verify", f"{rev}^{{commit}}")
    last = git("log", "-1", "--format=%H", "--", CHUNK_SOURCE)
    exists = subprocess.run(["git", "cat-file", "-e", f"{last}:{CHUNK_SOURCE}"], cwd=REPO, capture_output=True)
    return last if exists.returncode == 0 else git("rev-parse", f"{last}^")


def chunk_extension(rev: str, folder: Path):
    """causal_dot.cpp and the headers beside it at ``rev``, built as its own module."""
    source_dir = Path(CHUNK_SOURCE).parent
    for name in git("ls-tree", "--name-only", f"{rev}:{source_dir}").splitlines():
        if name == "causal_dot.cpp" or name.endswith(".h"):
            (folder / name).write_text(git("show", f"{rev}:{source_dir}/{name}") + "\n")
    return cpu.Extension("linformer_lab_causal_dot_bench", folder / "causal_dot.cpp",
                         "the chunk kernel cannot be timed").load()


def chunk_function(module):
    """causal_dot.cpp's forward and backward as an autograd Function, as the library called it."""

    class ChunkKernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            b, h, n, c = q.shape
            m = v.shape[-1]
            chunk = 32 if min(c, m) <= 32 else 64
            rows = [t.reshape(b * h, n, t.shape[-1]).contiguous() for t in (q, k, v)]
            out, _, states = module.forward(*rows, None, chunk)
            ctx.save_for_backward(*rows, states)
            ctx.chunk, ctx.shape = chunk, (b, h, n)
            return out.view(b, h, n, m)

        @staticmethod
        def backward(ctx, grad):
            qr, kr, vr, states = ctx.saved_tensors
            g = grad.reshape(vr.shape).contiguous()
            gq, gk, gv, _ = module.backward(qr, kr, vr, g, None, states, None, ctx.chunk)
            return gq.view(*ctx.shape, -1), gk.view(*ctx.shape, -1), gv.view(*ctx.shape, -1)

    return ChunkKernel.apply


def padded_to(width: int):
    """The recurrence on inputs zero-padded to multiples of ``width`` elements (C and M)."""

    def run(q, k, v):
        c, m = q.shape[-1], v.shape[-1]
        pad_c, pad_m = -c % width, -m % width
        q, k = (torch.nn.functional.pad(t, (0, pad_c)) for t in (q, k))
        out = cpu_kernel.causal_dot_product(q, k, torch.nn.functional.pad(v, (0, pad_m)))
        return out[..., :m]

    return run


def widths(dtype: torch.dtype) -> list[int]:
    """The register widths (elements) of the instruction set in use, widest first."""
    like = torch.empty(0, dtype=dtype)
    width = cpu.CAUSAL_RECURRENCE.load().width(64, 64, like) // like.element_size()
    found = []
    while width * like.element_size() >= 16:
        found.append(width)
        width //= 2
    return found


def step(fn, inputs, grad):
    def call():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds per shape and thread count")
    parser.add_argument("--chunk-rev", default=None, help="revision of causal_dot.cpp (default: the last one with it)")
    parser.add_argument("--out", default=str(results_dir(__file__) / "odd_sizes"))
    args = parser.parse_args()

    rev = chunk_revision(args.chunk_rev)
    with tempfile.TemporaryDirectory() as folder:
        chunk = chunk_function(chunk_extension(rev, Path(folder)))
    isa = cpu.CAUSAL_RECURRENCE.load().instruction_set()
    header = provenance(__file__, sys.argv[1:], chunk_kernel=f"causal_dot.cpp at {rev[:10]}", instruction_set=isa,
                        rounds=f"medians of {args.repeats} interleaved rounds")
    rows, table = [], []
    started = time.perf_counter()
    for threads in args.threads:
        torch.set_num_threads(threads)
        for label, b, h, n, c, m in SHAPES:
            torch.manual_seed(0)
            inputs = [torch.rand(b, h, n, c, requires_grad=True), torch.rand(b, h, n, c, requires_grad=True),
                      torch.randn(b, h, n, m, requires_grad=True)]
            grad = torch.randn(b, h, n, m)
            dims = cpu_kernel.recurrence_dims(c, m, torch.float32)
            fns = {"chunk": step(chunk, inputs, grad), "padded": step(
                cpu_kernel.causal_dot_product, inputs, grad)}
            for w in widths(torch.float32):
                if (-(-c // w) * w, -(-m // w) * w) != dims:
                    fns[f"pad{w}"] = step(padded_to(w), inputs, grad)
            reference = {}
            for name in ("chunk", "padded"):  # the variants agree before they are timed
                fns[name]()
                reference[name] = [t.grad.clone() for t in inputs]
            for a, e in zip(reference["padded"], reference["chunk"]):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5 * float(e.abs().max()))
            timed = interleaved_medians(fns, args.repeats)
            base = timed["chunk"]["median"]
            for name, result in timed.items():
                ratio = result["median"] / base
                rows.append({"threads": threads, "shape": label, "B": b, "H": h, "N": n, "C": c, "M": m,
                             "variant": name, "padded_dims": "x".join(map(str, dims)) if name == "padded" else "",
                             "median_ms": round(result["median"] * 1e3, 3), "min_ms": round(result["min"] * 1e3, 3),
                             "vs_chunk": round(ratio, 3)})
                table.append([threads, f"{label} ({b}x{h}x{n}, C={c}, M={m})",
                              name + (f" ({dims[0]}x{dims[1]})" if name == "padded" else ""),
                              f"{result['median'] * 1e3:.2f}", f"{ratio:.2f}"])
                print(" | ".join(map(str, table[-1])), flush=True)
    write_csv(args.out + ".csv", rows)
    Path(args.out + ".md").write_text(
        "# Odd C, M: the padded recurrence against causal_dot.cpp (fwd+bwd, fp32)\n\n" + "\n".join(header)
        + f"\n- {time.perf_counter() - started:.0f} s in all\n\n"
        + markdown_table(["threads", "shape", "variant", "fwd+bwd ms", "vs chunk"], table) + "\n")


if __name__ == "__main__":
    main()
