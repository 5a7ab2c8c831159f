"""Checkpoint callbacks a fit resumes from exactly, for any Lightning Trainer (the CLI adds both to
every fit: docs/cli.md, "Checkpoints")::

    trainer = L.Trainer(max_steps=2000, callbacks=[
        BestCheckpoint("runs/copy", monitor=task.monitor, mode=task.monitor_mode),  # before LastCheckpoint
        LastCheckpoint("runs/copy"),  # last.ckpt: after every validation, at max_steps, at a stop
        StopOnSignal(),  # Ctrl-C or SIGTERM: a stop at the end of the update, written by LastCheckpoint
    ])
    trainer.fit(task, datamodule=data, ckpt_path="last")  # again later: continues where it stopped

:class:`LastCheckpoint` is the resume point; :class:`BestCheckpoint` keeps the best by the task's
monitored metric, and ``last.ckpt`` records it. Without a ``dirpath`` both write into the logger's
``version_N/checkpoints/``, a new one per Trainer, where ``ckpt_path="last"`` does not look: give a
folder of the run's own (as above), or the file (the CLI's ``--ckpt_path last`` finds it for you).
"""

from __future__ import annotations

import copy
import os
import re
import signal
import threading
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import linformer_lab.compat as compat
from linformer_lab.tasks.base import epoch_ran_to_end

__all__ = ["BestCheckpoint", "DivergedError", "LastCheckpoint", "StopOnSignal"]


class DivergedError(RuntimeError):
    """The weights hold NaN or inf where :class:`LastCheckpoint` would save them: the fit ends, and
    ``last.ckpt`` keeps the last finite weights."""


class _ResumingCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint that takes up a checkpoint's record (best scores, last path) only where it
    writes where that checkpoint's run wrote: a resumed fit, not a new run started from its weights."""

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            super().load_state_dict(state_dict)


class LastCheckpoint(_ResumingCheckpoint):
    """``last.ckpt`` after *every* validation (else every epoch end), every ``every_n_train_steps``
    updates, at the ``max_steps`` step and at any other end: Lightning's ``save_last`` writes only
    beside a new top-k checkpoint. After the best-model callback, it records that validation's best.
    Saved at the final batch, the epoch stays open (a larger ``max_steps`` continues it); a stop
    requested during a batch (``max_time``) keeps that batch's loop state, so a resume continues at
    the next batch (Lightning 2.6 would close the epoch)."""

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = None):
        # one well-known last.ckpt rather than last-v1, last-v2 ...
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, enable_version_counter=False)
        self.every_n_steps = every_n_train_steps or 0
        self._saved_at = 0  # global_step of the last.ckpt this process wrote (0: none yet)
        self._loops_at_stop: dict | None = None  # fit-loop state at the batch where a stop was requested
        self.started_at: int | None = None  # global_step this process started from

    def _can_save(self, trainer: L.Trainer) -> bool:
        return not (trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit")

    def _save(self, trainer: L.Trainer) -> None:
        """Write ``last.ckpt`` now through the Trainer's public save (every rank calls it, as any save);
        never weights that hold NaN or inf, which would make the resume point useless: :class:`DivergedError`."""
        # a sum is NaN or inf where a weight is (float32 sums: weights of any sane size do not overflow
        # them); one host sync, a tenth of the time of isfinite on every weight
        sums = [p.detach().sum(dtype=torch.float32) for p in trainer.lightning_module.parameters()]
        if sums and not torch.stack(sums).sum().isfinite():
            kept, path = self.saved_step(), os.path.join(self.dirpath, "last.ckpt")
            remedy = "a smaller learning rate (--model.lr) or gradient clipping (--trainer.gradient_clip_val)"
            raise DivergedError(
                f"training diverged: the weights hold NaN or inf at step {trainer.global_step}, so last.ckpt was not "
                + (f"written; {path} keeps step {kept}, the last finite weights: start a new run from them with "
                   f"--model.init_from {path} and {remedy}" if kept is not None
                   else f"written, nor any before it: start again with {remedy}"))
        self.last_model_path = os.path.join(self.dirpath, "last.ckpt")  # set first: it is part of the state saved
        trainer.save_checkpoint(self.last_model_path, self.save_weights_only)
        self._saved_at = trainer.global_step

    def on_train_start(self, trainer, pl_module) -> None:
        self._loops_at_stop = None  # a second fit of the same trainer starts clean
        self.started_at = trainer.global_step

    def saved_step(self) -> int | None:
        """The step the ``last.ckpt`` on disk holds (written here, else resumed from), or None."""
        written = self._saved_at
        if self.dirpath is None or not os.path.isfile(os.path.join(self.dirpath, "last.ckpt")):
            return None
        return written if written and written >= (self.started_at or 0) else self.started_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        final = trainer.max_steps is not None and 0 < trainer.max_steps <= step
        # checkpoint callbacks run last, so a Timer's stop of this batch is seen here
        stopping = trainer.should_stop and compat.stop_is_allowed(trainer)
        self._loops_at_stop = copy.deepcopy(trainer.fit_loop.state_dict()) if stopping else None
        if (periodic or final or stopping) and self._can_save(trainer) and self._saved_at != step:
            self._save(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> dict:
        # called for every checkpoint this trainer writes (best models too), not only ours
        if self._loops_at_stop is not None and "loops" in checkpoint:
            checkpoint["loops"]["fit_loop"] = self._loops_at_stop
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_validation_end(self, trainer, pl_module) -> None:
        # once the best-model callback has seen this validation (where it saves, so do we); again
        # when the batch end wrote this step: the best may have changed since
        if self._can_save(trainer) and not compat.saves_at_train_epoch_end(self, trainer):
            self._save(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # not for an epoch cut short by max_steps: the batch-end save holds the open epoch
        if self._can_save(trainer) and compat.saves_at_train_epoch_end(self, trainer) and epoch_ran_to_end(trainer):
            self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        # after a stop, again: the validation it ran may have found a new best, which last.ckpt records
        if self._can_save(trainer) and (self._loops_at_stop is not None or self._saved_at != trainer.global_step):
            self._save(trainer)


class BestCheckpoint(_ResumingCheckpoint):
    """The best ``save_top_k`` checkpoints by the task's ``monitor``, ranked only at validated steps,
    without Lightning's warning of a non-empty folder (a resumed fit writes into its own): refusing
    another run's folder is the caller's (the CLI's ``checkpoints.claim_checkpoint_dir``)."""

    validated_at: int | None = None  # global_step of this process's latest validation

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated_at = trainer.global_step
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Some epoch ends have no validation of their weights (an epoch cut short by max_steps, the one
        # Lightning replays at a resume): ranked, they would get an earlier validation's metric, or none.
        if self.validated_at == trainer.global_step:
            super().on_train_epoch_end(trainer, pl_module)

    def setup(self, trainer, pl_module, stage: str) -> None:
        with warnings.catch_warnings():
            if self.dirpath is not None:
                expected = f"Checkpoint directory {self.dirpath} exists and is not empty."
                warnings.filterwarnings("ignore", message=re.escape(expected) + "$")
            super().setup(trainer, pl_module, stage)

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key: the record in checkpoints written before this class still loads
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)


class StopOnSignal(L.Callback):
    """Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, ``kill``) during training stop the fit
    at the end of the update under way, as ``max_time`` does: :class:`LastCheckpoint` writes
    ``last.ckpt`` there, so no update is lost and a resume continues exactly. A second Ctrl-C stops
    at once (``KeyboardInterrupt``: what was not yet written is lost); a second SIGTERM changes
    nothing. Where ``min_steps`` / ``min_epochs`` overrule a stop, a signal stops at once as well.

    With ``accumulate_grad_batches`` the stop waits for the update's last batch.
    ``received`` names the signal (``"Ctrl-C"``, ``"SIGTERM"``) once one arrived, ``stopped_at`` the
    step the fit stopped at. Under DDP a signal to any process stops all of them at the same update
    (one boolean reduced across processes per update). The handlers are set in the main thread, after
    Lightning has noted the process's own (its teardown puts those back), and not for a signal the
    process ignores (a background job's Ctrl-C): SIGINT's from the sanity check (a Ctrl-C there
    stops at once), SIGTERM's, in place of Lightning's, from the start of training. DataLoader
    workers forked meanwhile inherit them and ignore both signals (a terminal's Ctrl-C reaches them
    too): the process that set them decides, and shuts its workers down when it stops."""

    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.received: str | None = None
        self.stopped_at: int | None = None
        self._previous: dict = {}
        self._owner: int | None = None  # the process that set the handlers
        self._training, self._says = False, True

    def _handle(self, *signums) -> None:
        for signum in signums:
            if (signum not in self._previous and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signum) is not signal.SIG_IGN):
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.received = self.stopped_at = None
        self._owner, self._says = os.getpid(), trainer.is_global_zero

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._handle(signal.SIGINT)  # before the sanity check forks its DataLoader workers

    def on_train_start(self, trainer, pl_module) -> None:
        self._training = True
        self._handle(signal.SIGINT, signal.SIGTERM)  # SIGTERM's in place of Lightning's, which would end the stop's validation

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self._owner:  # a DataLoader worker
            return
        if not self._training or (self.received is not None and signum == signal.SIGINT):
            raise KeyboardInterrupt
        if self.received is None:
            self.received = self.NAMES[signum]
            if self._says:  # os.write: print() may be what the signal interrupted
                os.write(2, f"\n{self.received}: stopping at the end of this update, where last.ckpt is written"
                         f"{'; Ctrl-C again stops at once' if signum == signal.SIGINT else ''}\n".encode())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # before LastCheckpoint's batch end (Lightning runs checkpoint callbacks last), which then saves;
        # at an optimizer step only: a checkpoint does not hold the gradients accumulated so far
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.current.ready % trainer.accumulate_grad_batches and not progress.is_last_batch:
            return
        requested = self.received is not None
        if trainer.world_size > 1:
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if not requested or self.stopped_at is not None:
            return
        self.received = self.received or "a signal to another process"
        if not compat.stop_is_allowed(trainer):
            raise KeyboardInterrupt
        trainer.should_stop = True
        self.stopped_at = trainer.global_step

    def _restore(self) -> None:
        self._training = False
        while self._previous:
            signal.signal(*self._previous.popitem())

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()
