"""The benchmarks that read checkpoints (figure2_copy's training time, copy_prefix_only's model)
refuse a pickle payload before it runs: they load with ``weights_only=True`` like the CLI."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from linformer_lab.checkpoints import UnsafeCheckpointError

REPO = Path(__file__).resolve().parents[2]
for room in ("paper", "dev"):
    sys.path.insert(0, str(REPO / "benchmarks" / room))
try:
    import copy_prefix_only
    import figure2_copy
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
