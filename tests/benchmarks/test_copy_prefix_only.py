"""benchmarks/dev/copy_prefix_only.py: teacher-forced, another-future and prefix-only copy losses.
For attention that is a function of the prefix (softmax, linear) the three must agree; the
script runs end to end on a checkpoint written by the real CLI."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, checkpoint_dir, run_cli, tiny_copy_args

from linformer_lab.data.copy import CopyDataModule
from linformer_lab.tasks.copy_task import CopyTask

sys.path.insert(0, str(REPO / "benchmarks" / "dev"))
try:
    import copy_prefix_only
finally:
    sys.path.remove(str(REPO / "benchmarks" / "dev"))


def tiny(backend: str) -> tuple[CopyTask, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    data = CopyDataModule(max_length=6, batch_size=4, seed=1)
    model = CopyTask(attention={"backend": backend}, vocab_size=data.vocab_size, sequence_length=data.sequence_length,
                     d_model=16, n_heads=2, n_layers=2).double().eval()
    tokens, mask = next(iter(data.val_dataloader()))
    return model, tokens, mask


@pytest.mark.parametrize("backend", ["softmax", "linear"])
def test_prefix_functions_give_one_loss_three_ways(backend):
    model, tokens, mask = tiny(backend)
    r = copy_prefix_only.three_losses(model, tokens, mask)
    assert r["count"] == int(mask[:, 1:].sum()) > 0
    assert r["other_loss"] == pytest.approx(r["forced_loss"], rel=1e-9)
    assert r["prefix_loss"] == pytest.approx(r["forced_loss"], rel=1e-9)
    assert r["forced_correct"] == r["other_correct"] == r["prefix_correct"]
    # and it is the task's own teacher-forced copy loss (which the task reduces in float32)
    loss, correct, count = model.copy_loss(tokens, mask)
    assert r["forced_loss"] / r["count"] == pytest.approx(float(loss), rel=1e-6) and r["forced_correct"] == int(correct)


def test_report_from_a_cli_checkpoint(tmp_path):
    root = tmp_path / "lsh_run"
    code, _, err = run_cli(["fit", *tiny_copy_args(root, "lsh", "--trainer.max_steps", "2",
                                                   '--model.attention.kwargs={"n_hashes": 2, "bucket_size": 4, "n_buckets": 4}')])
    assert code == 0, err
    copy_prefix_only.main([str(checkpoint_dir(root) / "last.ckpt"), "--batches", "1", "--out", str(tmp_path)])
    row = [line for line in (tmp_path / "copy_prefix_only.md").read_text().splitlines() if line.startswith("| lsh_run |")]
    assert len(row) == 1 and "'n_hashes': 2" in row[0] and "| 2 |" in row[0]
    with pytest.raises(SystemExit):
        copy_prefix_only.main([str(tmp_path / "missing.ckpt")])
