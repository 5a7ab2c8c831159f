"""Paper Table 1 (MNIST, §4.2.1) at CPU scale: test bits/dim of trained models, learning curves,
samples and completions (Figures 6 and 7).

    uv run python benchmarks/paper/mnist_table1.py                        # train what is missing, evaluate, report
    uv run python benchmarks/paper/mnist_table1.py --methods linear softmax --skip-train

Every step is the README's command for one method M of ``configs/mnist_cpu_M.yaml``:

1. ``cli.py fit --config mnist_cpu_M.yaml --ckpt_path last`` (``--parallel`` methods at a time,
   ``--threads`` torch threads each): trains from scratch, or resumes a run that was stopped,
   under ``logs/mnist_cpu_M`` (the config's own root). Skipped with ``--skip-train``.
2. ``cli.py test --config mnist_cpu_M.yaml --ckpt_path best``: bits/dim over all 784 sub-pixels
   of the 10,000 test images.
3. ``cli.py predict --config mnist_cpu_M.yaml --ckpt_path best --trainer.limit_predict_batches K``:
   unconditional samples and completions of the top half of the first 16 test images (K batches), as PNGs,
   copied to ``benchmarks/paper/results/mnist_cpu_M_{samples,completions}.png``.

Read back from the runs' ``metrics.csv``: validation bits/dim against updates (one plot, all
methods) and the training wall time (from the fit logs' timestamps written here). Results:
``benchmarks/paper/results/mnist_table1.{csv,md,png}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import generation_report  # noqa: E402  (the paper's Tables 4 and 5)
from common import (  # noqa: E402
    command_line,
    fit_run,
    machine_info,
    markdown_table,
    pyplot,
    results_dir,
    torch_info,
    write_csv,
)

METHODS = ("linear", "softmax", "lsh1", "lsh4")
LABELS = {"linear": "Linear (ours)", "softmax": "Softmax", "lsh1": "LSH-1", "lsh4": "LSH-4"}
#: The paper's Table 1 (8 layers x 256, 250 epochs, on a GPU): bits/dim.
PAPER_BITS_PER_DIM = {"softmax": 0.621, "lsh1": 0.745, "lsh4": 0.676, "linear": 0.644}
RESULTS = results_dir(__file__)


def recipe(method: str) -> dict:
    """The model and data settings of ``configs/mnist_cpu_M.yaml``."""
    import yaml

    config = yaml.safe_load((REPO / "configs" / f"mnist_cpu_{method}.yaml").read_text())
    return {**config["model"]["init_args"], **config["data"]["init_args"]}


def root(method: str) -> Path:
    return REPO / "logs" / f"mnist_cpu_{method}"


def command(subcommand: str, method: str, *extra: str) -> list[str]:
    return [sys.executable, "cli.py", subcommand, "--config", f"mnist_cpu_{method}.yaml",
            "--trainer.enable_progress_bar=false", *extra]


def train(methods: list[str], args) -> None:
    """Fit (or resume) every method, ``args.parallel`` at a time; each fit's wall seconds are
    appended to ``<root>/fit_seconds.json`` (a run resumed over several sessions has several)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    pending, running = list(methods), {}
    while pending or running:
        while pending and len(running) < args.parallel:
            method = pending.pop(0)
            root(method).mkdir(parents=True, exist_ok=True)
            log = open(root(method) / "fit.log", "a")  # noqa: SIM115 (closed with the process)
            proc = subprocess.Popen(command("fit", method, "--ckpt_path", "last"), cwd=REPO, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
            running[method] = (proc, time.time())
        time.sleep(10)
        for method, (proc, start) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[method]
            record_fit_seconds(method, start, time.time())
            if proc.returncode != 0:
                raise SystemExit(f"fit of {method} failed ({proc.returncode}): see {root(method) / 'fit.log'}")


def record_fit_seconds(method: str, start: float, end: float) -> None:
    path = root(method) / "fit_seconds.json"
    spans = json.loads(path.read_text()) if path.exists() else []
    spans.append({"start": start, "end": end})
    path.write_text(json.dumps(spans))


def run_cli(subcommand: str, method: str, *extra: str, threads: int) -> Path:
    """Run one CLI command; returns the version directory it logged into."""
    before = set(root(method).glob("version_*"))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run(command(subcommand, method, *extra), cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{subcommand} of {method} failed:\n{done.stderr[-3000:]}")
    (new,) = set(root(method).glob("version_*")) - before
    return new


def collect(method: str) -> dict:
    """Validation curve, test bits/dim (the newest test) and training minutes of one method's runs."""
    return {"method": method, **fit_run(root(method))}


def copy_pngs(method: str, predict_dir: Path) -> list[str]:
    copied = []
    for kind in ("samples", "completions"):
        found = sorted((predict_dir / "predictions").glob(f"*{kind}*.png"))
        if found:
            target = RESULTS / f"mnist_cpu_{method}_{kind}.png"
            shutil.copyfile(found[-1], target)
            copied.append(target.name)
    return copied


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r["curve"]:
            ax.plot(list(r["curve"]), list(r["curve"].values()), marker="o", label=LABELS[r["method"]])
    ax.set_xlabel("updates")
    ax.set_ylabel("validation bits/dim (512 images)")
    ax.set_title("MNIST at CPU scale (configs/mnist_cpu_*.yaml)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


TIMINGS = RESULTS / "generation_cpu_mnist_trained.csv"  # benchmarks/paper/generation.py --trained logs


def timing_lines() -> list[str]:
    """Tables 4 and 5 on the trained models, from ``generation.py --trained``'s CSV (none if not run)."""
    if not TIMINGS.exists():
        return []
    with open(TIMINGS) as f:
        rows = [r for r in csv.DictReader(f) if r["step_weights"] == "model"]
    large = max(int(r["batch"]) for r in rows)
    at = {(r["method"], int(r["batch"])): float(r["seconds_per_image"]) for r in rows}
    lin1, lin_large = at.get(("linear", 1)), at.get(("linear", large))
    paper = generation_report.PAPER["mnist"]  # Table 4: images/s on a GPU; Table 5: CPU seconds at batch 1
    body = []
    for method in generation_report.METHODS:
        if (method, 1) not in at:
            continue
        s1, s_large = at[method, 1], at.get((method, large))
        paper_img_s, paper_cpu_s = paper["img_s"][method], paper["cpu_s"][method]
        body.append([method, f"{s1:.3g}", f"{s1 / lin1:.3g}x" if lin1 else "—", paper_cpu_s,
                     f"{paper_cpu_s / paper['cpu_s']['linear']:.3g}x",
                     "—" if s_large is None else f"{1 / s_large:.3g}",
                     "—" if s_large is None or not lin_large else f"{s_large / lin_large:.3g}x", paper_img_s])
    fitted = sorted({r["method"] for r in rows if r["source"] == "fit"})
    return ["", "## Tables 4 and 5 on these models", "",
            "From `python benchmarks/paper/generation.py --trained logs` "
            "([generation_cpu_mnist_trained.md](generation_cpu_mnist_trained.md): machine, threads, load, how each "
            "method is timed). linear steps in RNN mode, stateful-softmax with a KV cache, softmax and lsh recompute the "
            "prefix at every step" + (f" ({', '.join(fitted)}: a fit of timed steps, not whole images)" if fitted else "")
            + ". The paper's images/s are on a GPU, its seconds on a CPU.", "",
            markdown_table(["method", "s / image, batch 1", "÷ linear's", "paper CPU s", "paper ÷ linear's",
                            f"images/s, batch {large}", "linear's ÷ this", "paper images/s (GPU)"], body)]


def write_report(results: list[dict], args) -> None:
    write_csv(str(RESULTS / "mnist_table1.csv"), [
        {"method": r["method"], "test_bits_per_dim": r["test_bpd"], "paper_bits_per_dim": PAPER_BITS_PER_DIM[r["method"]],
         "fit_minutes": r["fit_minutes"], "updates": max(r["curve"], default=None),
         "val_curve": " ".join(f"{k}:{v:.4f}" for k, v in r["curve"].items())}
        for r in results
    ])
    plot(results, RESULTS / "mnist_table1.png")
    info, versions = machine_info(), torch_info()
    r0 = recipe(results[0]["method"])
    ours = (f"{r0['n_layers']} x {r0['d_model']}, batch {r0['batch_size']}, "
            f"{r0.get('position_embedding', 'pixel').replace('_', ' ')} position embeddings")
    rows = [[LABELS[r["method"]], PAPER_BITS_PER_DIM[r["method"]], "—" if r["test_bpd"] is None else f"{r['test_bpd']:.3f}",
             max(r["curve"], default="—"), r["fit_minutes"] or "—",
             f"`python cli.py fit --config mnist_cpu_{r['method']}.yaml` + `test ... --ckpt_path best`"] for r in results]
    (RESULTS / "mnist_table1.md").write_text(
        "# Table 1 at CPU scale: MNIST bits/dim\n\n"
        f"{info['cpu']}, {info['logical_cpus']} logical CPUs, torch {versions['torch']}, {time.strftime('%Y-%m-%d')}; "
        f"`{command_line('benchmarks/paper/mnist_table1.py', args.argv)}`. Training: one torch thread per model, "
        f"{args.parallel} models at a time. Test bits/dim: all 784 sub-pixels of the 10,000 test images, best checkpoint "
        "by validation bits/dim (512 validation images). The paper: 8 x 256 models, 250 epochs on a GPU; ours: "
        f"{ours}, the updates below.\n\n"
        + markdown_table(["method", "paper bits/dim", "ours, test bits/dim", "updates", "training minutes", "command"], rows)
        + "\n\nValidation bits/dim against updates: [mnist_table1.png](mnist_table1.png). Samples and completions "
        "(top half given): " + ", ".join(f"[{m}](mnist_cpu_{m}_completions.png)" for m in (r["method"] for r in results)
                                          if (RESULTS / f"mnist_cpu_{m}_completions.png").exists())
        + ".\n" + (f"\n{args.note}\n" if args.note else "") + "\n".join(timing_lines()) + "\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per training run")
    parser.add_argument("--eval-threads", type=int, default=2, help="torch threads for test and predict")
    parser.add_argument("--skip-train", action="store_true", help="evaluate the runs as they are")
    parser.add_argument("--skip-predict", action="store_true")
    parser.add_argument("--note", default="", help="what was seen (the PNGs looked at, the machine's load), for the report")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from the newest test run of each method (nothing is run)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    if args.report_only:
        write_report([collect(m) for m in args.methods], args)
        return 0
    if not args.skip_train:
        train(args.methods, args)
    results = []
    for method in args.methods:
        run_cli("test", method, "--ckpt_path", "best", threads=args.eval_threads)
        if not args.skip_predict:
            batches = str(-(-16 // recipe(method)["batch_size"]))  # the first 16 test images
            predict_dir = run_cli("predict", method, "--ckpt_path", "best", "--trainer.limit_predict_batches", batches,
                                  threads=args.eval_threads)
            print(method, "PNGs:", copy_pngs(method, predict_dir), flush=True)
        results.append(collect(method))
        print(results[-1]["method"], results[-1]["test_bpd"], flush=True)
    write_report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
