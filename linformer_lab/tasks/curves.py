"""Runs' curves: the training and validation metrics a fit logs (``metrics.csv``) drawn into one PNG
by matplotlib's Agg backend, for a machine without a browser: ``python cli.py plot RUN ...`` or
``linformer_lab.plot_runs([RUN, ...], "curves.png")``; no torch, no Lightning. A RUN is a run root
(``logs/NAME``: its ``version_N/metrics.csv`` in numeric order, so a resumed fit continues the
curve it resumes) or one ``version_N`` folder.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path

#: the splits drawn, with their line style: training values logged every few updates are noisy
SPLITS = {"train": {"linewidth": 0.8, "alpha": 0.45}, "val": {"linewidth": 1.8, "marker": "o", "markersize": 3}}


class PlotError(Exception):
    """A run that cannot be drawn: the one line ``cli.py plot`` prints."""


def metrics_files(run: str | Path) -> list[Path]:
    """A run folder's ``metrics.csv``, else its ``version_*/metrics.csv`` in numeric order."""
    run = Path(run)
    if (run / "metrics.csv").is_file():
        return [run / "metrics.csv"]
    versions = [p for p in run.glob("version_*/metrics.csv") if p.parent.name.split("_", 1)[1].isdigit()]
    return sorted(versions, key=lambda p: int(p.parent.name.split("_", 1)[1]))


def metric_rows(run: str | Path) -> Iterator[dict[str, str]]:
    """Every row of a run's :func:`metrics_files`, as CSV strings."""
    for path in metrics_files(run):
        with open(path, newline="") as f:
            yield from csv.DictReader(f)


def run_curves(run: str | Path) -> dict[str, dict[int, float]]:
    """``{"train/bits_per_dim": {update: value}, ...}``: a run's ``train/`` and ``val/`` metrics by
    update (the logged ``step`` + 1), the last value logged at an update winning."""
    curves: dict[str, dict[int, float]] = {}
    for row in metric_rows(run):
        if not row.get("step"):
            continue
        for name, value in row.items():
            if name and name.split("/", 1)[0] in SPLITS and value not in ("", None):
                number = float(value)
                if math.isfinite(number):
                    curves.setdefault(name, {})[int(float(row["step"])) + 1] = number
    return {name: dict(sorted(points.items())) for name, points in curves.items()}


def plot_runs(runs: list[str | Path], output: str | Path, title: str | None = None) -> tuple[list[str], list[str]]:
    """Draw the curves of ``runs`` into the PNG ``output``, one panel per metric validation logs (else
    training does); returns the metrics and the runs' names in the legend."""
    curves = {}
    for run in runs:
        path = Path(run)
        if not path.is_dir():
            raise PlotError(f"{run}: no such run folder (a run root such as logs/NAME, or one of its version_N)")
        if not metrics_files(path):
            raise PlotError(f"{run}: no metrics.csv in it or in its version_N folders (fit writes them)")
        found = run_curves(path)
        if not found:
            raise PlotError(f"{run}: its metrics.csv holds no train/ or val/ values yet")
        resolved = path.resolve()  # the legend's name: with the run root's for a version_N
        name = f"{resolved.parent.name}/{resolved.name}" if resolved.name.startswith("version_") else resolved.name
        curves[name if name not in curves else str(run)] = found
    metrics = sorted({n.split("/", 1)[1] for found in curves.values() for n in found if n.startswith("val/")}) or \
        sorted({n.split("/", 1)[1] for found in curves.values() for n in found if n.startswith("train/")})
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for index, (name, found) in enumerate(curves.items()):
            colour = f"C{index % 10}"
            for split, style in SPLITS.items():
                points = found.get(f"{split}/{metric}")
                if points:
                    ax.plot(list(points), list(points.values()), color=colour, label=f"{name} ({split})", **style)
        ax.set_xlabel("update")
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return metrics, list(curves)
