"""Code at a git revision against the working tree, interleaved in one run (the before/after check of a hot-path change).

    uv run python benchmarks/dev/compare_revisions.py generate --rev HEAD~1
    uv run python benchmarks/dev/compare_revisions.py generate --rev HEAD~1 --batch 64 --rounds 3
    uv run python benchmarks/dev/compare_revisions.py causal --rev HEAD~1
    uv run python benchmarks/dev/compare_revisions.py train --rev HEAD~1 --config mnist_cpu_linear.yaml
    uv run python benchmarks/dev/compare_revisions.py triton-host --rev 10c4e5b

Its result files are git-ignored: a before/after run belongs to one commit, whose message carries
its figures (and NOTES.md the ones a decision rests on).

Both measurements resolve ``--rev`` to a commit once (HEAD may move on while they run) and put
the package as it was there in a temporary folder (``git archive``); "old" is that copy, "new"
the working tree.

``generate``: ``PixelTransformer.generate``, for changes to the generation path (the RNN step,
sampling, prefill). Each round runs one child process per variant (old, new, alternating, so a
change of machine load hits both alike), with ``PYTHONPATH`` on that variant's package. A child
builds the paper's MNIST model (8 layers, 8 heads, d_model 256, 10 logistics, linear attention,
seed 0; untrained: the cost does not depend on the weights), warms up, and times ``--calls``
completions of the bottom half given the top half, with the prefix prefilled in one pass
(``prefill=True``) and stepped (``prefill=False``). Reported: the median over rounds of each
child's median, and new/old time ratios. Results: ``<--out>_batch<B>.{csv,md}``
(default ``benchmarks/dev/results/generate_revisions_batch<B>``).

``causal``: the causal Function (``linformer_lab/ops/linear_attention/chunk.py``) as it was at
``--rev``, loaded beside the working tree's in this process, forward+backward of the causal
numerator at a few shapes:

* ``old``: the Function at ``--rev``;
* ``new``: the working tree's, called as before (no state);
* ``new+state``: the working tree's with an initial state and the final state returned (and
  a gradient flowing into both).

Calls rotate between the variants (interleaved_medians), so load changes hit all alike.
Results: ``<--out>.{csv,md}`` (default ``benchmarks/dev/results/causal_state_overhead``).

``train``: one training update (forward, backward, gradient clipping, RAdam) of the image model of
``configs/<--config>`` at its batch size, fp32, random images; child processes per variant
alternating, as ``generate``. Results: ``<--out>_<config stem>.{csv,md}`` (default
``benchmarks/dev/results/train_revisions_<config stem>``).

``triton-host``: the Triton chunk operator's host side per forward+backward, its kernel launches
stubbed (Triton's interpreter runs nothing): the launches counted and the host Python timed
(thread CPU time, median of ``--calls``), child processes per variant alternating, as ``generate``.
What a GPU's launch path adds per call beyond this (Triton's argument binding, or the direct path
that skips it) needs a GPU. Results: ``<--out>.{csv,md}`` (default
``benchmarks/dev/results/triton_host_revisions``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import (  # noqa: E402
    Timer,
    export_revision,
    image_training_update,
    interleaved_medians,
    machine_info,
    markdown_table,
    resolve_commit,
    results_dir,
    write_csv,
)

RESULTS = results_dir(__file__)
DEFAULT_OUT = {"generate": RESULTS / "generate_revisions", "causal": RESULTS / "causal_state_overhead",
               "train": RESULTS / "train_revisions", "triton-host": RESULTS / "triton_host_revisions"}
VARIANTS = ("old", "new")
MODES = ("prefill", "stepped")
CHUNK_FILE = "linformer_lab/ops/linear_attention/chunk.py"
SHAPES = [(4, 8, 784, 32, 32), (1, 8, 4096, 32, 32), (4, 8, 4096, 64, 64), (1, 8, 16384, 32, 32)]


# ---------------------------------------------------------------- the revision (shared)


def command_line(args, options: str) -> str:
    """The command as it was given, ``--out`` relative to the repository and only when not the default."""
    out_option = "" if Path(args.out).resolve() == DEFAULT_OUT[args.what] else f" --out {os.path.relpath(args.out, REPO)}"
    return f"`benchmarks/dev/compare_revisions.py {args.what} --rev {args.rev}{options}{out_option}`"


# ---------------------------------------------------------------- generate: child processes per variant


def generate_child(batch: int, calls: int, threads: int) -> dict:
    """Runs in a process whose ``linformer_lab`` is one variant's; returns the medians."""
    import torch

    from linformer_lab.models.pixel_transformer import PixelTransformer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = PixelTransformer("linear", n_layers=8, n_heads=8, d_model=256, d_ff=1024, num_mixtures=10).eval()
    prefix = torch.randint(0, 256, (batch, 1, 14, 28), dtype=torch.uint8)
    seconds = {mode: [] for mode in MODES}
    for call in range(calls + 1):  # the first call of each mode warms up
        for mode in MODES:
            start = time.perf_counter()
            model.generate(batch, 1.0, prefix=prefix, prefill=mode == "prefill", generator=torch.Generator().manual_seed(call))
            if call:
                seconds[mode].append(time.perf_counter() - start)
    import linformer_lab

    package = str(Path(linformer_lab.__file__).parents[1])
    return {"package": package, **{mode: statistics.median(s) for mode, s in seconds.items()}}


def train_child(config: str, updates: int, threads: int) -> dict:
    """Runs in a process whose ``linformer_lab`` is one variant's; returns the median seconds per update."""
    import torch

    torch.set_num_threads(threads)
    update, _, _ = image_training_update(config)
    update()  # warm-up
    seconds = [Timer("cpu")(update) for _ in range(updates)]
    import linformer_lab

    return {"package": str(Path(linformer_lab.__file__).parents[1]), "update": statistics.median(seconds)}


def triton_host_child(calls: int, shape: tuple[int, ...]) -> dict:
    """Runs in a process whose ``linformer_lab`` is one variant's, under Triton's interpreter with
    every launch a no-op: launches per forward and backward, and the median host seconds of one."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    from triton.runtime import interpreter

    from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention

    launches = []
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: launches.append(1)
    # the stubbed kernels leave their outputs uninitialised: arithmetic on them (denormals) is no
    # part of the host path, so nothing reads them (no accumulation into .grad)
    torch.set_flush_denormal(True)
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    grad = torch.ones(shape)
    seconds = []
    for call in range(calls + 3):  # three warm-up calls
        launches.clear()
        began = time.thread_time()
        out = chunk_linear_attention(q, k, v)
        forward = len(launches)
        torch.autograd.grad(out, (q, k, v), grad)
        if call >= 3:
            seconds.append(time.thread_time() - began)
    import linformer_lab

    return {"package": str(Path(linformer_lab.__file__).parents[1]), "host": statistics.median(seconds),
            "forward_launches": forward, "backward_launches": len(launches) - forward}


def run_triton_host(args) -> None:
    with tempfile.TemporaryDirectory(prefix="compare_revisions_") as folder:
        runs = run_rounds(args, {"old": export_revision(args.commit, folder), "new": str(REPO)},
                          ["--calls", str(args.calls), "--shape", args.shape])
    median = {v: statistics.median(r["host"] for r in runs[v]) for v in VARIANTS}
    launches = {v: f"{runs[v][-1]['forward_launches']} + {runs[v][-1]['backward_launches']}" for v in VARIANTS}
    info = machine_info()
    write_csv(f"{args.out}.csv", [{"variant": v, "host_us": median[v] * 1e6, "launches": launches[v]} for v in VARIANTS])
    lines = [
        f"# Host side of the Triton chunk operator at {args.rev} = {args.commit} (old) and the working tree (new)", "",
        command_line(args, f" --rounds {args.rounds} --calls {args.calls} --shape {args.shape}")
        + f" ({time.strftime('%Y-%m-%d')}); {info['cpu']}, 1 thread; (B, H, T, D) = ({args.shape}), fp32, launches "
        "stubbed under Triton's interpreter; thread CPU time per forward+backward (median over rounds of each "
        "child's median).", "",
        markdown_table(["variant", "host us per fwd+bwd", "launches fwd + bwd"],
                       [[v, f"{median[v] * 1e6:.0f}", launches[v]] for v in VARIANTS]), "",
        f"new / old: {median['new'] / median['old']:.3f}", "",
    ]
    Path(f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def run_generate(args) -> None:
    with tempfile.TemporaryDirectory(prefix="compare_revisions_") as folder:
        runs = run_rounds(args, {"old": export_revision(args.commit, folder), "new": str(REPO)},
                          ["--batch", str(args.batch), "--calls", str(args.calls)])
    write_generate_results(args, runs)


def run_train(args) -> None:
    with tempfile.TemporaryDirectory(prefix="compare_revisions_") as folder:
        runs = run_rounds(args, {"old": export_revision(args.commit, folder), "new": str(REPO)},
                          ["--config", args.config, "--updates", str(args.updates)])
    median = {v: statistics.median(r["update"] for r in runs[v]) for v in VARIANTS}
    info = machine_info()
    out = Path(f"{args.out}_{Path(args.config).stem}")
    write_csv(str(out.with_suffix(".csv")), [{"config": args.config, "old_s": median["old"], "new_s": median["new"],
                                              "new_over_old": median["new"] / median["old"], "rounds": args.rounds}])
    lines = [
        f"# One training update at {args.rev} = {args.commit} (old) and the working tree (new), interleaved", "",
        command_line(args, f" --config {args.config} --rounds {args.rounds} --updates {args.updates}")
        + f" ({time.strftime('%Y-%m-%d')}); {info['cpu']}, {os.cpu_count()} cores, {args.threads} torch threads. "
        f"configs/{args.config}'s model and batch, fp32, random images; seconds per update (median over rounds of each "
        "child's median).", "",
        markdown_table(["config", "old s", "new s", "new / old"],
                       [[args.config, f"{median['old']:.3f}", f"{median['new']:.3f}", f"{median['new'] / median['old']:.3f}"]]),
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def run_rounds(args, roots: dict[str, str], child_options: list[str]) -> dict[str, list[dict]]:
    """``--rounds`` rounds of one child process per variant (old, new), each with ``PYTHONPATH`` on its package."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            env = {**os.environ, "PYTHONPATH": roots[variant]}
            command = [sys.executable, __file__, args.what, "--child", "--threads", str(args.threads), *child_options]
            out = subprocess.run(command, env=env, cwd=roots[variant], capture_output=True, text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            if Path(runs[variant][-1]["package"]).resolve() != Path(roots[variant]).resolve():
                raise RuntimeError(f"the {variant} child imported linformer_lab from {runs[variant][-1]['package']}, "
                                   f"not {roots[variant]}")
            print(f"round {round_ + 1} {variant}: {runs[variant][-1]}", flush=True)
    return runs


def write_generate_results(args, runs: dict[str, list[dict]]) -> None:
    median = {v: {m: statistics.median(r[m] for r in runs[v]) for m in MODES} for v in VARIANTS}
    rows = [{"mode": m, "old_s": median["old"][m], "new_s": median["new"][m], "new_over_old": median["new"][m] / median["old"][m]}
            for m in MODES]
    rows.append({"mode": "stepped / prefill", "old_s": median["old"]["stepped"] / median["old"]["prefill"],
                 "new_s": median["new"]["stepped"] / median["new"]["prefill"], "new_over_old": float("nan")})
    info = machine_info()
    import torch

    out = Path(f"{args.out}_batch{args.batch}")
    write_csv(str(out.with_suffix(".csv")), rows)
    table = [[r["mode"], f"{r['old_s']:.3f}", f"{r['new_s']:.3f}",
              "" if r["mode"].startswith("stepped /") else f"{r['new_over_old']:.3f}"] for r in rows]
    lines = [
        f"# generate() at {args.rev} = {args.commit} (old) and the working tree (new), interleaved", "",
        command_line(args, f" --batch {args.batch} --rounds {args.rounds} --calls {args.calls}") + " "
        f"({time.strftime('%Y-%m-%d')}); {info['cpu']}, {os.cpu_count()} cores, {args.threads} torch threads, "
        f"torch {torch.__version__}. Paper MNIST model, linear attention, completion of the bottom half, batch {args.batch}; "
        "seconds per completion (median over rounds of each child's median); the last row is the speedup of the "
        "prefill over stepping the prefix within each variant.", "",
        markdown_table(["mode", "old", "new", "new / old"], table), "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


# ---------------------------------------------------------------- causal: both Functions in this process


def load_chunk_module(folder: str):
    """``chunk.py`` of an exported revision as a standalone module (its imports are absolute)."""
    spec = importlib.util.spec_from_file_location("chunk_old", os.path.join(folder, CHUNK_FILE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_causal(args) -> None:
    import torch

    from linformer_lab.ops.kernels import causal_dot_product

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="compare_revisions_") as folder:
        old = load_chunk_module(export_revision(args.commit, folder))
    rows = []
    for b, h, n, c, m in SHAPES[: args.shapes]:
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.rand(b, h, n, c, generator=gen).requires_grad_(True) for _ in range(2))
        v = torch.randn(b, h, n, m, generator=gen).requires_grad_(True)
        s0 = torch.randn(b, h, c, m, generator=gen).requires_grad_(True)
        g = torch.randn(b, h, n, m, generator=gen)
        g_final = torch.randn(b, h, c, m, generator=gen)

        def run_old():
            torch.autograd.backward(old.causal_dot_product(q, k, v), g)

        def run_new():
            torch.autograd.backward(causal_dot_product(q, k, v), g)

        def run_state():
            out, final = causal_dot_product(q, k, v, None, s0, True)
            torch.autograd.backward([out, final], [g, g_final])

        timed = interleaved_medians({"old": run_old, "new": run_new, "new+state": run_state}, repeats=args.repeats)
        medians = {name: t["median"] for name, t in timed.items()}
        row = {"B": b, "H": h, "N": n, "C": c, "M": m, **{f"{k}_ms": round(1e3 * t, 2) for k, t in medians.items()},
               "new_over_old": round(medians["new"] / medians["old"], 3),
               "state_over_new": round(medians["new+state"] / medians["new"], 3)}
        rows.append(row)
        print(row, flush=True)
    info = machine_info()
    write_csv(str(args.out) + ".csv", rows)
    columns = ("B", "H", "N", "C", "M", "old_ms", "new_ms", "new+state_ms", "new_over_old", "state_over_new")
    lines = [
        f"# Causal Function at {args.rev} = {args.commit} (old) and the working tree (new), and the cost of state in/out",
        "",
        command_line(args, f" --repeats {args.repeats} --threads {args.threads} --shapes {args.shapes}") + " "
        f"({time.strftime('%Y-%m-%d')}); {info['cpu']}, {args.threads} threads, torch {torch.__version__}; "
        f"forward+backward, fp32, median of {args.repeats} interleaved calls.",
        "",
        markdown_table(["B", "H", "N", "C", "M", "old ms", "new ms", "new+state ms", "new / old", "new+state / new"],
                       [[r[k] for k in columns] for r in rows]),
    ]
    Path(str(args.out) + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    gen = sub.add_parser("generate", help="PixelTransformer.generate, child processes per variant alternating")
    gen.add_argument("--rev", default="HEAD", help="git revision of the 'old' variant")
    gen.add_argument("--batch", type=int, default=1)
    gen.add_argument("--rounds", type=int, default=5, help="child processes per variant, alternating")
    gen.add_argument("--calls", type=int, default=3, help="timed completions per mode in each child")
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument("--out", default=str(DEFAULT_OUT["generate"]), help="prefix of the result files (_batch<B>.{csv,md})")
    gen.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    causal = sub.add_parser("causal", help="the causal Function, both in this process, and the cost of state in/out")
    causal.add_argument("--rev", default="HEAD", help="git revision of the 'old' Function")
    causal.add_argument("--repeats", type=int, default=9)
    causal.add_argument("--threads", type=int, default=2)
    causal.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of the shapes to run (smallest first)")
    causal.add_argument("--out", default=str(DEFAULT_OUT["causal"]), help="prefix of the result files (.{csv,md})")
    train = sub.add_parser("train", help="one training update of a config's image model, child processes alternating")
    train.add_argument("--rev", default="HEAD", help="git revision of the 'old' variant")
    train.add_argument("--config", default="mnist_cpu_linear.yaml", help="an image-generation config in configs/")
    train.add_argument("--rounds", type=int, default=5, help="child processes per variant, alternating")
    train.add_argument("--updates", type=int, default=5, help="timed updates in each child")
    train.add_argument("--threads", type=int, default=2)
    train.add_argument("--out", default=str(DEFAULT_OUT["train"]), help="prefix of the result files (_<config>.{csv,md})")
    train.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    host = sub.add_parser("triton-host", help="the Triton chunk operator's host side, launches stubbed, alternating")
    host.add_argument("--rev", default="HEAD", help="git revision of the 'old' variant")
    host.add_argument("--rounds", type=int, default=5, help="child processes per variant, alternating")
    host.add_argument("--calls", type=int, default=50, help="timed forward+backward calls in each child")
    host.add_argument("--shape", default="1,8,256,32", help="B,H,T,D")
    host.add_argument("--threads", type=int, default=1)
    host.add_argument("--out", default=str(DEFAULT_OUT["triton-host"]), help="prefix of the result files (.{csv,md})")
    host.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if getattr(args, "child", False):
        if args.what == "triton-host":
            child = triton_host_child(args.calls, tuple(int(n) for n in args.shape.split(",")))
        elif args.what == "generate":
            child = generate_child(args.batch, args.calls, args.threads)
        else:
            child = train_child(args.config, args.updates, args.threads)
        print(json.dumps(child))
        return
    args.commit = resolve_commit(args.rev)
    {"generate": run_generate, "causal": run_causal, "train": run_train, "triton-host": run_triton_host}[args.what](args)


if __name__ == "__main__":
    main()
