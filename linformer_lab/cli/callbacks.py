"""What a fit under the CLI prints when it ends or is interrupted (its checkpoint callbacks:
:mod:`linformer_lab.tasks.checkpointing`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning as L

from linformer_lab.tasks.checkpointing import BestCheckpoint, LastCheckpoint

#: exit code of a run stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it
INTERRUPTED_EXIT_CODE = 130

#: the logger of Lightning's rank_zero_info
rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")


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
