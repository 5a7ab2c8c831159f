"""The benchmarks that read checkpoints (figure2_copy's training time, copy_prefix_only's model,
step_weights_quality's --ckpt, generation's --trained models) refuse a pickle payload before it
runs: they load with ``weights_only=True`` like the CLI, given explicitly, so that
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which overrides only an unset ``weights_only``) does not
open them to it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from linformer_lab.tasks.checkpoint_files import UnsafeCheckpointError

REPO = Path(__file__).resolve().parents[2]
for room in ("paper", "dev"):
    sys.path.insert(0, str(REPO / "benchmarks" / room))
try:
    import copy_prefix_only
    import figure2_copy
    import generation
    import step_weights_quality
finally:
    for room in ("paper", "dev"):
        sys.path.remove(str(REPO / "benchmarks" / room))


class Payload:
    """Unpickling this creates ``marker``: the stand-in for any code a crafted file could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "callbacks": {"Timer": {"time_elapsed": {"train": 1.0}}},
                "hyper_parameters": {"note": Payload(marker)}}, path)
    return path


def test_figure2_reads_the_training_time_without_running_a_payload(tmp_path):
    run = tmp_path / "linear" / "version_0"
    crafted(run / "checkpoints" / "last.ckpt", tmp_path / "payload-ran")
    (run / "metrics.csv").write_text("epoch,step,train/loss\n0,0,2.5\n")
    with pytest.raises(pickle.UnpicklingError):
        figure2_copy.logged_run("linear", ["cli.py", "fit"], tmp_path)  # an absolute log root stays as given
    assert not (tmp_path / "payload-ran").exists()


def test_copy_prefix_only_refuses_a_payload(tmp_path):
    bad = crafted(tmp_path / "best.ckpt", tmp_path / "payload-ran")
    with pytest.raises(UnsafeCheckpointError):
        copy_prefix_only.measure(bad, batches=1)
    assert not (tmp_path / "payload-ran").exists()


def test_the_payload_would_run_under_the_override(tmp_path, monkeypatch):
    """The setting of the tests below: under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, a load that does not
    say weights_only runs the payload."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    torch.load(crafted(tmp_path / "x.ckpt", tmp_path / "payload-ran"))
    assert (tmp_path / "payload-ran").exists()


def test_step_weights_quality_refuses_a_payload_under_the_override(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    bad = crafted(tmp_path / "last.ckpt", tmp_path / "payload-ran")
    with pytest.raises(SystemExit, match="refused checkpoint"):
        step_weights_quality.main(["--ckpt", str(bad), "--out", str(tmp_path / "results")])
    assert not (tmp_path / "payload-ran").exists()


def test_generation_trained_refuses_a_payload_under_the_override(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    crafted(tmp_path / "mnist_cpu_linear" / "version_0" / "checkpoints" / "best-0.ckpt", tmp_path / "payload-ran")
    with pytest.raises(SystemExit, match="refused checkpoint"):
        generation.trained_model("linear", str(tmp_path), "cpu")
    assert not (tmp_path / "payload-ran").exists()
