"""The checkpoint callbacks the CLI adds to every fit (:class:`LastCheckpoint`, the resume point, and
:class:`BestCheckpoint`), and what a fit prints when it ends or is interrupted."""

from __future__ import annotations

import copy
import logging
import os
import re
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import linformer_lab.cli.compat as compat
from linformer_lab.tasks.base import epoch_ran_to_end

#: exit code of a run stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it
INTERRUPTED_EXIT_CODE = 130

#: the logger of Lightning's rank_zero_info
rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` after *every* validation (else every epoch end), every ``every_n_train_steps``
    updates, at the ``max_steps`` step and at any other end: Lightning's ``save_last`` writes only
    beside a new top-k checkpoint. After the best-model callback, it records that validation's best.
    Saved at the final batch, the epoch stays open (a larger ``max_steps`` continues it); a stop
    requested during a batch (``max_time``) keeps that batch's loop state, so a resume continues at
    the next batch (Lightning 2.6 would close the epoch)."""

    def __init__(self, dirpath: str | None, every_n_train_steps: int | None):
        # one well-known last.ckpt rather than last-v1, last-v2 ...
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, enable_version_counter=False)
        self.every_n_steps = every_n_train_steps or 0
        self._saved_at = 0  # global_step of the last.ckpt this process wrote (0: none yet)
        self._loops_at_stop: dict | None = None  # fit-loop state at the batch where a stop was requested
        self.started_at: int | None = None  # global_step this process started from

    def _can_save(self, trainer: L.Trainer) -> bool:
        return not (trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit")

    def _save(self, trainer: L.Trainer) -> None:
        """Write ``last.ckpt`` now through the Trainer's public save (every rank calls it, as any save)."""
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

    def load_state_dict(self, state_dict: dict) -> None:
        load_unless_moved(self, state_dict)


class BestCheckpoint(ModelCheckpoint):
    """The best ``save_top_k`` checkpoints by the task's ``monitor``, without Lightning's warning of a
    non-empty folder: ``checkpoints.claim_checkpoint_dir`` allows one only to the fit resuming it."""

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

    def load_state_dict(self, state_dict: dict) -> None:
        load_unless_moved(self, state_dict)

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key: the record in checkpoints written before this class still loads
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)


def load_unless_moved(callback: ModelCheckpoint, state_dict: dict) -> None:
    """Restore ``callback``'s record only where it writes where the checkpoint's run wrote (a resumed fit)."""
    if state_dict.get("dirpath", callback.dirpath) == callback.dirpath:
        ModelCheckpoint.load_state_dict(callback, state_dict)


def interrupted_message(trainer: L.Trainer) -> str:
    """One line after Ctrl-C: the step reached, the step ``last.ckpt`` holds and the updates lost."""
    step = trainer.global_step
    if trainer.state.fn != "fit":
        return f"interrupted (Ctrl-C) during {trainer.state.fn}; it writes no checkpoint, and nothing of it was saved."
    last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
    saved = last.saved_step() if last is not None else None
    if saved is None:
        return (f"interrupted (Ctrl-C) at step {step}: no checkpoint was saved, so all {step} updates are lost "
                f"(last.ckpt is written at every validation, and every --checkpoint.every_n_train_steps).")
    lost = step - saved
    updates = "nothing is" if lost == 0 else "the 1 update since is" if lost == 1 else f"the {lost} updates since are"
    return (f"interrupted (Ctrl-C) at step {step}: {os.path.join(last.dirpath, 'last.ckpt')} holds step {saved}, "
            f"so {updates} lost; --ckpt_path last with the same config resumes from step {saved}.")


def without_interrupt_notice(record) -> bool:
    """Logging filter: drops Lightning's "Detected KeyboardInterrupt", which :func:`interrupted_message` replaces."""
    return "Detected KeyboardInterrupt" not in str(record.msg)


def init_from_error(err: Exception, init_from: str) -> str:
    """The line for a ``--model.init_from`` checkpoint that cannot be used (the loader names only a file)."""
    if not Path(init_from).exists():
        return (f"--model.init_from {init_from}: no such file; init_from names the trained checkpoint a fit starts "
                f"from: give its path now, or resume the run from its own checkpoint with --ckpt_path last "
                f"(a resumed run does not read init_from)")
    message = str(err)
    return f"--model.{message}" if message.startswith(f"init_from {init_from}") else f"--model.init_from {init_from}: {message}"


def finished_fit_lines(trainer: L.Trainer) -> list[str]:
    """What a finished fit prints last: its run folder, best checkpoint, resume point and the commands
    that use them with the config saved by the run that owns the checkpoints."""
    best = next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), None)
    last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
    if trainer.log_dir is None or last is None or last.dirpath is None:  # fast_dev_run, or checkpoints of the user's
        return []

    def shown(path) -> str:  # relative to the working directory when below it
        relative = os.path.relpath(path)
        return str(path) if relative.startswith("..") else relative

    lines = [f"fit finished at step {trainer.global_step}: run folder {shown(trainer.log_dir)}"]
    keyword = "last"
    if best is not None and best.best_model_path:
        score = best.best_model_score
        lines.append(f"  best checkpoint {shown(best.best_model_path)}"
                     f"{f' ({best.monitor} {float(score):.4f})' if score is not None else ''}")
        keyword = "best"
    lines.append(f"  resume point    {shown(os.path.join(last.dirpath, 'last.ckpt'))}")
    owner = Path(last.dirpath).parent / "config.yaml"
    config = shown(owner if owner.is_file() else Path(trainer.log_dir) / "config.yaml")
    lines.append(f"next: python cli.py test --config {config} --ckpt_path {keyword}")
    lines.append(f"      python cli.py predict --config {config} --ckpt_path {keyword}")
    return lines
