"""The checkpoint callbacks outside the CLI (``linformer_lab.tasks.checkpointing``): a fit from
Python with its own ``L.Trainer``, stopped by ``max_steps`` in the middle of an epoch, resumes from
``last.ckpt`` to the weights of an uninterrupted fit (with Lightning's own ``save_last`` the resumed
fit ends 4e-4 away: its checkpoint closes the epoch), and ``last.ckpt`` records the best checkpoint;
``StopOnSignal`` holds the signal handlers only while training, and leaves an ignored Ctrl-C ignored."""

from __future__ import annotations

import signal

import lightning as L
import pytest
import torch

from linformer_lab.data.copy import CopyDataModule
from linformer_lab.tasks.checkpointing import BestCheckpoint, LastCheckpoint, StopOnSignal
from linformer_lab.tasks.copy_task import CopyTask


def _fit(root, max_steps: int, ckpt_path=None, extra=()) -> tuple[CopyTask, list]:
    """A tiny copy task fitted to ``max_steps`` (epochs of 3 batches, validation at each epoch's end)
    with both callbacks writing into ``root``."""
    torch.manual_seed(0)
    data = CopyDataModule(max_length=6, batch_size=4, train_batches_per_epoch=3, val_batches=2, min_length=1)
    task = CopyTask("linear", vocab_size=data.vocab_size, sequence_length=data.sequence_length, d_model=16,
                    n_layers=1, n_heads=2, dropout=0.0)
    callbacks = [BestCheckpoint(root, monitor=task.monitor, mode=task.monitor_mode), LastCheckpoint(root), *extra]
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, deterministic=True,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=callbacks)
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    return task, callbacks


def test_last_checkpoint_at_max_steps_mid_epoch_records_the_best_and_resumes_exactly(tmp_path):
    _, (best, last) = _fit(tmp_path / "run", max_steps=4)  # one validation (step 3), stopped inside epoch 2
    saved = torch.load(tmp_path / "run" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 4 and last.saved_step() == 4
    recorded = [state["best_model_path"] for key, state in saved["callbacks"].items() if key.startswith("ModelCheckpoint")]
    assert best.best_model_path.endswith(".ckpt") and best.best_model_path in recorded

    resumed, (_, last) = _fit(tmp_path / "run", max_steps=7, ckpt_path="last")  # as the module's example
    assert last.started_at == 4
    straight, _ = _fit(tmp_path / "straight", max_steps=7)
    want = straight.state_dict()
    for name, value in resumed.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-6, rtol=0), name


class Seen(L.Callback):
    """Records the SIGINT and SIGTERM handlers at the first update; raises ``error`` there if given."""

    def __init__(self, error: type[BaseException] | None = None):
        self.error, self.handlers = error, None

    def on_train_batch_start(self, *args) -> None:
        self.handlers = self.handlers or (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        if self.error is not None:
            raise self.error("stop here")


@pytest.mark.parametrize("error", [None, RuntimeError])
def test_stop_on_signal_holds_the_handlers_while_training_and_gives_them_back(tmp_path, error):
    """In training the handlers are StopOnSignal's; after the fit, ended or failed, the process has its
    own again (Lightning puts back what it noted at its start: the callback sets its handlers after that)."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop, seen = StopOnSignal(), Seen(error)
    if error is None:
        _fit(tmp_path, max_steps=2, extra=[stop, seen])
    else:
        with pytest.raises(error):
            _fit(tmp_path, max_steps=2, extra=[stop, seen])
    assert all(getattr(h, "__self__", None) is stop for h in seen.handlers)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_stop_on_signal_leaves_an_ignored_ctrl_c_ignored(tmp_path):
    """A background job ignores Ctrl-C: training there keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen = Seen()
    _fit(tmp_path, max_steps=1, extra=[StopOnSignal(), seen])
    assert seen.handlers[0] is signal.SIG_IGN and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
