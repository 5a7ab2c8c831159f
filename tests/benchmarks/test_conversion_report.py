"""benchmarks/paper/conversion.py: the report of the conversion runs reads each run root's test
metric and gap to the teacher, times batch-1 generation of each MNIST run's best checkpoint, and
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
        import conversion
    finally:
        sys.path.remove(str(BENCHMARKS / "paper"))
    return conversion


def _image_run(root: Path, backend: str, feature_map: str | None, test_bpd: float) -> None:
    """A run root as ``cli.py fit`` + ``test`` leave it: a best checkpoint and a metrics.csv."""
    from linformer_lab.tasks.image_generation import ImageGenerationTask

    attention = {"backend": backend, **({"feature_map": feature_map} if feature_map else {})}
    task = ImageGenerationTask(attention=attention, image_shape=[1, 4, 4], n_layers=1, n_heads=2, d_model=8, d_ff=16,
                               num_mixtures=2)
    folder = root / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                "pytorch-lightning_version": lightning.__version__}, folder / "best-epoch=0-step=1.ckpt")
    _metrics(root, "bits_per_dim", test_bpd)


def _metrics(root: Path, name: str, value: float, accuracy: float | None = None) -> None:
    (root / "version_0").mkdir(parents=True, exist_ok=True)
    extra = "" if accuracy is None else ",test/accuracy"
    (root / "version_0" / "metrics.csv").write_text(
        f"epoch,step,val/{name},test/{name}{extra}\n0,9,1.5,{',' if extra else ''}\n0,10,,{value}"
        + ("" if accuracy is None else f",{accuracy}") + "\n")


@pytest.fixture
def conversion(tmp_path, monkeypatch):
    module = _script()
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(module, "LOGS", tmp_path)
    (tmp_path / "results").mkdir()
    return module


@pytest.mark.slow
def test_mnist_report_reads_the_runs_and_times_their_generation(tmp_path, conversion):
    _image_run(tmp_path / "mnist_cpu_softmax", "softmax", None, 1.25)
    _image_run(tmp_path / "mnist_convert_t2r_500", "linear", "t2r", 1.5)
    _image_run(tmp_path / "mnist_cpu_linear_500", "linear", "elu", 1.75)
    conversion.main(["--task", "mnist", "--report-only", "--maps", "t2r", "elu", "--budgets", "500", "--repeats", "1"])
    with open(tmp_path / "results" / "mnist_conversion.csv") as f:
        rows = {r["model"]: r for r in csv.DictReader(f)}
    assert float(rows["t2r"]["test_bits_per_dim"]) == 1.5 and float(rows["t2r"]["gap_to_teacher"]) == 0.25
    assert rows["elu"]["test_bits_per_dim"] == "" and float(rows["scratch"]["test_bits_per_dim"]) == 1.75
    assert float(rows["t2r"]["seconds_per_image_batch1"]) > 0 and rows["elu"]["seconds_per_image_batch1"] == ""
    text = (tmp_path / "results" / "mnist_conversion.md").read_text()
    assert "7,000 updates): 1.250 test bits/dim" in text and "s / image at batch 1 (KV cache)" in text
    assert "| softmax → t2r | 1.500 |" in text and "| softmax → elu + 1 | — | — |" in text


def test_copy_report_gives_loss_accuracy_and_the_scratch_run_at_the_teachers_budget(tmp_path, conversion):
    _metrics(tmp_path / "copy_cpu_softmax", "loss", 0.005, 0.999)
    _metrics(tmp_path / "copy_convert_hedgehog_250", "loss", 0.0625, 0.98)
    _metrics(tmp_path / "copy_cpu_linear_250", "loss", 1.5, 0.5)
    _metrics(tmp_path / "copy_cpu_linear_3000", "loss", 0.25, 0.9)
    conversion.main(["--task", "copy", "--report-only", "--maps", "hedgehog", "elu", "--budgets", "250"])
    with open(tmp_path / "results" / "copy_conversion.csv") as f:
        rows = [r for r in csv.DictReader(f)]
    by_model = {(r["model"], r["updates"]): r for r in rows}
    hedgehog = by_model["hedgehog", "250"]
    assert float(hedgehog["test_loss"]) == 0.0625 and float(hedgehog["test_accuracy"]) == 0.98
    assert float(hedgehog["gap_to_teacher"]) == pytest.approx(0.0575)
    assert by_model["elu", "250"]["test_loss"] == "" and float(by_model["scratch", "3000"]["test_loss"]) == 0.25
    assert float(by_model["scratch", "3000"]["test_accuracy"]) == 0.9
    assert "seconds_per_image_batch1" not in rows[0]
    text = (tmp_path / "results" / "copy_conversion.md").read_text()
    assert "3,000 updates): 0.0050 (0.999) test loss; linear from scratch for as many updates" in text
    assert ": 0.2500 (0.900)." in text
    assert "| softmax → hedgehog (distilled) | 0.0625 (0.980) |" in text and "| softmax → elu + 1 | — |" in text


def test_a_missing_mnist_teacher_is_refused_before_any_training(tmp_path, conversion):
    with pytest.raises(SystemExit, match="no tested teacher.*mnist_table1.py --methods softmax"):
        conversion.main(["--task", "mnist", "--maps", "elu", "--budgets", "500"])
