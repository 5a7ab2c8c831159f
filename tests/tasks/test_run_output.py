"""Run output a user can take at its word, through the real CLI: the epoch-level bits/dim covers
the whole epoch after a mid-epoch resume (equal to the uninterrupted run's) and is not logged for
an epoch cut short; a normal run prints no warning; the progress bar ends where max_steps ends
training; copy-task predict prints its accuracy and decoded examples; completion grids are titled."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_cli, tiny_copy_args, tiny_mnist_args
from PIL import Image

from linformer_lab.tasks.image_grids import COMPLETION_LEGEND, image_grid, save_png

EPOCH_METRIC = "train/bits_per_dim_epoch"


def tiny_mnist(root: Path, *extra: str) -> list[str]:
    """conftest's toy MNIST run with no callbacks from the config (no sample images to draw)."""
    return tiny_mnist_args(root, "--trainer.callbacks=[]", *extra)


def hidden_in_a_fresh_process() -> set[str]:
    """Names of the warning categories Python's default filters hide outside ``__main__``
    (deprecations addressed to library authors, e.g. Lightning's own use of jsonargparse)."""
    names, todo = set(), [DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning]
    while todo:
        category = todo.pop()
        names.add(category.__name__)
        todo += category.__subclasses__()
    return names


def warnings_in(err: str) -> list[str]:
    """The warnings a run printed, as ``python cli.py`` shows them (run_cli appends every warning
    as ``Category: message``, also those the default filters hide)."""
    hidden = hidden_in_a_fresh_process()
    return [line for line in re.findall(r"^\w*Warning: .*$", err, flags=re.M) if line.split(":")[0] not in hidden]


def epoch_values(log_dir: Path) -> dict[int, float]:
    return {int(r["epoch"]): r[EPOCH_METRIC] for r in read_metrics(log_dir) if EPOCH_METRIC in r}


@pytest.mark.slow
def test_epoch_bits_per_dim_after_a_mid_epoch_resume_equals_the_uninterrupted_run(tmp_path):
    straight = tmp_path / "straight"
    code, _, err = run_cli(["fit", *tiny_mnist(straight, "--trainer.max_steps=8", "--trainer.enable_progress_bar=false")])
    assert code == 0, err[-3000:]
    assert not warnings_in(err), warnings_in(err)
    want = epoch_values(straight / "version_0")
    assert sorted(want) == [0, 1]
    # independent of the metric: equal batches, so the epoch's bits/dim is the mean of its steps'
    steps = {int(r["step"]): r["train/bits_per_dim"] for r in read_metrics(straight / "version_0")
             if "train/bits_per_dim" in r}
    for epoch in (0, 1):
        assert want[epoch] == pytest.approx(sum(steps[s] for s in range(4 * epoch, 4 * epoch + 4)) / 4, rel=1e-5)

    resumed = tmp_path / "resumed"
    code, _, err = run_cli(["fit", *tiny_mnist(resumed, "--trainer.max_steps=2", "--trainer.enable_progress_bar=false")])
    assert code == 0, err[-3000:]
    assert epoch_values(resumed / "version_0") == {}, "an epoch cut short by max_steps was logged as a whole one"
    code, _, err = run_cli(["fit", *tiny_mnist(resumed, "--trainer.max_steps=8", "--trainer.enable_progress_bar=false"),
                            "--ckpt_path", "last"])
    assert code == 0, err[-3000:]
    assert not warnings_in(err), warnings_in(err)
    got = epoch_values(resumed / "version_1")
    assert sorted(got) == [0, 1]
    for epoch in (0, 1):
        assert got[epoch] == pytest.approx(want[epoch], abs=1e-6), (epoch, got, want)


@pytest.mark.slow
def test_a_resume_at_an_epoch_end_prints_no_warning(tmp_path):
    """Resumed from a checkpoint written at the last batch of an epoch, Lightning ends that epoch
    again, whose bits/dim then came from the checkpoint's sums: torchmetrics warned that compute ran
    "before the update method, which may lead to errors"."""
    code, _, err = run_cli(["fit", *tiny_mnist(tmp_path, "--trainer.max_steps=4", "--trainer.enable_progress_bar=false")])
    assert code == 0, err[-3000:]
    first = epoch_values(tmp_path / "version_0")
    code, _, err = run_cli(["fit", *tiny_mnist(tmp_path, "--trainer.max_steps=6", "--trainer.enable_progress_bar=false"),
                            "--ckpt_path", "last"])
    assert code == 0, err[-3000:]
    assert not warnings_in(err), warnings_in(err)
    assert epoch_values(tmp_path / "version_1") == first  # the epoch's value as it was, not a recount


def progress_totals(text: str) -> set[int]:
    """The totals ``k/N`` the training bar showed (Lightning's bar writes to stdout)."""
    return {int(total) for total in re.findall(r"Epoch \d+:[^|]*\|[^|]*\|\s*\d+/(\d+) \[", text)}


@pytest.mark.slow
def test_the_progress_bar_ends_where_max_steps_ends_training(tmp_path):
    """An epoch of 50 batches, max_steps 3: the bar counts to 3 (Lightning's counts to 50 when the
    config sets max_epochs); resumed to max_steps 5, it counts on from 3 to 5."""
    common = ["--trainer.limit_train_batches=50", "--trainer.val_check_interval=3", "--trainer.enable_progress_bar=true"]
    code, out, err = run_cli(["fit", *tiny_mnist(tmp_path, *common, "--trainer.max_steps=3")])
    assert code == 0, err[-3000:]
    assert progress_totals(out) == {3}, out[-2000:]
    assert not warnings_in(err), warnings_in(err)
    code, out, err = run_cli(["fit", *tiny_mnist(tmp_path, *common, "--trainer.max_steps=5"), "--ckpt_path", "last"])
    assert code == 0, err[-3000:]
    assert progress_totals(out) == {5}, out[-2000:]
    assert re.search(r"\|\s*5/5 \[", out), "the resumed bar did not reach its total"


def test_a_normal_run_prints_no_warning(tmp_path):
    """fit (progress bar on), resume, validate and predict the last checkpoint, fit a new run from
    the best one: nothing that suggests a fault (the pytree deprecation, "dirpath has changed",
    "could not find the monitored key", ...)."""
    root = tmp_path / "runs"
    bar = "--trainer.enable_progress_bar=true"
    commands = [
        ["fit", *tiny_copy_args(root, "linear", bar), "--trainer.max_steps=2"],
        ["fit", *tiny_copy_args(root, "linear", bar), "--trainer.max_steps=4", "--ckpt_path", "last"],
        ["validate", *tiny_copy_args(root, "linear", bar), "--ckpt_path", "last"],
    ]
    for command in commands:
        code, _, err = run_cli(command)
        assert code == 0, err[-3000:]
        assert not warnings_in(err), (command[0], warnings_in(err))
    best = next(root.glob("version_0/checkpoints/best-*.ckpt"))  # the resume wrote into version_0's folder
    code, _, err = run_cli(["fit", *tiny_copy_args(root, "linear", bar), "--trainer.max_steps=6", "--ckpt_path", str(best)])
    assert code == 0, err[-3000:]
    assert not warnings_in(err), ("fit from best", warnings_in(err))


def test_copy_predict_prints_the_accuracy_of_its_predictions_and_examples(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=3"])
    assert code == 0, err[-3000:]
    code, out, err = run_cli(["predict", *tiny_copy_args(tmp_path), "--ckpt_path", "last"])
    assert code == 0, err[-3000:]
    printed = re.search(r"copy accuracy (\d\.\d{4}) \((\d+) of (\d+) copied symbols.*?(\d+) of (\d+) sequences", out)
    assert printed, out
    # the same figures from the predictions the run saved
    batches = torch.load(next(tmp_path.glob("version_*/predictions.pt")), weights_only=True)
    mask = torch.cat([b["target_mask"] for b in batches])
    right = (torch.cat([b["predicted"] for b in batches]) == torch.cat([b["tokens"] for b in batches])) & mask
    exact = torch.cat([b["exact"] for b in batches])
    assert int(printed.group(2)) == int(right.sum()) and int(printed.group(3)) == int(mask.sum())
    assert float(printed.group(1)) == pytest.approx(int(right.sum()) / int(mask.sum()), abs=1e-4)
    assert int(printed.group(4)) == int(exact.sum()) and int(printed.group(5)) == len(exact)
    examples = re.findall(r"^  given ([\d ]+) \| copied ([\d ]+) \((exact|\d+ wrong: .*)\)$", out, flags=re.M)
    assert len(examples) == 3, out
    for given, copied, verdict in examples:
        assert len(given.split()) == len(copied.split())
        assert (verdict == "exact") == (given == copied)


def test_a_completion_grid_is_titled_above_each_column(tmp_path):
    tiles = torch.zeros(6, 1, 8, 8, dtype=torch.uint8)  # black tiles: only the titles are ink
    grid = image_grid(tiles, ncols=3)
    save_png(grid, str(tmp_path / "plain.png"), scale=4)
    save_png(grid, str(tmp_path / "titled.png"), scale=4, legend=COMPLETION_LEGEND, tile_width=8)
    plain, titled = Image.open(tmp_path / "plain.png"), Image.open(tmp_path / "titled.png")
    band = titled.height - plain.height
    assert titled.width == plain.width and band > 8
    pixels = torch.from_numpy(np.array(titled))  # (H, W) uint8
    assert torch.equal(pixels[band:], torch.from_numpy(np.array(plain)))
    step = (8 + 2) * 4
    for column in range(3):  # ink in the band above every column, and only within the column
        above = pixels[:band, 8 + column * step: (column + 1) * step]
        assert (above < 128).any(), f"no title above column {column}"
