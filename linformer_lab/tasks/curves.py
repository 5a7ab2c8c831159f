"""Runs' curves: the training and validation metrics a fit logs (``metrics.csv``) drawn into one PNG
by matplotlib's Agg backend, for a machine without a browser: ``python cli.py plot RUN ...`` or
``linformer_lab.plot_runs([RUN, ...], "curves.png")``; no torch, no Lightning. A RUN is a run root
(``logs/NAME``: its newest fit, whose ``version_N/metrics.csv`` files are read in numeric order, so
a resumed fit continues the curve it resumes) or one ``version_N`` folder.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterator
from pathlib import Path

#: the splits drawn, with their line style: training values logged every few updates are noisy
SPLITS = {"train": {"linewidth": 0.8, "alpha": 0.45}, "val": {"linewidth": 1.8, "marker": "o", "markersize": 3}}


class PlotError(Exception):
    """A run that cannot be drawn: the one line ``cli.py plot`` prints."""


def _versions(run: Path) -> list[Path]:
    """A run folder itself when it holds a ``metrics.csv``, else its ``version_N`` folders in numeric
    order (version_10 after version_9)."""
    if (run / "metrics.csv").is_file():
        return [run]
    versions = [p for p in run.glob("version_*") if p.is_dir() and p.name.split("_", 1)[1].isdigit()]
    return sorted(versions, key=lambda p: int(p.name.split("_", 1)[1]))


def metrics_files(run: str | Path) -> list[Path]:
    """A run folder's ``metrics.csv``, else its ``version_*/metrics.csv`` in numeric order."""
    return [folder / "metrics.csv" for folder in _versions(Path(run)) if (folder / "metrics.csv").is_file()]


def _rows(files: list[Path]) -> Iterator[dict[str, str]]:
    for path in files:
        with open(path, newline="") as f:
            yield from csv.DictReader(f)


def metric_rows(run: str | Path) -> Iterator[dict[str, str]]:
    """Every row of a run's :func:`metrics_files`, as CSV strings."""
    yield from _rows(metrics_files(run))


def _saved_config(version: Path) -> dict[str, str]:
    """The top-level ``key: value`` lines of the ``config.yaml`` LightningCLI saved in a version folder."""
    path = version / "config.yaml"
    text = path.read_text(errors="replace") if path.is_file() else ""
    return {key: value.strip() for key, value in re.findall(r"^(\w+):(.*)$", text, re.MULTILINE)}


def fits(run: str | Path) -> list[list[Path]]:
    """The fits logged under ``run``, oldest first, each as the ``metrics.csv`` of its versions.

    A run root gathers every command run with its config: a version whose saved config has
    ``ckpt_path: null`` starts a fit, one that resumes (``--ckpt_path``) continues the fit before
    it, and an evaluation's (validate, test, predict: its config has Lightning's ``verbose`` or
    ``return_predictions``) is no fit: its ``val/`` values at step 0 are not a fit's first update.
    A version without a saved config continues the fit before it."""
    found: list[list[Path]] = []
    for folder in _versions(Path(run)):  # a fit that logged nothing yet still ends the fit before it
        config = _saved_config(folder)
        if "verbose" in config or "return_predictions" in config:
            continue
        if not found or config.get("ckpt_path") in ("null", "~", ""):
            found.append([])
        if (folder / "metrics.csv").is_file():
            found[-1].append(folder / "metrics.csv")
    return [fit for fit in found if fit]


def run_curves(run: str | Path, fit: list[Path] | None = None) -> dict[str, dict[int, float]]:
    """``{"train/bits_per_dim": {update: value}, ...}``: the ``train/`` and ``val/`` metrics of
    ``fit`` (default: the run's newest, :func:`fits`) by update (the logged ``step`` + 1), the last
    value logged at an update winning."""
    curves: dict[str, dict[int, float]] = {}
    for row in _rows((fits(run) or [[]])[-1] if fit is None else fit):
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
        logged = fits(path)
        if not logged:
            raise PlotError(f"{run}: holds evaluations only (validate, test, predict), no fit: no curves to draw")
        found = run_curves(path, logged[-1])
        if not found:
            raise PlotError(f"{run}: its metrics.csv holds no train/ or val/ values yet")
        # the legend's name: with the run root's for a version_N; of several fits under one root, the
        # newest is drawn, named by its first version
        resolved = (logged[-1][0].parent if len(logged) > 1 else path).resolve()
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
                if points:  # a lone point (a run shorter than its logging interval) needs a marker to be seen
                    lone = {"marker": "o", "markersize": 3} if len(points) == 1 else {}
                    ax.plot(list(points), list(points.values()), color=colour, label=f"{name} ({split})",
                            **{**style, **lone})
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
