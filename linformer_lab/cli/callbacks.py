"""What a fit under the CLI prints when it ends, is stopped by a signal or is interrupted (its checkpoint
callbacks: :mod:`linformer_lab.tasks.checkpointing`)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from linformer_lab.tasks.checkpointing import BestCheckpoint, LastCheckpoint, StopOnSignal

#: the logger of Lightning's rank_zero_info
rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")


def _callback(trainer: L.Trainer, cls: type):
    return next((c for c in trainer.callbacks if isinstance(c, cls)), None)


def stop_line(trainer: L.Trainer, exception: BaseException | None = None) -> tuple[str, int] | None:
    """The line and exit code (128 + the signal's number, as a shell reports it) of a run that ``exception``
    ended at once (Ctrl-C, or SIGTERM through Lightning's own handler), or without one, that
    :class:`StopOnSignal` stopped at the end of an update (None where it did not)."""
    stop = _callback(trainer, StopOnSignal)
    if exception is None and (stop is None or stop.stopped_at is None):
        return None
    sigterm = isinstance(exception, SIGTERMException) or (stop is not None and stop.received not in (None, "Ctrl-C"))
    cause = "SIGTERM" if sigterm else "Ctrl-C"
    return _interrupted_message(trainer, cause, exception is None), 128 + (signal.SIGTERM if sigterm else signal.SIGINT)


def _interrupted_message(trainer: L.Trainer, cause: str, at_update_end: bool) -> str:
    """One line after a fit ``cause`` cut short (at once, or at the end of an update by
    :class:`StopOnSignal`, which loses nothing): the step reached, the step ``last.ckpt`` holds and
    the updates lost."""
    step = trainer.global_step
    said = "interrupted (Ctrl-C)" if cause == "Ctrl-C" and not at_update_end else f"stopped by {cause}"
    if trainer.state.fn != "fit":
        return f"{said} during {trainer.state.fn.value}; it writes no checkpoint, and nothing of it was saved."
    last = _callback(trainer, LastCheckpoint)
    saved = last.saved_step() if last is not None else None
    if saved is None:
        return (f"{said} at step {step}: no checkpoint was saved, so all {step} updates are lost "
                f"(last.ckpt is written at every validation, and every --checkpoint.every_n_train_steps).")
    lost = step - saved
    updates = "nothing is" if lost == 0 else "the 1 update since is" if lost == 1 else f"the {lost} updates since are"
    return (f"{said} at step {step}: {os.path.join(last.dirpath, 'last.ckpt')} holds step {saved}, "
            f"so {updates} lost; --ckpt_path last with the same config resumes from step {saved}.")


def without_interrupt_notice(record) -> bool:
    """Logging filter: drops Lightning's "Detected KeyboardInterrupt", which :func:`stop_line` replaces."""
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
    best, last = _callback(trainer, BestCheckpoint), _callback(trainer, LastCheckpoint)
    if trainer.log_dir is None or last is None or last.dirpath is None:  # fast_dev_run, or checkpoints of the user's
        return []

    def shown(path) -> str:  # relative to the working directory when below it
        relative = os.path.relpath(path)
        return str(path) if relative.startswith("..") else relative

    owner = Path(last.dirpath).parent  # a resumed fit logs into a new version_N, its checkpoints stay the run's
    resumed = (owner / "config.yaml").is_file() and owner.resolve() != Path(trainer.log_dir).resolve()
    run = f"{shown(owner)} (this fit's logs: {shown(trainer.log_dir)})" if resumed else shown(trainer.log_dir)
    lines = [f"fit finished at step {trainer.global_step}: run folder {run}"]
    keyword = "last"
    if best is not None and best.best_model_path:
        score = best.best_model_score
        lines.append(f"  best checkpoint {shown(best.best_model_path)}"
                     f"{f' ({best.monitor} {float(score):.4f})' if score is not None else ''}")
        keyword = "best"
    lines.append(f"  resume point    {shown(os.path.join(last.dirpath, 'last.ckpt'))}")
    config = shown(owner / "config.yaml" if (owner / "config.yaml").is_file() else Path(trainer.log_dir) / "config.yaml")
    lines.append(f"next: python cli.py test --config {config} --ckpt_path {keyword}")
    lines.append(f"      python cli.py predict --config {config} --ckpt_path {keyword}")
    return lines
