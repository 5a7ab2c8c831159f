"""Checkpoints under the CLI (docs/cli.md, "Resume"): every process logs into a new
``<root>/version_N/`` and a fresh fit keeps its checkpoints in ``version_N/checkpoints/`` (a resumed
fit keeps writing its run's); ``--ckpt_path last|best`` means the newest run *of the configured
model* under the root; a checkpoint is checked against the model before use, every fault one
:class:`CheckpointMismatchError` subclass, reported in one line (exit code 2).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

from linformer_lab.cli.callbacks import BestCheckpoint, LastCheckpoint
from linformer_lab.tasks.base import task_settings
from linformer_lab.tasks.export import weight_problems


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


class CheckpointMismatchError(Exception):
    """A ``--ckpt_path`` that cannot be used with the configured model (the message says why)."""


class CheckpointNotFoundError(CheckpointMismatchError): ...  # no such file, or none that last|best finds
class UnreadableCheckpointError(CheckpointMismatchError): ...  # a directory, truncated, corrupt
class UnsafeCheckpointError(UnreadableCheckpointError): ...  # holds pickled objects: loading would run code
class OptimizerStateMismatchError(CheckpointMismatchError): ...  # saved for parameters in another order
class OtherTaskCheckpointError(CheckpointMismatchError): ...
class OtherAttentionCheckpointError(CheckpointMismatchError): ...
class OtherShapeCheckpointError(CheckpointMismatchError): ...  # architecture or weight shapes differ


class CheckpointSetupError(Exception):
    """The run cannot write its checkpoints safely (the message says why and what to do)."""


def default_checkpoint_callbacks(settings: CheckpointSettings, model: L.LightningModule, dirpath: str | None) -> list:
    """The best ``save_top_k`` by the task's ``monitor`` (if any), then ``last.ckpt``, which records the best."""
    task = task_settings(model)
    best = [BestCheckpoint(dirpath=dirpath, monitor=task.monitor, mode=task.monitor_mode, save_top_k=settings.save_top_k,
                           # the metric names hold '/', which would make sub-directories in a file name
                           filename="best-epoch={epoch}-step={step}", auto_insert_metric_name=False)]
    return (best if task.monitor and settings.save_top_k != 0 else []) + [LastCheckpoint(dirpath, settings.every_n_train_steps)]


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
        check_checkpoint(str(ckpt_path), model)
        return str(ckpt_path)
    where, candidates, mismatches = dirpath or root, last_checkpoints(root, dirpath), []
    if not candidates and (ckpt_path == "best" or not fitting):
        raise CheckpointNotFoundError(f"--ckpt_path {ckpt_path}: no checkpoint found under {where}; train first (fit) "
                                      f"or pass a file.")
    for last in candidates:
        try:
            ckpt = check_checkpoint(str(last), model)
        except (UnreadableCheckpointError, CheckpointNotFoundError):
            raise
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
        check_checkpoint(str(best), model)
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


def load_checkpoint_header(path: str) -> dict:
    """``torch.load`` a checkpoint on CPU (memory-mapped when possible) with ``weights_only=True``:
    tensors and plain data only (the tasks' hyper-parameters are), so a crafted file cannot run code."""
    if Path(path).is_dir():
        inside = sorted(p.name for p in Path(path).glob("*.ckpt"))
        raise UnreadableCheckpointError(
            f"checkpoint {path} is a directory, not a checkpoint file; pass a file in it"
            + (f" ({', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''})" if inside else "")
            + " or --ckpt_path last|best (which find the newest run's).")
    if not Path(path).is_file():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist.")
    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as mmap_err:  # files in torch's legacy (non-zip) format cannot be mapped
            if "mmap" not in str(mmap_err):
                raise
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # a payload must name something to call (a GLOBAL the safe loader refuses); else a damaged file
        found = re.search(r"GLOBAL (\S+)", str(err))
        if found is None:
            raise _unreadable(path, err) from None
        raise UnsafeCheckpointError(
            f"refused checkpoint {path}: it holds a pickled object other than tensors and plain data ({found.group(1)}), "
            f"which loading would run as code; checkpoints of this project hold none. Use a checkpoint you "
            f"trained or trust, written by this project's CLI.") from None
    except Exception as err:
        raise _unreadable(path, err) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise UnreadableCheckpointError(f"{path} is not a Lightning checkpoint: it holds a {type(ckpt).__name__}"
                                        f"{' without a state_dict' if isinstance(ckpt, dict) else ''}.")
    return ckpt


def _unreadable(path: str, err: Exception) -> UnreadableCheckpointError:
    if os.path.getsize(path) == 0:  # torch says only "EOFError" of a file with no bytes at all
        return UnreadableCheckpointError(f"checkpoint {path} is empty (0 bytes): a run killed while writing it, or a file "
                                         f"never written; use another checkpoint from the same directory.")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        # the safe loader's advice (retry with weights_only=False) is not ours; its finding is
        lines = [line for line in lines[1:] if not line.startswith(("Please file", "Check the documentation"))]
    return UnreadableCheckpointError(
        f"cannot read checkpoint {path}: {type(err).__name__}{f': {lines[0]}' if lines else ''}. The file is truncated, "
        f"corrupt or not a PyTorch checkpoint (e.g. a run killed while writing it); use another checkpoint from the same "
        f"directory.")


def check_checkpoint(path: str, model: L.LightningModule, ckpt: dict | None = None) -> dict:
    """The checkpoint at ``path``, loaded, or a :class:`CheckpointMismatchError` unless it fits
    ``model``: the same task class (``_class_path``), hyper-parameters (but the task's
    ``hparams_free_to_change``), state_dict keys and shapes, and optimizer state order."""
    ckpt = load_checkpoint_header(path) if ckpt is None else ckpt
    hparams = {k: v for k, v in (ckpt.get("hyper_parameters") or {}).items() if k not in ("_class_path", "_instantiator")}
    want_class = f"{type(model).__module__}.{type(model).__qualname__}"
    saved_class = (ckpt.get("hyper_parameters") or {}).get("_class_path")
    saved_config = next((d / "config.yaml" for d in Path(path).resolve().parents[:3] if (d / "config.yaml").is_file()), None)
    hint = (f" Evaluate with the configuration it was trained with: --config {saved_config} (its run's saved config)."
            if saved_config else " Evaluate with the configuration it was trained with (a run saves it as config.yaml "
                                 "in its version_N folder).")
    if saved_class is not None and saved_class != want_class:
        raise OtherTaskCheckpointError(f"checkpoint {path} belongs to another task: it was written by {saved_class}, but "
                                       f"the configuration builds {want_class}." + hint)
    ours, theirs = _flatten(dict(model.hparams)), _flatten(hparams)
    allowed = set(task_settings(model).hparams_free_to_change)
    differ = [key for key in sorted(theirs)
              if key in ours and key.split(".")[0] not in allowed and not _same(theirs[key], ours[key])]
    problems = [f"{key}: checkpoint {theirs[key]!r}, configuration {ours[key]!r}" for key in differ]
    problems += weight_problems(model.state_dict(), ckpt["state_dict"], "checkpoint")
    if problems:
        attention = any(key.split(".")[0] == "attention" for key in differ)
        error = OtherAttentionCheckpointError if attention else OtherShapeCheckpointError
        raise error(f"checkpoint {path} does not fit the configured {type(model).__name__}: " + "; ".join(problems[:8])
                    + ("; ..." if len(problems) > 8 else "") + "." + hint)
    # The optimizer state is keyed by position: modules registered in another order would resume with
    # each moment applied to another weight. Compared by shape, position by position.
    states = ckpt.get("optimizer_states") or []
    parameters = list(model.named_parameters())
    for index, state in sorted((states[0].get("state") or {}).items() if states and isinstance(states[0], dict) else []):
        saved = next((v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if isinstance(index, int) and index < len(parameters) and saved is not None \
                and tuple(saved.shape) != tuple(parameters[index][1].shape):
            raise OptimizerStateMismatchError(
                f"checkpoint {path}: its optimizer state does not line up with the model's parameters (position {index}, "
                f"{parameters[index][0]}: state {tuple(saved.shape)}, parameter {tuple(parameters[index][1].shape)}), so it "
                f"cannot resume; start a new run from its weights with --model.init_from {path}.")
    return ckpt


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "__dataclass_fields__"):
            v = {f: getattr(v, f) for f in v.__dataclass_fields__}
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a in (None, {}) and b in (None, {}):
        return True
    try:
        return bool(a == b)
    except Exception:
        return False
