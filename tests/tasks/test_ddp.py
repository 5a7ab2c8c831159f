"""Two-process DDP on CPU (gloo) through ``cli.py``: both ranks train, and the logged validation
metrics are synchronised over the ranks (``sync_dist=True``).

The check of the synchronisation: under DDP each rank validates half of the 4 fixed validation
batches; the val/loss rank 0 logs must equal the mean over all 4 batches, which a single-process
``validate`` of the same weights computes. Without sync_dist rank 0 would log the mean of its own 2
batches only, which differs.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import cli_subprocess, read_metrics, run_cli, tiny_copy_args

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path):
    args = tiny_copy_args(tmp_path, "linear", "--data.val_batches=4", "--trainer.max_epochs=2",
                          "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu")
    proc = cli_subprocess(["fit", *args])
    try:
        out, err = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    log = out + err
    assert "GLOBAL_RANK: 0" in log and "GLOBAL_RANK: 1" in log and "Starting with 2 processes" in log

    rows = read_metrics(tmp_path / "version_0")
    val = [r for r in rows if "val/loss" in r]
    # 3 training batches per epoch are split over 2 ranks: 2 steps per epoch, 2 epochs.
    assert [int(r["step"]) for r in val] == [1, 3]
    ddp_val_loss, ddp_accuracy = val[-1]["val/loss"], val[-1]["val/accuracy"]

    # last.ckpt holds the weights validated at the end of the last epoch
    code, _, err = run_cli(["validate", *tiny_copy_args(tmp_path, "linear", "--data.val_batches=4"), "--ckpt_path", "last"])
    assert code == 0, err
    single = [r for r in read_metrics(tmp_path / "version_1") if "val/loss" in r][-1]
    assert single["val/loss"] == pytest.approx(ddp_val_loss, rel=1e-5)
    assert single["val/accuracy"] == pytest.approx(ddp_accuracy, rel=1e-5)
