"""A trained task's checkpoint, read without running code and checked against the task that will
use it: :func:`read_checkpoint` (a Lightning checkpoint, loaded with ``weights_only=True``, or an
exported folder), :func:`check_checkpoint` (the same task class, hyper-parameters, weight shapes and
optimizer order) and :func:`checkpoint_task` (the task a checkpoint was written by). Every fault is
one :class:`CheckpointMismatchError` subclass whose message is one line; ``cli.py`` prints it
before any work, a Python user catches it::

    ckpt = read_checkpoint("logs/copy_linear/version_0/checkpoints/last.ckpt")
    task = checkpoint_task(ckpt, "last.ckpt")
    task.load_state_dict(check_checkpoint("last.ckpt", task, ckpt)["state_dict"])
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import lightning as L
import torch

from linformer_lab.tasks.base import task_settings
from linformer_lab.tasks.conversion import differing_hparams
from linformer_lab.tasks.export import TASKS, ExportError, build_task, is_export, read_config, read_weights, weight_problems


class CheckpointMismatchError(Exception):
    """A checkpoint that cannot be used with the task at hand (``--ckpt_path``, ``--model.init_from``, or
    :func:`check_checkpoint` from Python): the one-line message says why."""


class CheckpointNotFoundError(CheckpointMismatchError): ...  # no such file, or none that last|best finds
class UnreadableCheckpointError(CheckpointMismatchError): ...  # a directory, truncated, corrupt
class UnsafeCheckpointError(UnreadableCheckpointError): ...  # holds pickled objects: loading would run code
class OptimizerStateMismatchError(CheckpointMismatchError): ...  # saved for parameters in another order
class OptimizerSettingsMismatchError(CheckpointMismatchError): ...  # a resumed fit would ignore configured settings
class OtherTaskCheckpointError(CheckpointMismatchError): ...
class OtherAttentionCheckpointError(CheckpointMismatchError): ...
class OtherShapeCheckpointError(CheckpointMismatchError): ...  # architecture or weight shapes differ


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


def check_checkpoint(path: str, model: L.LightningModule, ckpt: dict | None = None, resuming: bool = False) -> dict:
    """The checkpoint at ``path``, loaded, or a :class:`CheckpointMismatchError` unless it fits
    ``model``: the same task class (``_class_path``), hyper-parameters (but the task's
    ``hparams_free_to_change``; for a fit ``resuming`` from it, not its ``hparams_of_the_optimizer``:
    :func:`check_resumable`), state_dict keys and shapes, and optimizer state order."""
    ckpt = load_checkpoint_header(path) if ckpt is None else ckpt
    want_class = f"{type(model).__module__}.{type(model).__qualname__}"
    saved_class = (ckpt.get("hyper_parameters") or {}).get("_class_path")
    saved_config = next((d / "config.yaml" for d in Path(path).resolve().parents[:3] if (d / "config.yaml").is_file()), None)
    verb = "Resume" if resuming else "Evaluate"
    hint = (f" {verb} with the configuration it was trained with: --config {saved_config} (its run's saved config)."
            if saved_config else f" {verb} with the configuration it was trained with (a run saves it as config.yaml "
                                 "in its version_N folder).")
    if saved_class is not None and saved_class != want_class:
        raise OtherTaskCheckpointError(f"checkpoint {path} belongs to another task: it was written by {saved_class}, but "
                                       f"the configuration builds {want_class}." + hint)
    differ = differing_hparams(ckpt.get("hyper_parameters") or {}, dict(model.hparams),
                               task_settings(model).hparams_free_to_change)
    problems = list(differ.values())
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
    if resuming:
        check_resumable(path, model, ckpt)
    return ckpt


def check_resumable(path: str, model: L.LightningModule, ckpt: dict) -> None:
    """For a fit resumed from ``ckpt``: the optimizer and learning-rate schedule it restores set the
    task's ``hparams_of_the_optimizer``, so an :class:`OptimizerSettingsMismatchError` where the
    configuration holds others (they would be ignored without a word)."""
    keys = task_settings(model).hparams_of_the_optimizer
    differ = differing_hparams(ckpt.get("hyper_parameters") or {}, {k: v for k, v in model.hparams.items() if k in keys}, ())
    if differ:
        raise OptimizerSettingsMismatchError(
            f"checkpoint {path}: a fit resumed from it continues its optimizer and learning-rate schedule, which set "
            f"{'; '.join(differ.values())}, so the configuration's would be ignored. Resume with the checkpoint's values "
            f"(its run's saved config), or start a new run from its weights with these: --model.init_from {path}.")


def checkpoint_task(ckpt: dict, path: Path):
    """The task a loaded checkpoint was written by, built (untrained) from its hyper-parameters."""
    hparams = dict(ckpt.get("hyper_parameters") or {})
    if hparams.get("_class_path") is None:
        raise ExportError(f"checkpoint {path} does not name its task class (_class_path, which cli.py fit saves); "
                          f"export a task built in Python with task.save_pretrained(folder) (valid tasks: {', '.join(TASKS)})")
    return build_task(hparams["_class_path"], {k: v for k, v in hparams.items() if not k.startswith("_")}, path)


def read_checkpoint(path: str) -> dict:
    """``path`` read as a checkpoint: an exported folder as ``{"state_dict", "hyper_parameters"}``,
    anything else by :func:`load_checkpoint_header`."""
    if not is_export(path):
        return load_checkpoint_header(path)
    try:
        class_path, init_args = read_config(path)
        return {"state_dict": read_weights(path), "hyper_parameters": {**init_args, "_class_path": class_path}}
    except ExportError as err:
        raise UnreadableCheckpointError(str(err)) from None
