"""The one prepared GPU check of linformer_lab: at most eight minutes on one H100, every target of
the project's GPU-speed issue measured in one run, tables written to ``--out``.

    PYTHONPATH=. python3 benchmarks/paper/gpu_check.py --out DIR           # on a GPU node
    uv run python benchmarks/paper/gpu_check.py --dry-run --out DIR         # every code path, toy sizes, CPU

Parts, in order, each with its share of ``--budget-s`` (unused time passes on) and a check
before every step (a step that would not fit is skipped and listed under "Skipped"):

1. ``tests``: the GPU tests (Triton kernel, CUDA kernel, graphed generation) through pytest;
2. ``kernel``: ours (Triton, fused elu and normaliser), the earlier CUDA kernel, fla's
   ``chunk_linear_attn(normalize=True)`` and SDPA, fwd and fwd+bwd, bf16, interleaved, on the
   issue's grid; the HBM roofline fraction of our forward at B2 T16384 H16 D128
   (``gpu_check_kernel.py``, also runnable alone);
3. ``train``: ``mnist_linear.yaml`` against ``mnist_softmax.yaml`` training images/s, eager and
   compiled (``gpu_check_model.py``);
4. ``generation``: MNIST batch-1 seconds per image, linear against stateful softmax at batch
   1,000 (both graphed), the largest linear batch.

Writes ``gpu_check_<device>.md`` (device, torch/Triton/fla versions, date, command, the targets
table, every table) and ``gpu_check_<device>.csv`` (all rows), plus ``gpu_check_tests.log``.
``--dry-run`` runs all parts at toy sizes on the CPU (Triton interpreted; the eager static
decoder for the graph; no compilation), which ``tests/benchmarks/test_gpu_check.py`` runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (the parts sit beside this script)
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: The GPU test files (their CPU tests run too; a GPU-less machine skips the rest).
GPU_TESTS = ["tests/models/test_generation_graph.py", "tests/ops/test_triton_chunk.py", "tests/ops/test_linear_cuda_gpu.py"]
#: Shares of the budget: tests, kernels, training, generation.
SHARES = {"tests": 0.14, "kernel": 0.30, "train": 0.28, "generation": 0.28}


class Budget:
    """Seconds left for a part; steps that would not fit are recorded as skipped."""

    def __init__(self, seconds: float, skipped: list[str] | None = None):
        self.end = time.monotonic() + seconds
        self.skipped = [] if skipped is None else skipped

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float, what: str) -> bool:
        if self.left() < seconds:
            self.skipped.append(f"{what} (needs ~{seconds:.0f} s, {max(self.left(), 0):.0f} s left)")
            return False
        return True


def device_label(device: str) -> str:
    """``h100`` style name for files: the GPU's model, or ``cpu_dry_run``."""
    if device != "cuda":
        return "cpu_dry_run"
    import torch

    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"[^A-Za-z0-9]+", "_", name)).lower()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(title: str, script: str, argv: list[str], device: str) -> list[str]:
    import torch

    info = common.machine_info()
    where = f"GPU {torch.cuda.get_device_name()}" if device == "cuda" else "CPU (dry run, toy sizes)"
    return [f"# {title}", "",
            f"Date {time.strftime('%Y-%m-%d %H:%M')} UTC; {where}; host {info.get('cpu')}; torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}); Triton {_version('triton')}; fla {_version('flash-linear-attention')}; "
            f"command: `{common.command_line(script, argv)}`", ""]


def part_tests(device: str, budget: Budget, out: Path, dry_run: bool) -> list[dict]:
    if dry_run:
        budget.skipped.append("the GPU tests (no GPU in a dry run; CI runs their CPU parts)")
        return []
    files = [f for f in GPU_TESTS if (REPO / f).exists()]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-x", "-rfE"],
                              cwd=REPO, capture_output=True, text=True, timeout=max(budget.left(), 10), env=env)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text, code = f"{err.stdout or ''}\nstopped after {budget.left():.0f} s", 124
    (out / "gpu_check_tests.log").write_text(text if isinstance(text, str) else text.decode())
    last = ([line for line in str(text).splitlines() if line.strip()] or ["(no output)"])[-1]
    return [{"part": "tests", "method": " ".join(files), "result": last, "exit": code}]


def _best(rows, part, key, **match):
    values = [r[key] for r in rows if r["part"] == part and r.get(key) and all(r.get(k) == v for k, v in match.items())]
    return values


def targets(rows: list[dict]) -> list[list]:
    """The issue's targets table, filled from the rows: ``[what, must, aim, measured, verdict]``."""
    import gpu_check_kernel

    kernel = {}
    for r in rows:
        if r["part"] == "kernel":
            kernel.setdefault((r["B"], r["T"], r["H"], r["D"]), {})[r["method"]] = r
    out = []

    def ratio(ours, other, key, shapes):
        got = [m[ours][f"{key}_ms"] / m[other][f"{key}_ms"] for s, m in kernel.items() if s in shapes
               and m.get(ours, {}).get(f"{key}_ms") and m.get(other, {}).get(f"{key}_ms")]
        return got

    grid = set(gpu_check_kernel.GRID)
    vs_fla = ratio("ours", "fla", "fwd_bwd", grid)
    long = ratio("ours", "fla", "fwd_bwd", {s for s in grid if s[1] >= 8192})
    out.append(["causal fwd+bwd vs fla (ours / fla)", "≤ 1 at every shape", "≤ 0.6 at T ≥ 8,192",
                f"max {max(vs_fla):.2f}, at T ≥ 8,192 max {max(long):.2f}" if vs_fla and long else "not measured",
                _verdict(vs_fla and max(vs_fla) <= 1, long and max(long) <= 0.6)])
    from_4k = ratio("ours", "sdpa", "fwd_bwd", {s for s in grid if s[1] >= 4096})
    from_2k = ratio("ours", "sdpa", "fwd_bwd", {s for s in grid if s[1] >= 2048})
    out.append(["vs SDPA causal fwd+bwd (ours / sdpa)", "< 1 from T = 4,096", "< 1 from T = 2,048",
                f"max from 4,096: {max(from_4k):.2f}; from 2,048: {max(from_2k):.2f}" if from_4k and from_2k else "not measured",
                _verdict(from_4k and max(from_4k) < 1, from_2k and max(from_2k) < 1)])
    roof = [r["fraction"] for r in rows if r["part"] == "roofline"]
    out.append(["B2 T16384 H16 D128 fwd, HBM roofline fraction", "≥ 25 %", "≥ 50 %",
                f"{roof[0]:.1%}" if roof else "not measured", _verdict(roof and roof[0] >= 0.25, roof and roof[0] >= 0.5)])
    train = {(r["config"], r["compile"], r["batch"]): r["images_per_s"] for r in rows if r["part"] == "train"}
    pairs = [(c, b) for (cfg, c, b) in train if cfg == "mnist_linear.yaml" and ("mnist_softmax.yaml", c, b) in train]
    best = max(pairs, key=lambda p: train[("mnist_linear.yaml", *p)], default=None)
    if best:
        lin, soft = train[("mnist_linear.yaml", *best)], train[("mnist_softmax.yaml", *best)]
        out.append(["mnist_linear vs mnist_softmax training images/s", "≥ 1.0×", "≥ 1,500 images/s",
                    f"{lin / soft:.2f}× ({lin:.0f} vs {soft:.0f}; compile={best[0]}, batch {best[1]})",
                    _verdict(lin / soft >= 1.0, lin >= 1500)])
    else:
        out.append(["mnist_linear vs mnist_softmax training images/s", "≥ 1.0×", "≥ 1,500 images/s", "not measured", "—"])
    latency = _best(rows, "generation", "seconds_per_image", method="linear", role="latency")
    out.append(["MNIST batch-1 generation, s per image (linear, best decoder)", "≤ 0.15", "≤ 0.05",
                f"{min(latency):.3f}" if latency else "not measured", _verdict(latency and min(latency) <= 0.15,
                                                                             latency and min(latency) <= 0.05)])
    big = [r for r in rows if r["part"] == "generation" and r["role"] == "largest"]
    top = max(big, key=lambda r: r["images_per_s"], default=None)
    out.append(["MNIST generation at the largest batch, images/s", "≥ 5,000", "≥ 20,000",
                f"{top['images_per_s']:.0f} (batch {top['batch']}, {top['step_weights']})" if top else "not measured",
                _verdict(top and top["images_per_s"] >= 5000, top and top["images_per_s"] >= 20000)])
    mid = {(r["method"], r["step_weights"]): r["images_per_s"] for r in rows
           if r["part"] == "generation" and r["role"] == "batch 1,000" and r["decoder"] in ("graph", "static")}
    ratios = [(w, mid["linear", w] / mid["stateful-softmax", w]) for w in ("model", "bfloat16")
              if ("linear", w) in mid and ("stateful-softmax", w) in mid]
    out.append(["linear ÷ stateful-softmax images/s at batch 1,000 (both graphed)", "≥ 5×", "≥ 19×",
                "; ".join(f"{r:.2f}× ({w})" for w, r in ratios) if ratios else "not measured",
                _verdict(ratios and max(r for _, r in ratios) >= 5, ratios and max(r for _, r in ratios) >= 19)])
    return out


def _verdict(must, aim) -> str:
    """``must``/``aim``: booleans, or an empty value where nothing was measured."""
    if not isinstance(must, bool):
        return "—"
    return "aim met" if aim is True else "met" if must else "NOT met"


def report(rows: list[dict], skipped: list[str], args, device: str) -> list[str]:
    import gpu_check_kernel
    import gpu_check_model

    md = header("GPU check", "benchmarks/paper/gpu_check.py", args.argv, device)
    md += ["## Targets (the GPU-speed issue; ratios from this run)", "",
           common.markdown_table(["what", "must", "aim", "measured", "verdict"], targets(rows)), ""]
    md += ["## Tests", ""] + [f"- `{r['method']}`: {r['result']} (exit {r['exit']})" for r in rows if r["part"] == "tests"]
    md += [""] + gpu_check_kernel.report_lines(rows)
    md += ["## Training (images/s; an update = training_step, backward, RAdam; bf16 autocast on a GPU)", "",
           common.markdown_table(["config", "compile", "batch", "updates", "ms/update", "images/s", "warm-up s",
                                  "GPU kernels per update"],
                                 gpu_check_model.training_table(rows)), "",
           "## Generation (MNIST model, random weights; one whole generate call per sample, median)", "",
           common.markdown_table(["role", "method", "batch", "decoder", "step weights", "s per call", "s per image", "images/s"],
                                 gpu_check_model.generation_table(rows)), ""]
    return md + ["## Skipped", ""] + [f"- {s}" for s in skipped or ["nothing"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the result files")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (what the tests run)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds for all parts (default 420)")
    parser.add_argument("--parts", nargs="+", choices=list(SHARES), default=list(SHARES))
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.dry_run:  # before anything imports Triton: the kernels run in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import gpu_check_kernel
    import gpu_check_model
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU node, or add --dry-run for the CPU toy run")
    device = "cpu" if args.dry_run else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    end, skipped, rows = time.monotonic() + args.budget_s, [], []
    parts = {"tests": lambda b: part_tests(device, b, args.out, args.dry_run),
             "kernel": lambda b: gpu_check_kernel.measure(device, b, args.dry_run)[1],
             "train": lambda b: gpu_check_model.training(device, b, args.dry_run),
             "generation": lambda b: gpu_check_model.generation(device, b, args.dry_run)}
    names = [p for p in SHARES if p in args.parts]
    for i, name in enumerate(names):
        left = end - time.monotonic()
        share = left * SHARES[name] / sum(SHARES[p] for p in names[i:])
        start = time.monotonic()
        try:
            rows += parts[name](Budget(share, skipped))
        except Exception as err:  # noqa: BLE001 - one part's failure must not cost the others' results
            skipped.append(f"part {name} failed: {type(err).__name__}: {str(err)[:300]}")
        print(f"== {name}: {time.monotonic() - start:.0f} s of {share:.0f} s ==", flush=True)
    stem = args.out / f"gpu_check_{device_label(device)}"
    md = report(rows, skipped, args, device)
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    common.write_csv(str(stem.with_suffix(".csv")), rows)
    table = md.index("## Targets (the GPU-speed issue; ratios from this run)")
    print("\n".join(md[table:table + 11]))
    print("\n".join(f"skipped: {s}" for s in skipped))
    print(f"wrote {stem}.md and {stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
