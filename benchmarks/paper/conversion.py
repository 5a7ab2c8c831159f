"""Beyond the paper: a trained softmax model turned into a linear one, against linear trained from
scratch for the same number of updates (issue: feature maps and conversion), on two tasks.

    uv run python benchmarks/paper/conversion.py --task mnist                 # train what is missing, test, report
    uv run python benchmarks/paper/conversion.py --task copy
    uv run python benchmarks/paper/conversion.py --task mnist --report-only   # report the runs as they are

Each task has a softmax teacher trained with its CPU recipe (``mnist_cpu_softmax.yaml``, 7,000
updates, under ``logs/mnist_cpu_softmax``: ``mnist_table1.py --methods softmax``;
``copy_cpu_softmax.yaml``, 3,000 updates at the paper's 32-62 symbols, under
``logs/copy_cpu_softmax``: trained here when missing) whose last checkpoint every conversion
loads (``--model.init_from``, set in the configs). For each map M of ``configs/T_convert_M.yaml``
(elu + 1 swapped in, t2r, hedgehog with attention distillation) and each budget N of updates, the
commands are the configs' own::

    python cli.py fit  --config T_convert_M.yaml --trainer.max_steps N --trainer.default_root_dir logs/T_convert_M_N
    python cli.py test --config T_convert_M.yaml --ckpt_path best --trainer.default_root_dir logs/T_convert_M_N

and linear from scratch with ``T_cpu_linear.yaml`` under ``logs/T_cpu_linear_N`` (MNIST's cosine
schedule runs to N, so a 500-update run is a whole short run, not the first 500 updates of a long
one; the copy recipe's rate is constant until its decay at 2,500).

MNIST also times generation: seconds per image at batch 1 (the whole 784 sub-pixels,
``PixelTransformer.generate``, one thread), the converted models, linear from scratch and the
softmax teacher (KV cache), interleaved.

Results: ``benchmarks/paper/results/T_conversion.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import (  # noqa: E402
    command_line,
    machine_info,
    markdown_table,
    newest_best_checkpoint,
    results_dir,
    test_metrics,
    torch_info,
    write_csv,
)

MAPS = ("elu", "t2r", "hedgehog")
LABELS = {"elu": "softmax → elu + 1", "t2r": "softmax → t2r", "hedgehog": "softmax → hedgehog (distilled)",
          "scratch": "linear (elu + 1) from scratch"}
RESULTS = results_dir(__file__)
LOGS = REPO / "logs"


@dataclass(frozen=True)
class Task:
    """What differs between the two cases: the teacher, the budgets, the test metric."""

    name: str
    title: str
    budgets: tuple[int, ...]
    teacher_updates: int
    scratch_full: str    # the run root of linear from scratch at the teacher's budget
    metric: str          # the column of metrics.csv the table reports (lower is better)
    metric_label: str
    digits: int
    extra_metric: str | None = None   # reported in the csv beside it
    times_generation: bool = False
    test_note: str = ""


TASKS = {
    "mnist": Task("mnist", "MNIST, CPU recipe", budgets=(500, 1000, 2000), teacher_updates=7000,
                  scratch_full="mnist_cpu_linear", metric="test/bits_per_dim", metric_label="test bits/dim", digits=3,
                  times_generation=True,
                  test_note="Test bits/dim: all 784 sub-pixels of the 10,000 test images, best checkpoint by "
                            "validation bits/dim."),
    "copy": Task("copy", "copy task at the paper's lengths, CPU scale", budgets=(250, 500, 1000), teacher_updates=3000,
                 scratch_full="copy_cpu_linear_3000", metric="test/loss", metric_label="test loss", digits=4,
                 extra_metric="test/accuracy",
                 test_note="Test loss: cross-entropy of the copied half over 20 fixed batches of 64 sequences of 32-62 "
                           "symbols, best checkpoint by validation loss; accuracy: the share of copied symbols predicted "
                           "exactly (argmax)."),
}


def teacher_root(task: Task) -> Path:
    return LOGS / f"{task.name}_cpu_softmax"


def run_root(task: Task, kind: str, updates: int) -> Path:
    name = f"{task.name}_cpu_linear_{updates}" if kind == "scratch" else f"{task.name}_convert_{kind}_{updates}"
    return LOGS / name


def config(task: Task, kind: str) -> str:
    return {"scratch": f"{task.name}_cpu_linear.yaml", "teacher": f"{task.name}_cpu_softmax.yaml"}.get(
        kind, f"{task.name}_convert_{kind}.yaml")


def cli(subcommand: str, config_name: str, root: Path, threads: int, *extra: str) -> None:
    argv = [sys.executable, "cli.py", subcommand, "--config", config_name,
            "--trainer.default_root_dir", str(root.relative_to(REPO)), "--trainer.enable_progress_bar=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{subcommand} of {root.name} failed:\n{done.stderr[-3000:]}")


def train_and_test(task: Task, kinds: list[str], budgets: list[int], threads: int) -> None:
    """Fit and test the teacher (copy) and every run whose root has no test result yet, one after the other."""
    if not test_metrics(teacher_root(task)):
        if task.name == "mnist":
            raise SystemExit(f"no tested teacher in {teacher_root(task)}: train it with mnist_table1.py --methods softmax")
        print(f"{task.name} teacher: fit", flush=True)
        cli("fit", config(task, "teacher"), teacher_root(task), threads)
        cli("test", config(task, "teacher"), teacher_root(task), threads, "--ckpt_path", "best")
    for kind in kinds:
        for updates in budgets:
            root = run_root(task, kind, updates)
            if task.metric in test_metrics(root):
                continue
            print(f"{kind} {updates}: fit", flush=True)
            cli("fit", config(task, kind), root, threads, "--trainer.max_steps", str(updates))
            cli("test", config(task, kind), root, threads, "--ckpt_path", "best")


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


def cell(task: Task, metrics: dict[str, float]) -> str:
    """A table cell: the metric (and the extra one in brackets), or an em dash for a run not tested."""
    if task.metric not in metrics:
        return "—"
    value = f"{metrics[task.metric]:.{task.digits}f}"
    return value if task.extra_metric is None else f"{value} ({metrics.get(task.extra_metric, float('nan')):.3f})"


def csv_row(task: Task, kind: str, updates: int, metrics: dict[str, float], teacher: float | None) -> dict:
    """One run's csv row: its test metric (and the extra one), the gap to the teacher."""
    value = metrics.get(task.metric)
    return {"model": kind, "updates": updates, f"test_{task.metric.split('/')[1]}": value,
            **({f"test_{task.extra_metric.split('/')[1]}": metrics.get(task.extra_metric)} if task.extra_metric else {}),
            "gap_to_teacher": None if value is None or teacher is None else round(value - teacher, task.digits + 1)}


def write_report(task: Task, kinds: list[str], budgets: list[int], seconds: dict[str, float], args) -> Path:
    teacher_metrics = test_metrics(teacher_root(task))
    teacher = teacher_metrics.get(task.metric)
    rows, table = [], []
    for kind in kinds:
        tests = {n: test_metrics(run_root(task, kind, n)) for n in budgets}
        rows += [{**csv_row(task, kind, n, tests[n], teacher),
                  **({"seconds_per_image_batch1": seconds.get(kind)} if task.times_generation else {})} for n in budgets]
        table.append([LABELS[kind], *(cell(task, tests[n]) for n in budgets),
                      *(["—" if kind not in seconds else f"{seconds[kind]:.2f}"] if task.times_generation else [])])
    full_metrics = test_metrics(LOGS / task.scratch_full)
    if task.metric in full_metrics:
        rows.append(csv_row(task, "scratch", task.teacher_updates, full_metrics, teacher))
    name = f"{task.name}_conversion"
    write_csv(str(RESULTS / f"{name}.csv"), rows)
    info, versions = machine_info(), torch_info()
    label = task.metric_label + (f" ({task.extra_metric.split('/')[1]})" if task.extra_metric else "")
    header = ["model", *(f"{label}, {n:,} updates" for n in budgets),
              *(["s / image, batch 1"] if task.times_generation else [])]
    teacher_speed = f", {seconds['teacher']:.2f} s / image at batch 1 (KV cache)" if "teacher" in seconds else ""
    path = RESULTS / f"{name}.md"
    path.write_text(
        f"# A trained softmax model converted to linear attention ({task.title})\n\n"
        f"{info['cpu']}, {info['logical_cpus']} logical CPUs, torch {versions['torch']}, {time.strftime('%Y-%m-%d')}; "
        f"`{command_line('benchmarks/paper/conversion.py', args.argv)}`. Training: one torch thread per run. "
        f"{task.test_note} The teacher (`{config(task, 'teacher')}`, {task.teacher_updates:,} updates): "
        f"{cell(task, teacher_metrics)} {task.metric_label}{teacher_speed}"
        + ("" if task.metric not in full_metrics else f"; linear from scratch for as many updates (`logs/{task.scratch_full}`): "
                                   f"{cell(task, full_metrics)}")
        + ".\n\n"
        + markdown_table(header, table)
        + f"\n\nCommands: `python cli.py fit --config {task.name}_convert_M.yaml --trainer.max_steps N "
        f"--trainer.default_root_dir logs/{task.name}_convert_M_N`, then `python cli.py test` with the same config and "
        f"root and `--ckpt_path best`; from scratch: `{config(task, 'scratch')}` under `logs/{task.name}_cpu_linear_N`.\n"
        + (f"\n{args.note}\n" if args.note else "")
    )
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--maps", nargs="+", default=list(MAPS), choices=MAPS)
    parser.add_argument("--budgets", nargs="+", type=int, default=None, help="updates of each run (default: the task's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--repeats", type=int, default=3, help="MNIST: timed images per model (batch 1); 0 times none")
    parser.add_argument("--report-only", action="store_true", help="report the runs as they are (nothing is trained)")
    parser.add_argument("--note", default="", help="what the report should say below the table")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    task = TASKS[args.task]
    budgets = args.budgets or list(task.budgets)
    kinds = [*args.maps, "scratch"]
    if not args.report_only:
        train_and_test(task, kinds, budgets, args.threads)
    seconds = {}
    if task.times_generation and args.repeats:
        timed = {kind: run_root(task, kind, max(budgets)) for kind in kinds}
        seconds = generation_seconds({**timed, "teacher": teacher_root(task)}, args.repeats)
    print(write_report(task, kinds, budgets, seconds, args).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
