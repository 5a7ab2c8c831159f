"""The checkpoint callbacks the CLI adds to every fit: :class:`LastCheckpoint` (the resume point)
and :class:`BestCheckpoint` (the best ``save_top_k`` by the task's monitored metric);
:mod:`linformer_lab.cli.checkpoints` says where they write and how ``--ckpt_path`` finds them."""

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

__all__ = ["LastCheckpoint", "BestCheckpoint", "load_unless_moved", "interrupted_message", "INTERRUPTED_EXIT_CODE",
           "rank_zero_log", "without_interrupt_notice", "init_from_error"]

#: exit code of a run stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it
INTERRUPTED_EXIT_CODE = 130

#: the logger of Lightning's rank_zero_info (lightning.pytorch.utilities.rank_zero sets it to its own)
rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt``: the resume point, written after *every* validation (at every epoch end when
    there is none), every ``every_n_train_steps`` updates, at the step where ``max_steps`` stops
    training, and when training ends any other way (``max_time``).

    Lightning's ``save_last`` writes only at steps where a top-k checkpoint was also written, so a
    run whose validation did not improve had no resume point at all. This callback is placed
    after the best-model callback, so the ``last.ckpt`` written at a validation records the best
    checkpoint *of that validation* (``--ckpt_path best`` reads it from there). Saving at the final
    batch rather than at ``on_train_end`` keeps the epoch open in the loop state, so extending
    ``max_steps`` continues the same epoch instead of starting the next.

    A stop requested during a batch (``max_time``, or a callback that sets ``should_stop`` at a
    batch's end) is written at that batch's end too, and every checkpoint written after it in the run (the
    validation the stop runs, the best model) carries the loop state of that moment: the
    resumed run continues the same epoch at the next batch and logs each update under its own
    step. Lightning 2.6 would resume from the state after the stop instead, with the epoch
    closed (the rest of its batches skipped) and the logged step one short of ``global_step``.

    Lightning has no public hook for these saves: the private members used are read through
    :mod:`linformer_lab.cli.compat`.
    """

    def __init__(self, dirpath: str | None, every_n_train_steps: int | None):
        # one well-known last.ckpt rather than last-v1, last-v2 ...
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, enable_version_counter=False)
        self.every_n_steps = every_n_train_steps or 0
        self._loops_at_stop: dict | None = None  # fit-loop state at the batch where a stop was requested

    def _can_save(self, trainer: L.Trainer) -> bool:
        return not (trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit")

    started_at: int | None = None  # global_step this process started from (a resumed run's last.ckpt)

    def on_train_start(self, trainer, pl_module) -> None:
        self._loops_at_stop = None  # a second fit of the same trainer starts clean
        self.started_at = trainer.global_step

    def saved_step(self) -> int | None:
        """The step the ``last.ckpt`` on disk holds: the latest this process wrote, else the one it
        resumed from; None when there is none."""
        written = compat.last_saved_step(self)
        if self.dirpath is None or not os.path.isfile(os.path.join(self.dirpath, "last.ckpt")):
            return None
        return written if written and written >= (self.started_at or 0) else self.started_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        final = trainer.max_steps is not None and 0 < trainer.max_steps <= step
        # Checkpoint callbacks run after all others, so a Timer's stop of this batch is seen here
        # (a stop that min_steps / min_epochs overrule is none).
        stopping = trainer.should_stop and compat.stop_is_allowed(trainer)
        self._loops_at_stop = copy.deepcopy(trainer.fit_loop.state_dict()) if stopping else None
        if (periodic or final or stopping) and self._can_save(trainer) and compat.last_saved_step(self) != step:
            compat.save_last_checkpoint(self, trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> dict:
        # Called for every checkpoint this trainer writes (best models too), not only ours; saving
        # only reads the dict, so the one copy taken at the stop serves every save after it.
        if self._loops_at_stop is not None and "loops" in checkpoint:
            checkpoint["loops"]["fit_loop"] = self._loops_at_stop
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)

    # After every validation, once the best-model callback has seen it: that callback saves at
    # validation end, or at the epoch end when validation runs once per epoch (Lightning's own
    # decision, the same for both callbacks). Written again even when the batch-end trigger wrote
    # at this step: the best may have changed since.
    def on_validation_end(self, trainer, pl_module) -> None:
        if self._can_save(trainer) and not compat.saves_at_train_epoch_end(self, trainer):
            compat.save_last_checkpoint(self, trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # not for an epoch cut short by max_steps: the batch-end save holds the open epoch
        if self._can_save(trainer) and compat.saves_at_train_epoch_end(self, trainer) and epoch_ran_to_end(trainer):
            compat.save_last_checkpoint(self, trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        # after a stop, again: the validation it ran may have found a new best, which last.ckpt records
        stopped = self._loops_at_stop is not None
        if self._can_save(trainer) and (stopped or compat.last_saved_step(self) != trainer.global_step):
            compat.save_last_checkpoint(self, trainer)

    def load_state_dict(self, state_dict: dict) -> None:
        load_unless_moved(self, state_dict)


class BestCheckpoint(ModelCheckpoint):
    """The best ``save_top_k`` checkpoints by the task's ``monitor``; a run started from another
    run's checkpoint (evaluating it, fine-tuning from it) keeps its own record (:func:`load_unless_moved`).

    Lightning warns at setup when the folder already holds files, lest a run overwrite another's.
    The CLI settles that before training (``checkpoints.claim_checkpoint_dir`` refuses such a
    folder unless this fit resumes the run in it), so the warning could only greet a resume,
    where the files are expected: it is not shown for this callback's own folder.
    """

    validated_at: int | None = None  # global_step of this process's latest validation

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated_at = trainer.global_step
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Where validation runs at epoch ends, Lightning ranks the weights at every epoch end. Some
        # epoch ends have no validation of those weights: an epoch cut short by max_steps, and
        # the epoch end Lightning replays when a run starts from a checkpoint written there.
        # Ranked, their weights would get an earlier validation's metric, or none ("could not find
        # the monitored key"); a stop's weights are in last.ckpt. (A requested stop validates.)
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
    """Restore ``callback``'s record of saved checkpoints only when it writes where the checkpoint's
    run wrote (a resumed fit). Any other run that loads a checkpoint (validate/test/predict, a fit
    from a best checkpoint) writes into its own folder and starts its own record, which is what
    Lightning does too, after a warning that the folder changed: expected here, nothing to act on."""
    if state_dict.get("dirpath", callback.dirpath) == callback.dirpath:
        ModelCheckpoint.load_state_dict(callback, state_dict)


def interrupted_message(trainer: L.Trainer) -> str:
    """One line after Ctrl-C: the step reached, the step ``last.ckpt`` holds (where a resume
    starts) and the updates lost between them."""
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
    """Logging filter: drops Lightning's "Detected KeyboardInterrupt, attempting graceful shutdown",
    which :func:`interrupted_message` replaces."""
    return "Detected KeyboardInterrupt" not in str(record.msg)


def init_from_error(err: Exception, init_from: str) -> str:
    """The line for a ``--model.init_from`` checkpoint that cannot be used. The loader's message names
    only a file, which a user resuming a converted run may not connect with init_from; a file that is
    gone gets the two ways on."""
    if not Path(init_from).exists():
        return (f"--model.init_from {init_from}: no such file; init_from names the trained checkpoint a fit starts "
                f"from: give its path now, or resume the run from its own checkpoint with --ckpt_path last "
                f"(a resumed run does not read init_from)")
    message = str(err)
    return f"--model.{message}" if message.startswith(f"init_from {init_from}") else f"--model.init_from {init_from}: {message}"


def finished_fit_lines(trainer: L.Trainer) -> list[str]:
    """What a finished fit prints last: its run folder, the best checkpoint and its metric (else the
    resume point), and the commands that evaluate and use it. The commands name the config saved by
    the run that owns the checkpoints (a resumed fit logs into a new folder but writes the old run's),
    so that ``--ckpt_path best`` there means these checkpoints."""
    best = next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), None)
    last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
    if trainer.log_dir is None or last is None or last.dirpath is None:  # fast_dev_run, or checkpoints of the user's
        return []
    lines = [f"fit finished at step {trainer.global_step}: run folder {_shown(trainer.log_dir)}"]
    keyword = "last"
    if best is not None and best.best_model_path:
        score = best.best_model_score
        metric = f" ({best.monitor} {float(score):.4f})" if score is not None else ""
        lines.append(f"  best checkpoint {_shown(best.best_model_path)}{metric}")
        keyword = "best"
    lines.append(f"  resume point    {_shown(os.path.join(last.dirpath, 'last.ckpt'))}")
    owner = Path(last.dirpath).parent / "config.yaml"
    config = owner if owner.is_file() else Path(trainer.log_dir) / "config.yaml"
    lines.append(f"next: python cli.py test --config {_shown(config)} --ckpt_path {keyword}")
    lines.append(f"      python cli.py predict --config {_shown(config)} --ckpt_path {keyword}")
    return lines


def _shown(path) -> str:
    """``path`` relative to the working directory when it lies below it (shorter to read and to
    copy), else as it is."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative
