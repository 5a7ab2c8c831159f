"""Beyond the paper: a trained softmax MNIST model turned into a linear one, against linear trained
from scratch for the same number of updates (issue: feature maps and conversion).

    uv run python benchmarks/paper/mnist_conversion.py                  # train what is missing, test, report
    uv run python benchmarks/paper/mnist_conversion.py --report-only    # report the runs as they are

The teacher is ``configs/mnist_cpu_softmax.yaml``'s run (train it first: ``mnist_table1.py
--methods softmax``); every conversion loads its last checkpoint (``--model.init_from``, set in the
configs). For each map M of ``configs/mnist_convert_M.yaml`` (elu + 1 swapped in, t2r, hedgehog with
attention distillation) and each budget N of updates, the commands are the configs' own::

    python cli.py fit  --config mnist_convert_M.yaml --trainer.max_steps N --trainer.default_root_dir logs/mnist_convert_M_N
    python cli.py test --config mnist_convert_M.yaml --ckpt_path best --trainer.default_root_dir logs/mnist_convert_M_N

and linear from scratch with ``mnist_cpu_linear.yaml`` under ``logs/mnist_cpu_linear_N`` (a cosine
schedule to N, so a 500-update run is a whole short run, not the first 500 updates of a long one).

Generation speed: seconds per image at batch 1 (the whole 784 sub-pixels, ``PixelTransformer.generate``,
one thread), the converted models, linear from scratch and the softmax teacher (KV cache), interleaved.

Results: ``benchmarks/paper/results/mnist_conversion.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import (  # noqa: E402
    command_line,
    fit_run,
    machine_info,
    markdown_table,
    newest_best_checkpoint,
    results_dir,
    torch_info,
    write_csv,
)

MAPS = ("elu", "t2r", "hedgehog")
LABELS = {"elu": "softmax → elu + 1", "t2r": "softmax → t2r", "hedgehog": "softmax → hedgehog (distilled)",
          "scratch": "linear (elu + 1) from scratch"}
BUDGETS = (500, 1000, 2000)
RESULTS = results_dir(__file__)
TEACHER = REPO / "logs" / "mnist_cpu_softmax"


def run_root(kind: str, updates: int) -> Path:
    name = f"mnist_cpu_linear_{updates}" if kind == "scratch" else f"mnist_convert_{kind}_{updates}"
    return REPO / "logs" / name


def config(kind: str) -> str:
    return "mnist_cpu_linear.yaml" if kind == "scratch" else f"mnist_convert_{kind}.yaml"


def cli(subcommand: str, kind: str, updates: int, threads: int, *extra: str) -> None:
    root = run_root(kind, updates)
    argv = [sys.executable, "cli.py", subcommand, "--config", config(kind),
            "--trainer.default_root_dir", str(root.relative_to(REPO)), "--trainer.enable_progress_bar=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{subcommand} of {kind} at {updates} updates failed:\n{done.stderr[-3000:]}")


def train_and_test(kinds: list[str], budgets: list[int], threads: int) -> None:
    """Fit and test every run whose root has no test result yet (one after the other)."""
    for kind in kinds:
        for updates in budgets:
            if fit_run(run_root(kind, updates))["test_bpd"] is not None:
                continue
            print(f"{kind} {updates}: fit", flush=True)
            cli("fit", kind, updates, threads, "--trainer.max_steps", str(updates))
            cli("test", kind, updates, threads, "--ckpt_path", "best")


def generation_seconds(roots: dict[str, Path], repeats: int) -> dict[str, float]:
    """Median seconds for one whole image at batch 1 per model, the models interleaved."""
    import torch

    from linformer_lab.tasks.image_generation import ImageGenerationTask

    torch.set_num_threads(1)
    models = {}
    for name, root in roots.items():
        path = newest_best_checkpoint(root)
        if path is not None:
            models[name] = ImageGenerationTask.load_from_checkpoint(path, map_location="cpu", weights_only=True).model.eval()
    times: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, model in models.items():
            generator = torch.Generator().manual_seed(repeat)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(1, generator=generator)
            if repeat:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def write_report(kinds: list[str], budgets: list[int], seconds: dict[str, float], args) -> None:
    teacher = fit_run(TEACHER)["test_bpd"]
    rows, table = [], []
    for kind in kinds:
        tests = {n: fit_run(run_root(kind, n))["test_bpd"] for n in budgets}
        rows += [{"model": kind, "updates": n, "test_bits_per_dim": tests[n],
                  "gap_to_teacher": None if tests[n] is None or teacher is None else round(tests[n] - teacher, 4),
                  "seconds_per_image_batch1": seconds.get(kind)} for n in budgets]
        table.append([LABELS[kind], *("—" if tests[n] is None else f"{tests[n]:.3f}" for n in budgets),
                      "—" if kind not in seconds else f"{seconds[kind]:.2f}"])
    write_csv(str(RESULTS / "mnist_conversion.csv"), rows)
    info, versions = machine_info(), torch_info()
    header = ["model", *(f"test bits/dim, {n:,} updates" for n in budgets), "s / image, batch 1"]
    teacher_line = "—" if teacher is None else f"{teacher:.3f}"
    (RESULTS / "mnist_conversion.md").write_text(
        "# A trained softmax model converted to linear attention (MNIST, CPU recipe)\n\n"
        f"{info['cpu']}, {info['logical_cpus']} logical CPUs, torch {versions['torch']}, {time.strftime('%Y-%m-%d')}; "
        f"`{command_line('benchmarks/paper/mnist_conversion.py', args.argv)}`. Training: one torch thread per run. "
        "Test bits/dim: all 784 sub-pixels of the 10,000 test images, best checkpoint by validation bits/dim. "
        f"The teacher (`mnist_cpu_softmax.yaml`, 7,000 updates): {teacher_line} test bits/dim"
        + (f", {seconds['teacher']:.2f} s / image at batch 1 (KV cache)" if "teacher" in seconds else "") + ".\n\n"
        + markdown_table(header, table)
        + "\n\nCommands: `python cli.py fit --config mnist_convert_M.yaml --trainer.max_steps N "
        "--trainer.default_root_dir logs/mnist_convert_M_N`, then `python cli.py test` with the same config and root and "
        "`--ckpt_path best`; from scratch: `mnist_cpu_linear.yaml` under `logs/mnist_cpu_linear_N`.\n"
        + (f"\n{args.note}\n" if args.note else "")
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", nargs="+", default=list(MAPS), choices=MAPS)
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed images per model (batch 1)")
    parser.add_argument("--report-only", action="store_true", help="report the runs as they are (nothing is trained)")
    parser.add_argument("--note", default="", help="what the report should say below the table")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    kinds = [*args.maps, "scratch"]
    if not args.report_only:
        train_and_test(kinds, args.budgets, args.threads)
    largest = max(args.budgets)
    timed = {kind: run_root(kind, largest) for kind in kinds}
    seconds = generation_seconds({**timed, "teacher": TEACHER}, args.repeats) if args.repeats else {}
    write_report(kinds, args.budgets, seconds, args)
    print((RESULTS / "mnist_conversion.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
