"""Checkpoints under the CLI: where a run writes them, which file ``--ckpt_path last|best``
means, and the check that a checkpoint fits the configured model before it is used.

Layout: every process (fit, validate, test, predict) logs into a new
``<trainer.default_root_dir>/version_N/`` (metrics, the saved config), and a fresh ``fit`` keeps
its checkpoints in ``version_N/checkpoints/``: ``last.ckpt`` and the best ``save_top_k`` by the
task's ``monitor``. So no run ever writes into another's checkpoints; ``fit --ckpt_path last``
logs into a new version but continues writing the checkpoints of the run it resumes. ``last``
and ``best`` name the newest run *of the configured model* under the root (another backend or
size trained into the same root is skipped), so comparing attentions from one config is safe;
with a run's own saved config (``version_N/config.yaml``) they name that run's checkpoints.

Faults (a checkpoint of another task or shape, an unreadable file, a directory that cannot be
written or that another process is training into) stop before any work with one paragraph on
stderr and exit code 2.
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
from lightning.pytorch.callbacks import ModelCheckpoint

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
    """A ``--ckpt_path`` cannot be used with the configured model (message says why, in one line).

    The subclasses name the cause; the CLI reports each the same way (one line, exit code 2)."""


class CheckpointNotFoundError(CheckpointMismatchError):
    """The checkpoint is not there: a file that does not exist, ``--ckpt_path last|best`` finding
    none, or the best one ``last.ckpt`` records gone."""


class UnreadableCheckpointError(CheckpointMismatchError):
    """The file cannot be read as a Lightning checkpoint (a directory, truncated, corrupt)."""


class UnsafeCheckpointError(UnreadableCheckpointError):
    """The file holds pickled objects other than tensors and plain data: loading it could run code."""


class OptimizerStateMismatchError(CheckpointMismatchError):
    """The saved optimizer state does not line up with the model's parameters (saved in another order)."""


class OtherTaskCheckpointError(CheckpointMismatchError):
    """The checkpoint was written by another task class."""


class OtherAttentionCheckpointError(CheckpointMismatchError):
    """The checkpoint's attention (backend, feature map, their arguments) is not the configured one."""


class OtherShapeCheckpointError(CheckpointMismatchError):
    """Architecture hyper-parameters or weight shapes differ (the attention agrees)."""


class CheckpointSetupError(Exception):
    """The run cannot write its checkpoints safely (message says why and what to do)."""


def default_checkpoint_callbacks(settings: CheckpointSettings, model: L.LightningModule, dirpath: str) -> list[ModelCheckpoint]:
    """The best ``save_top_k`` by ``model.monitor`` (when it has one), then ``last.ckpt``, both in ``dirpath``.

    The order matters: Lightning calls checkpoint callbacks in list order, and last.ckpt must be
    written after the best-model record it carries has been updated.
    """
    callbacks: list[ModelCheckpoint] = []
    settings_of_task = task_settings(model)
    if settings_of_task.monitor and settings.save_top_k != 0:
        callbacks.append(
            BestCheckpoint(
                dirpath=dirpath, monitor=settings_of_task.monitor, mode=settings_of_task.monitor_mode,
                save_top_k=settings.save_top_k,
                # the metric names hold '/', which would make sub-directories in a file name
                filename="best-epoch={epoch}-step={step}", auto_insert_metric_name=False,
            )
        )
    callbacks.append(LastCheckpoint(dirpath, settings.every_n_train_steps))
    return callbacks


# ---------------------------------------------------------------------- run directories


def new_run_version(root: str | Path) -> int:
    """Create ``root/version_N`` with the lowest free N and return N.

    ``mkdir`` either creates the directory or fails, so two runs started at the same moment
    can never pick the same N (the loggers' own scan for a free version can).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[8:]) for p in root.glob("version_*") if p.name[8:].isdigit()]
    n = max(taken, default=-1) + 1
    while True:
        try:
            (root / f"version_{n}").mkdir()
            return n
        except FileExistsError:
            n += 1


def resumed_run_dir(checkpoint: str | None, root: str | Path) -> str | None:
    """The checkpoint directory of the run whose ``last.ckpt`` is ``checkpoint``, when that run
    lives under ``root``; else None. Only a run's last.ckpt continues the run: a fit from one of
    its best checkpoints (fine-tuning, a branch) is a new run with its own directory, and must
    not overwrite the original's resume point."""
    if checkpoint is None or not Path(checkpoint).name.startswith("last"):
        return None
    folder = Path(checkpoint).resolve().parent
    root = Path(root).resolve()
    if folder.name == "checkpoints" and root in folder.parents:
        return str(folder)
    return None


def saved_run_checkpoint_dir(config_paths) -> Path | None:
    """The ``checkpoints/`` folder of the run whose own saved config (``version_N/config.yaml``)
    is among ``config_paths`` (the last such one), else None.

    ``--ckpt_path last|best`` with such a config means *that* run's checkpoints, never a newer
    run of the same shape under the same root; a config from ``configs/`` names no run, and the
    newest matching run is meant. A run's folder is known by its ``checkpoints/`` or its name."""
    for path in reversed(list(config_paths)):
        folder = Path(str(path)).resolve().parent
        if (folder / "checkpoints").is_dir() or re.fullmatch(r"version_\d+", folder.name):
            return folder / "checkpoints"
    return None


def last_checkpoints(root: str | Path, dirpath: str | None = None) -> list[Path]:
    """Every ``last*.ckpt`` a ``--ckpt_path last|best`` may mean, newest first: in ``dirpath``
    when it is set, else in every ``checkpoints/`` folder under ``root`` (each run's
    ``version_N/checkpoints``, ``root/checkpoints`` of runs without a logger, a user logger's own)."""
    if dirpath:
        found = list(Path(dirpath).glob("last*.ckpt"))
    else:  # also a user logger's layout (e.g. root/lightning_logs/version_N/checkpoints)
        found = list(Path(root).glob("**/checkpoints/last*.ckpt"))
    return sorted(found, key=os.path.getmtime, reverse=True)


def resolve_checkpoint_path(
    ckpt_path: str, model: L.LightningModule, root: str | Path, dirpath: str | None = None, fitting: bool = True
) -> str | None:
    """A ``--ckpt_path`` value -> the file it names (checked against ``model``), or None.

    ``last``: the newest ``last.ckpt`` under ``root`` (or ``dirpath``) that fits the configured
    model; None when there is none at all and ``fitting`` (a fit then starts from scratch; an
    evaluation has nothing to evaluate and is refused). ``best``: the best checkpoint recorded in
    that ``last.ckpt``. A file is checked as given; other keywords (``hpc``, ``registry``) are
    left to Lightning. Raises :class:`CheckpointMismatchError`; an unreadable newest ``last.ckpt``
    (e.g. being written) stops rather than silently falling back to an older run.
    """
    if ckpt_path in ("hpc", "registry") or str(ckpt_path).startswith("registry:"):
        return None
    if ckpt_path not in ("last", "best"):
        check_checkpoint(str(ckpt_path), model)
        return str(ckpt_path)
    where = dirpath or root
    candidates = last_checkpoints(root, dirpath)
    if not candidates:
        if ckpt_path == "best" or not fitting:
            raise CheckpointNotFoundError(
                f"--ckpt_path {ckpt_path}: no checkpoint found under {where}; train first (fit) or pass a file."
            )
        return None
    mismatches = []
    for last in candidates:
        try:
            ckpt = check_checkpoint(str(last), model)
        except (UnreadableCheckpointError, CheckpointNotFoundError):  # the newest, being written or gone
            raise
        except CheckpointMismatchError as err:
            mismatches.append(str(err))
            continue
        if ckpt_path == "last":
            return str(last)
        recorded = _best_from_last(ckpt)
        if recorded is None:
            raise CheckpointNotFoundError(
                f"--ckpt_path best: {last} records no best checkpoint: the run kept none (checkpoint.save_top_k 0, "
                f"or a task without a monitored metric) or has not validated yet. Pass a file, or use --ckpt_path last."
            )
        # The callback writes best and last into one folder; a run folder that was renamed or
        # copied (fetched from a cluster) keeps them together, while last.ckpt still names the best
        # one by its old path, which may be gone or belong to the original run.
        best = next((p for p in (last.parent / Path(recorded).name, Path(recorded)) if p.is_file()), None)
        if best is None:
            raise CheckpointNotFoundError(
                f"--ckpt_path best: {last} records {recorded} as the best checkpoint, but that file is gone and "
                f"{last.parent} has none of its name. Pass a file, or use --ckpt_path last."
            )
        check_checkpoint(str(best), model)
        return str(best)
    raise CheckpointNotFoundError(
        f"--ckpt_path {ckpt_path}: none of the {len(candidates)} run(s) under {where} is of the configured model; "
        f"the newest: {mismatches[0]}"
    )


def _best_from_last(ckpt: dict) -> str | None:
    """The path a loaded last.ckpt's checkpoint callback recorded as its best (it may no longer exist)."""
    for key, state in (ckpt.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and state.get("best_model_path"):
            return state["best_model_path"]
    return None


def claim_checkpoint_dir(dirpath: str | Path, resume_from: str | None) -> object:
    """Make sure this fit may write into ``dirpath``, before any training; returns a lock to keep.

    Refused (:class:`CheckpointSetupError`): a directory that cannot be created or written (found
    now, not at the first save minutes later); one that already holds checkpoints of an earlier
    run this fit does not resume (they would be overwritten); one another process is training
    into right now (an exclusive ``flock`` on ``<dirpath>.lock`` beside it, released by the OS
    even when a run is killed).
    """
    folder = Path(dirpath)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointSetupError(
            f"cannot write checkpoints to {folder}: {err.strerror or err}. Choose a writable place with "
            f"--trainer.default_root_dir DIR (or --checkpoint.dirpath DIR)."
        ) from None
    existing = sorted(p.name for p in folder.glob("*.ckpt"))
    resuming_here = resume_from is not None and Path(resume_from).resolve().parent == folder.resolve()
    if existing and not resuming_here:
        raise CheckpointSetupError(
            f"{folder} already holds checkpoints of an earlier run ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); a new run would overwrite them. Resume that run with "
            f"--ckpt_path last, or give this one its own place: leave --checkpoint.dirpath unset (every run "
            f"then gets its own version_N/checkpoints) or pass another directory."
        )
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
            f"its own directory (without --ckpt_path, every fit gets a new version_N)."
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


# ---------------------------------------------------------------------- checkpoint check


def load_checkpoint_header(path: str) -> dict:
    """``torch.load`` a checkpoint on CPU (memory-mapped when possible, so the weights are not read)
    with ``weights_only=True``: tensors and plain data only, so a crafted file cannot run code.

    A Lightning checkpoint of the project's tasks holds nothing else (the tasks keep their
    hyper-parameters as plain data, ``Task.store_attention``); a file that holds other objects is
    refused (:class:`UnsafeCheckpointError`) before anything in it is built.
    """
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
        # A payload must name something to call (a GLOBAL the safe loader refuses); any other
        # refusal is a damaged file, reported as unreadable below.
        found = re.search(r"GLOBAL (\S+)", str(err))
        if found is None:
            raise _unreadable(path, err) from None
        raise UnsafeCheckpointError(
            f"refused checkpoint {path}: it holds a pickled object other than tensors and plain data ({found.group(1)}), "
            f"which loading would run as code; checkpoints of this project hold none. Use a checkpoint you "
            f"trained or trust, written by this project's CLI."
        ) from None
    except Exception as err:
        raise _unreadable(path, err) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise UnreadableCheckpointError(
            f"{path} is not a Lightning checkpoint: it holds a {type(ckpt).__name__}"
            f"{' without a state_dict' if isinstance(ckpt, dict) else ''}."
        )
    return ckpt


def _unreadable(path: str, err: Exception) -> UnreadableCheckpointError:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        # the safe loader's advice (retry with weights_only=False) is not ours; its finding is
        lines = [line for line in lines[1:] if not line.startswith(("Please file", "Check the documentation"))]
    first_line = lines[0] if lines else ""
    if os.path.getsize(path) == 0:  # torch says only "EOFError" of a file with no bytes at all
        return UnreadableCheckpointError(
            f"checkpoint {path} is empty (0 bytes): a run killed while writing it, or a file never written; "
            f"use another checkpoint from the same directory.")
    return UnreadableCheckpointError(
        f"cannot read checkpoint {path}: {type(err).__name__}{f': {first_line}' if first_line else ''}. "
        f"The file is truncated, corrupt or not a PyTorch checkpoint (e.g. a run killed while writing it); "
        f"use another checkpoint from the same directory."
    )


def check_checkpoint(path: str, model: L.LightningModule, ckpt: dict | None = None) -> dict:
    """Raise :class:`CheckpointMismatchError` unless the checkpoint at ``path`` fits ``model``;
    returns the loaded checkpoint (:func:`load_checkpoint_header`, or ``ckpt`` when already read).

    Checked, in order: the file loads; it was written for the same task class (the
    ``_class_path`` LightningCLI stores in the hyper-parameters); the architecture
    hyper-parameters agree (all but the task's ``hparams_free_to_change``, e.g. the learning rate,
    which may differ when fine-tuning); the state_dict has the model's keys and shapes.
    """
    ckpt = load_checkpoint_header(path) if ckpt is None else ckpt
    hparams = dict(ckpt.get("hyper_parameters") or {})
    want_class = f"{type(model).__module__}.{type(model).__qualname__}"
    saved_class = hparams.pop("_class_path", None)
    hparams.pop("_instantiator", None)
    saved_config = next((str(d / "config.yaml") for d in Path(path).resolve().parents[:3] if (d / "config.yaml").is_file()), None)
    hint = (
        f" Evaluate with the configuration it was trained with: --config {saved_config} (its run's saved config)."
        if saved_config else
        " Evaluate with the configuration it was trained with (a run saves it as config.yaml in its version_N folder)."
    )
    if saved_class is not None and saved_class != want_class:
        raise OtherTaskCheckpointError(
            f"checkpoint {path} belongs to another task: it was written by {saved_class}, but the configuration "
            f"builds {want_class}." + hint
        )

    problems, attention_differs = [], False
    ours = _flatten(dict(model.hparams))
    allowed = set(task_settings(model).hparams_free_to_change)
    for key, saved in sorted(_flatten(hparams).items()):
        if key in ours and key.split(".")[0] not in allowed and not _same(saved, ours[key]):
            problems.append(f"{key}: checkpoint {saved!r}, configuration {ours[key]!r}")
            attention_differs |= key.split(".")[0] == "attention"

    problems += weight_problems(model.state_dict(), ckpt["state_dict"], "checkpoint")
    if problems:
        error = OtherAttentionCheckpointError if attention_differs else OtherShapeCheckpointError
        raise error(
            f"checkpoint {path} does not fit the configured {type(model).__name__}: " + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "") + "." + hint
        )
    _check_optimizer_order(path, ckpt, model)
    return ckpt


def _check_optimizer_order(path: str, ckpt: dict, model: L.LightningModule) -> None:
    """The tasks hand ``self.parameters()`` to their optimizer, whose saved state is keyed by
    position: a checkpoint of a model whose modules were registered in another order would resume
    with each moment applied to another weight (an error deep in the first step, or silent nonsense
    when shapes agree). Compared here by shape, position by position."""
    states = ckpt.get("optimizer_states") or []
    if not states or not isinstance(states[0], dict):
        return
    parameters = list(model.named_parameters())
    for index, state in sorted((states[0].get("state") or {}).items()):
        if not isinstance(index, int) or index >= len(parameters):
            continue
        saved = next((v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        name, parameter = parameters[index]
        if saved is not None and tuple(saved.shape) != tuple(parameter.shape):
            raise OptimizerStateMismatchError(
                f"checkpoint {path}: its optimizer state does not line up with the model's parameters (position {index}, "
                f"{name}: state {tuple(saved.shape)}, parameter {tuple(parameter.shape)}), so it cannot resume; "
                f"start a new run from its weights with --model.init_from {path}."
            )


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "__dataclass_fields__"):
            v = {f: getattr(v, f) for f in v.__dataclass_fields__}
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
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
