"""Checkpoints under the CLI (docs/cli.md, "Resume"): every process logs into a new
``<root>/version_N/`` and a fresh fit keeps its checkpoints in ``version_N/checkpoints/`` (a resumed
fit keeps writing its run's); ``--ckpt_path last|best`` means the newest run *of the configured
model* under the root; a checkpoint is checked against the model before use
(:mod:`linformer_lab.tasks.checkpoint_files`), every fault reported in one line (exit code 2).
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path

import lightning as L

from linformer_lab.tasks.base import task_settings
from linformer_lab.tasks.checkpoint_files import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    OptimizerSettingsMismatchError,
    UnreadableCheckpointError,
    check_checkpoint,
)
from linformer_lab.tasks.checkpointing import BestCheckpoint, LastCheckpoint, StopOnSignal


@dataclass
class CheckpointSettings:
    """The CLI's default checkpointing, set with ``--checkpoint.NAME value`` or a ``checkpoint:`` block.

    Attributes:
        enabled: False adds no checkpoint callbacks (so does a ModelCheckpoint listed in
            ``trainer.callbacks``, or ``trainer.enable_checkpointing: false``).
        dirpath: where checkpoints go; None = the run's own ``version_N/checkpoints``. A fixed
            directory is shared by every run given it, so a fresh fit refuses one that already
            holds checkpoints (resume them with ``--ckpt_path last``).
        every_n_train_steps: also write ``last.ckpt`` every n optimizer steps (mid-epoch resume
            points between validations); None = after every validation and at the end.
        save_top_k: how many best checkpoints to keep (0 = none).
    """

    enabled: bool = True
    dirpath: str | None = None
    every_n_train_steps: int | None = None
    save_top_k: int = 1


class CheckpointSetupError(Exception):
    """The run cannot write its checkpoints safely (the message says why and what to do)."""


def default_checkpoint_callbacks(settings: CheckpointSettings, model: L.LightningModule, dirpath: str | None) -> list:
    """The best ``save_top_k`` by the task's ``monitor`` (if any), then ``last.ckpt``, which records the best,
    and the stop at the end of an update on Ctrl-C or SIGTERM, which ``last.ckpt`` holds."""
    task = task_settings(model)
    best = [BestCheckpoint(dirpath=dirpath, monitor=task.monitor, mode=task.monitor_mode, save_top_k=settings.save_top_k,
                           # the metric names hold '/', which would make sub-directories in a file name
                           filename="best-epoch={epoch}-step={step}", auto_insert_metric_name=False)]
    last = LastCheckpoint(dirpath, settings.every_n_train_steps)
    return (best if task.monitor and settings.save_top_k != 0 else []) + [last, StopOnSignal()]


def new_run_version(root: str | Path) -> int:
    """Create ``root/version_N`` with the lowest free N and return N: ``mkdir`` either creates it or
    fails, so two runs started at once never share one (the loggers' own scan can)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    n = max((int(p.name[8:]) for p in root.glob("version_*") if p.name[8:].isdigit()), default=-1) + 1
    while True:
        try:
            (root / f"version_{n}").mkdir()
            return n
        except FileExistsError:
            n += 1


def resumed_run_dir(checkpoint: str | None, root: str | Path) -> str | None:
    """The checkpoint folder of the run whose ``last.ckpt`` is ``checkpoint``, when it lives under
    ``root``. Only a last.ckpt continues its run: a fit from a best checkpoint is a new run."""
    if checkpoint is None or not Path(checkpoint).name.startswith("last"):
        return None
    folder = Path(checkpoint).resolve().parent
    return str(folder) if folder.name == "checkpoints" and Path(root).resolve() in folder.parents else None


def saved_run_checkpoint_dir(config_paths) -> Path | None:
    """The ``checkpoints/`` of the run whose saved config (``version_N/config.yaml``) is the last such
    among ``config_paths``: ``--ckpt_path last|best`` then means that run's, never a newer one's."""
    for path in reversed(list(config_paths)):
        folder = Path(str(path)).resolve().parent
        if (folder / "checkpoints").is_dir() or re.fullmatch(r"version_\d+", folder.name):
            return folder / "checkpoints"
    return None


def last_checkpoints(root: str | Path, dirpath: str | None = None) -> list[Path]:
    """Every ``last*.ckpt`` in ``dirpath``, else in every ``checkpoints/`` folder under ``root`` (a
    user logger's layout too), newest first."""
    found = Path(dirpath).glob("last*.ckpt") if dirpath else Path(root).glob("**/checkpoints/last*.ckpt")
    return sorted(found, key=os.path.getmtime, reverse=True)


def resolve_checkpoint_path(ckpt_path: str, model: L.LightningModule, root: str | Path, dirpath: str | None = None,
                            fitting: bool = True) -> str | None:
    """A ``--ckpt_path`` value -> the file it names, checked against ``model``: ``last``, the newest
    ``last.ckpt`` under ``root`` (or ``dirpath``) that fits (None for a fit without one), ``best``,
    the best checkpoint that records; ``hpc`` and ``registry`` are Lightning's. An unreadable newest
    ``last.ckpt`` (being written) stops rather than fall back to an older run."""
    if ckpt_path in ("hpc", "registry") or str(ckpt_path).startswith("registry:"):
        return None
    if ckpt_path not in ("last", "best"):
        check_checkpoint(str(ckpt_path), model, resuming=fitting)
        return str(ckpt_path)
    where, candidates, mismatches = dirpath or root, last_checkpoints(root, dirpath), []
    if not candidates and (ckpt_path == "best" or not fitting):
        raise CheckpointNotFoundError(f"--ckpt_path {ckpt_path}: no checkpoint found under {where}; train first (fit) "
                                      f"or pass a file.")
    for last in candidates:
        try:
            ckpt = check_checkpoint(str(last), model, resuming=fitting and ckpt_path == "last")
        except (UnreadableCheckpointError, CheckpointNotFoundError, OptimizerSettingsMismatchError):
            raise  # the newest run of this model: not one to look past
        except CheckpointMismatchError as err:  # another model's run: look further back
            mismatches.append(str(err))
            continue
        if ckpt_path == "last":
            return str(last)
        recorded = _best_from_last(ckpt)
        if recorded is None:
            raise CheckpointNotFoundError(
                f"--ckpt_path best: {last} records no best checkpoint: the run kept none (checkpoint.save_top_k 0, "
                f"or a task without a monitored metric) or has not validated yet. Pass a file, or use --ckpt_path last.")
        # a run folder renamed or copied keeps best and last together, while last.ckpt names the best by its old path
        best = next((p for p in (last.parent / Path(recorded).name, Path(recorded)) if p.is_file()), None)
        if best is None:
            raise CheckpointNotFoundError(
                f"--ckpt_path best: {last} records {recorded} as the best checkpoint, but that file is gone and "
                f"{last.parent} has none of its name. Pass a file, or use --ckpt_path last.")
        check_checkpoint(str(best), model, resuming=fitting)
        return str(best)
    if not candidates:
        return None
    raise CheckpointNotFoundError(f"--ckpt_path {ckpt_path}: none of the {len(candidates)} run(s) under {where} is of the "
                                  f"configured model; the newest: {mismatches[0]}")


def _best_from_last(ckpt: dict) -> str | None:
    """The best checkpoint's path a loaded last.ckpt records (the file may be gone)."""
    return next((state["best_model_path"] for key, state in (ckpt.get("callbacks") or {}).items()
                 if key.startswith("ModelCheckpoint") and state.get("best_model_path")), None)


def claim_checkpoint_dir(dirpath: str | Path, resume_from: str | None) -> object:
    """Make sure this fit may write into ``dirpath`` before any training; returns a lock to keep.
    Refused: a folder that cannot be written, one holding checkpoints this fit does not resume, one
    another process trains into (an ``flock`` on ``<dirpath>.lock``, released even when killed)."""
    folder = Path(dirpath)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointSetupError(f"cannot write checkpoints to {folder}: {err.strerror or err}. Choose a writable place "
                                   f"with --trainer.default_root_dir DIR (or --checkpoint.dirpath DIR).") from None
    existing = sorted(p.name for p in folder.glob("*.ckpt"))
    if existing and not (resume_from is not None and Path(resume_from).resolve().parent == folder.resolve()):
        raise CheckpointSetupError(
            f"{folder} already holds checkpoints of an earlier run ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); a new run would overwrite them. Resume that run with "
            f"--ckpt_path last, or give this one its own place: leave --checkpoint.dirpath unset (every run "
            f"then gets its own version_N/checkpoints) or pass another directory.")
    # beside the folder, not in it: Lightning warns about a non-empty checkpoint directory
    lock = open(folder.parent / f"{folder.name}.lock", "a+")  # noqa: SIM115 (held for the life of the process)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        owner = lock.read().strip() or "unknown"
        lock.close()
        raise CheckpointSetupError(
            f"another process (pid {owner}) is training into {folder} right now; two runs in one checkpoint "
            f"directory would overwrite each other's last.ckpt. Wait for it to finish, or start this run in "
            f"its own directory (without --ckpt_path, every fit gets a new version_N).") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
