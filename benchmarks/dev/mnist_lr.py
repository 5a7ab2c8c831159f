"""Full-length MNIST CPU-recipe runs side by side: learning rate, gradient clipping, seed.

    uv run python benchmarks/dev/mnist_lr.py --run logs/r3_mnist_cpu_linear --run logs/mnist_cpu_linear ...

Each ``--run DIR`` is the root of one ``cli.py fit --config configs/mnist_cpu_M.yaml`` (with its
overrides) followed by ``cli.py test`` into the same root. What the run was is read from the config
the CLI saved in ``DIR/version_0/config.yaml`` (attention, learning rate, gradient clipping, seed,
updates), not typed in: the table cannot claim a setting the run did not have. Recorded per run: validation bits/dim at
every validation (the config's ``data.limit_val`` images), the last test bits/dim (all 10,000 test
images), and the training minutes from ``DIR/fit_seconds.json`` when present. Results:
``benchmarks/dev/results/mnist_lr.{csv,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import command_line, fit_run, machine_info, markdown_table, results_dir, torch_info, write_csv  # noqa: E402


def read_run(root: Path) -> dict:
    """The saved settings, validation curve, test bits/dim and fit minutes of one run root."""
    config_path = root / "version_0" / "config.yaml"
    if not config_path.exists():
        raise SystemExit(f"{config_path} not found: --run takes the root of a `cli.py fit` run (its version_0 holds config.yaml)")
    config = yaml.safe_load(config_path.read_text())
    model = config["model"]["init_args"]
    logged = fit_run(root)
    return {"run": root.name, "attention": model["attention"]["backend"], "lr": model["lr"],
            "seed": config.get("seed_everything"), "updates": config["trainer"]["max_steps"],
            "clip": config["trainer"].get("gradient_clip_val"), "test_bpd": logged["test_bpd"],
            "fit_minutes": logged["fit_minutes"],
            **{f"val_bpd_{step}": round(value, 3) for step, value in logged["curve"].items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, type=Path, help="root of one fit + test (repeat)")
    parser.add_argument("--note", default="", help="what was seen and what else ran, for the report")
    parser.add_argument("--out", default=str(results_dir(__file__) / "mnist_lr"))
    args = parser.parse_args(argv)
    rows = [read_run(root) for root in args.run]
    write_csv(f"{args.out}.csv", rows)
    steps = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("val_bpd_")})
    shown = [s for s in steps if s % 1000 == 0 or s == steps[-1]]
    header = ["run", "attention", "lr", "clip", "seed", "updates", "minutes", "test bits/dim"] + [f"val @{s}" for s in shown]
    table = [[r["run"], r["attention"], r["lr"], r["clip"], r["seed"], r["updates"], r["fit_minutes"] or "—",
              "—" if r["test_bpd"] is None else f"{r['test_bpd']:.4f}"] + [r.get(f"val_bpd_{s}", "") for s in shown]
             for r in rows]
    info, versions = machine_info(), torch_info()
    command = command_line("benchmarks/dev/mnist_lr.py", list(argv if argv is not None else sys.argv[1:]))
    Path(f"{args.out}.md").write_text(
        f"# MNIST CPU recipe: full-length runs by learning rate, clipping and seed\n\n{info['cpu']}, {info['logical_cpus']} "
        f"logical CPUs, torch {versions['torch']}, {time.strftime('%Y-%m-%d')}. Command: `{command}`.\n\n"
        "Every run is `cli.py fit --config configs/mnist_cpu_<attention>.yaml` with the learning rate, gradient clipping "
        "and seed shown "
        "(read from the config each run saved), then `cli.py test` on its best checkpoint (all 10,000 test images). "
        "Validation: the config's first 512 validation images. Minutes: wall clock of the fit, one torch thread, "
        "two or three processes at a time.\n\n"
        + markdown_table(header, table) + "\n" + (f"\n{args.note}\n" if args.note else "")
    )
    print(Path(f"{args.out}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
