"""benchmarks/paper/mnist_conversion.py: the report of the conversion runs reads each run root's
test bits/dim and gap to the teacher, times batch-1 generation of each run's best checkpoint, and
names a run that is missing as missing (an em dash), never as a number."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script():
    sys.path.insert(0, str(BENCHMARKS / "paper"))
    try:
        import mnist_conversion
    finally:
        sys.path.remove(str(BENCHMARKS / "paper"))
    return mnist_conversion


def _run(root: Path, backend: str, feature_map: str | None, test_bpd: float) -> None:
    """A run root as ``cli.py fit`` + ``test`` leave it: a best checkpoint and a metrics.csv."""
    from linformer_lab.tasks.image_generation import ImageGenerationTask

    attention = {"backend": backend, **({"feature_map": feature_map} if feature_map else {})}
    task = ImageGenerationTask(attention=attention, image_shape=[1, 4, 4], n_layers=1, n_heads=2, d_model=8, d_ff=16,
                               num_mixtures=2)
    folder = root / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                "pytorch-lightning_version": lightning.__version__}, folder / "best-epoch=0-step=1.ckpt")
    metrics = f"epoch,step,val/bits_per_dim,test/bits_per_dim\n0,9,1.5,\n0,10,,{test_bpd}\n"
    (root / "version_0" / "metrics.csv").write_text(metrics)


@pytest.mark.slow
def test_report_reads_the_runs_and_times_their_generation(tmp_path, monkeypatch):
    conversion = _script()
    monkeypatch.setattr(conversion, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(conversion, "TEACHER", tmp_path / "teacher")
    monkeypatch.setattr(conversion, "run_root", lambda kind, n: tmp_path / f"{kind}_{n}")
    (tmp_path / "results").mkdir()
    _run(tmp_path / "teacher", "softmax", None, 1.25)
    _run(tmp_path / "t2r_500", "linear", "t2r", 1.5)
    _run(tmp_path / "scratch_500", "linear", "elu", 1.75)
    conversion.main(["--report-only", "--maps", "t2r", "elu", "--budgets", "500", "--repeats", "1"])
    with open(tmp_path / "results" / "mnist_conversion.csv") as f:
        rows = {r["model"]: r for r in csv.DictReader(f)}
    assert float(rows["t2r"]["test_bits_per_dim"]) == 1.5 and float(rows["t2r"]["gap_to_teacher"]) == 0.25
    assert rows["elu"]["test_bits_per_dim"] == "" and float(rows["scratch"]["test_bits_per_dim"]) == 1.75
    assert float(rows["t2r"]["seconds_per_image_batch1"]) > 0 and rows["elu"]["seconds_per_image_batch1"] == ""
    text = (tmp_path / "results" / "mnist_conversion.md").read_text()
    assert "7,000 updates): 1.250 test bits/dim" in text and "s / image at batch 1 (KV cache)" in text
    assert "| softmax → t2r | 1.500 |" in text and "| softmax → elu + 1 | — | — |" in text
