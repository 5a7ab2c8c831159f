"""Checkpoints under the CLI: where they go (:class:`CheckpointSettings`, ``last.ckpt`` and the
best by the task's ``monitor``), how ``--ckpt_path last|best|PATH`` resolves, and the check that a
checkpoint fits the configured model before it is used (other task, other shapes, unreadable file:
one clear paragraph and exit code 2)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from linformer_lab.tasks.base import task_settings

CHECKPOINT_ERROR_EXIT_CODE = 2


@dataclass
class CheckpointSettings:
    """The CLI's default checkpointing, set with ``--checkpoint.NAME value`` or a ``checkpoint:`` block.

    Two ``ModelCheckpoint`` callbacks write to ``dirpath``: ``last.ckpt`` (always overwritten,
    what ``--ckpt_path last`` resumes from) and ``best-epoch=E-step=S.ckpt``, the best ``save_top_k``
    by the task's ``monitor`` attribute (e.g. ``val/loss``), saved after validation.

    Attributes:
        enabled: False adds no checkpoint callbacks (so does a ModelCheckpoint listed in
            ``trainer.callbacks``, or ``trainer.enable_checkpointing: false``).
        dirpath: where checkpoints go; None = ``<trainer.default_root_dir>/checkpoints``.
        every_n_train_steps: also write ``last.ckpt`` every n optimizer steps (mid-epoch resume
            points); None = after every validation / epoch end.
        save_top_k: how many best checkpoints to keep (0 = none).
    """

    enabled: bool = True
    dirpath: str | None = None
    every_n_train_steps: int | None = None
    save_top_k: int = 1


class CheckpointMismatchError(Exception):
    """A ``--ckpt_path`` cannot be used with the configured model (message says why)."""


class LastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for ``last.ckpt`` that also saves when training ends between two of its
    triggers (``max_steps`` mid-epoch, ``max_time``), so last.ckpt always holds the final weights."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run or self._last_global_step_saved == trainer.global_step:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def default_checkpoint_callbacks(settings: CheckpointSettings, model: L.LightningModule) -> list[ModelCheckpoint]:
    """``last.ckpt`` (every_n_train_steps or per validation, and at the end) and the best by ``model.monitor``."""
    callbacks = [
        LastCheckpoint(
            dirpath=settings.dirpath, save_top_k=0, save_last=True,
            every_n_train_steps=settings.every_n_train_steps,
            # one well-known last.ckpt, overwritten by a fresh run, rather than last-v1, last-v2 ...
            enable_version_counter=False,
        )
    ]
    monitor, monitor_mode, _ = task_settings(model)
    if monitor and settings.save_top_k != 0:
        callbacks.append(
            ModelCheckpoint(
                dirpath=settings.dirpath, monitor=monitor, mode=monitor_mode,
                save_top_k=settings.save_top_k,
                # the metric names hold '/', which would make sub-directories in a file name
                filename="best-epoch={epoch}-step={step}", auto_insert_metric_name=False,
            )
        )
    return callbacks


# ---------------------------------------------------------------------- checkpoint check


def resolve_checkpoint_path(ckpt_path: str, checkpoint_dir: str | None) -> str | None:
    """A ``--ckpt_path`` value -> the file it names, or None when there is none to check.

    ``last``: the newest ``last*.ckpt`` in the checkpoint directory (what Lightning picks too).
    ``best``: the best checkpoint recorded in ``last.ckpt``'s ModelCheckpoint state.
    Other keywords (``hpc``, ``registry``) are left to Lightning.
    """
    if ckpt_path in ("last", "best"):
        folder = Path(checkpoint_dir) if checkpoint_dir else None
        lasts = sorted(folder.glob("last*.ckpt"), key=os.path.getmtime) if folder and folder.is_dir() else []
        if not lasts:
            if ckpt_path == "best":
                raise_and_exit(f'--ckpt_path best: no checkpoint found in {checkpoint_dir}; train first (fit) or pass a file')
            return None
        if ckpt_path == "last":
            return str(lasts[-1])
        best = _best_from_last(str(lasts[-1]))
        if best is None:
            raise_and_exit(f"--ckpt_path best: {lasts[-1]} records no best checkpoint (is there a monitored metric?)")
        return best
    if ckpt_path in ("hpc", "registry") or str(ckpt_path).startswith("registry:"):
        return None
    return str(ckpt_path)


def _best_from_last(last_path: str) -> str | None:
    try:
        ckpt = torch.load(last_path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:
        return None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and state.get("best_model_path") and Path(state["best_model_path"]).is_file():
            return state["best_model_path"]
    return None


def raise_and_exit(message: str):
    sys.stderr.write(f"error: {message}\n")
    sys.exit(CHECKPOINT_ERROR_EXIT_CODE)


def load_checkpoint_header(path: str) -> dict:
    """``torch.load`` a checkpoint on CPU (memory-mapped when possible, so the weights are not read)."""
    if not Path(path).is_file():
        raise CheckpointMismatchError(f"checkpoint {path} does not exist.")
    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as mmap_err:  # files in torch's legacy (non-zip) format cannot be mapped
            if "mmap" not in str(mmap_err):
                raise
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointMismatchError(
            f"cannot read checkpoint {path}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}. "
            f"The file is truncated, corrupt or not a PyTorch checkpoint (e.g. a run killed while writing it); "
            f"use another checkpoint from the same directory."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointMismatchError(
            f"{path} is not a Lightning checkpoint: it holds a {type(ckpt).__name__}"
            f"{' without a state_dict' if isinstance(ckpt, dict) else ''}."
        )
    return ckpt


def check_checkpoint(path: str, model: L.LightningModule) -> None:
    """Raise :class:`CheckpointMismatchError` unless the checkpoint at ``path`` fits ``model``.

    Checked, in order: the file loads; it was written for the same task class (the
    ``_class_path`` LightningCLI stores in the hyper-parameters); the architecture
    hyper-parameters agree (all but the task's ``training_hparams``, e.g. the learning rate,
    which may differ when fine-tuning); the state_dict has the model's keys and shapes.
    """
    ckpt = load_checkpoint_header(path)
    hparams = dict(ckpt.get("hyper_parameters") or {})
    want_class = f"{type(model).__module__}.{type(model).__qualname__}"
    saved_class = hparams.pop("_class_path", None)
    hparams.pop("_instantiator", None)
    hint = (
        " Evaluate with the configuration the checkpoint was trained with: the run's saved config is "
        "<trainer.default_root_dir>/version_N/config.yaml (pass it with --config)."
    )
    if saved_class is not None and saved_class != want_class:
        raise CheckpointMismatchError(
            f"checkpoint {path} belongs to another task: it was written by {saved_class}, but the configuration "
            f"builds {want_class}." + hint
        )

    problems = []
    ours = _flatten(dict(model.hparams))
    allowed = set(task_settings(model)[2])
    for key, saved in sorted(_flatten(hparams).items()):
        if key in ours and key.split(".")[0] not in allowed and not _same(saved, ours[key]):
            problems.append(f"{key}: checkpoint {saved!r}, configuration {ours[key]!r}")

    state = ckpt["state_dict"]
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(v.shape)
    ]
    if missing:
        problems.append(f"{len(missing)} weights missing from the checkpoint (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} weights the model does not have (e.g. {', '.join(unexpected[:3])})")
    if shapes:
        problems.append(f"{len(shapes)} weights of another shape (e.g. {'; '.join(shapes[:3])})")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit the configured {type(model).__name__}: " + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "") + "." + hint
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
