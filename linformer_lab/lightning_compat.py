"""Every private Lightning member linformer_lab relies on, named in one place.

Lightning offers no public way to write ``last.ckpt`` at the moments
:class:`~linformer_lab.checkpoint_callbacks.LastCheckpoint` needs (after every validation, at a
stop), nor to keep the CLI from loading a checkpoint before we check it. Those uses reach into
private members, which a Lightning release may rename or remove without notice. Each one is
listed in :data:`MEMBERS` with what it is for, and read only through the functions below;
:func:`check` (which the CLI runs before any work) verifies they all exist, so an upgrade that
drops one stops at once with one line naming the member, not with an ``AttributeError`` at the
first save an hour into training. ``pyproject.toml`` pins the tested Lightning release.

Also here: :data:`UPSTREAM_WARNINGS`, the exact messages of warnings that Lightning prints in
every run and that no setting of ours can avoid, and :data:`UPSTREAM_INFO`, its advertisement
line (:func:`ignore_upstream_warnings`).
"""

from __future__ import annotations

import importlib
import logging
import re
import warnings
from importlib.metadata import PackageNotFoundError, version

__all__ = [
    "MEMBERS", "UPSTREAM_WARNINGS", "LightningCompatError", "check", "missing_members",
    "save_last_checkpoint", "last_saved_step", "saves_at_train_epoch_end", "stop_is_allowed",
    "ignore_upstream_warnings", "UPSTREAM_INFO", "UPSTREAM_INFO_FILTER", "UPSTREAM_INFO_LOGGERS",
]

#: (owner as ``module:attribute.path``, member, what linformer_lab uses it for)
MEMBERS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.callbacks:ModelCheckpoint", "_save_last_checkpoint",
     "LastCheckpoint writes last.ckpt after every validation and at a stop"),
    ("lightning.pytorch.callbacks:ModelCheckpoint", "_monitor_candidates",
     "LastCheckpoint names last.ckpt from the logged metrics"),
    ("lightning.pytorch.callbacks:ModelCheckpoint", "_last_global_step_saved",
     "LastCheckpoint skips a second save at the same step"),
    ("lightning.pytorch.callbacks:ModelCheckpoint", "_should_save_on_train_epoch_end",
     "LastCheckpoint saves where the best-model callback does (validation or epoch end)"),
    ("lightning.pytorch.loops.fit_loop:_FitLoop", "_can_stop_early",
     "LastCheckpoint ignores a stop that min_steps / min_epochs overrule"),
    ("lightning.pytorch.cli:LightningCLI", "_parse_ckpt_path",
     "the CLI overrides it so the configuration, not the checkpoint, sets the model"),
    ("lightning.pytorch.cli:LightningCLI", "_run_subcommand",
     "the CLI overrides it to release the checkpoint-directory lock after the run"),
)

#: Lightning warnings printed in a normal run that nothing on our side can avoid, by exact
#: message (regular expressions anchored at the start). Lightning 2.6 builds torch's deprecated
#: ``LeafSpec`` for every dataloader it wraps (torch >= 2.9 warns about it at each fit).
UPSTREAM_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (re.escape("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
               "treespec.is_leaf()` instead."), FutureWarning),
    # at every fit in mixed precision (the configs' bf16-mixed): its size estimate falls back to 32 bits,
    # which is right, since mixed precision keeps the weights in fp32
    (r"Precision (?:bf)?16-mixed is not supported by the model summary\.", UserWarning),
)

#: Lightning's info lines printed at every command that say nothing about the run (an
#: advertisement for a cloud logger), by their start; :func:`ignore_upstream_warnings` drops them.
UPSTREAM_INFO: tuple[str, ...] = ("💡 Tip: For seamless cloud logging",)
#: The loggers Lightning's ``rank_zero_info`` writes through (Fabric's and the Trainer's).
UPSTREAM_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _UpstreamInfoFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(UPSTREAM_INFO)


UPSTREAM_INFO_FILTER = _UpstreamInfoFilter()


class LightningCompatError(RuntimeError):
    """The installed Lightning lacks a private member linformer_lab relies on (the message names it)."""


def _lightning_version() -> str:
    try:
        return version("lightning")
    except PackageNotFoundError:  # pragma: no cover - only the standalone pytorch-lightning package
        return "unknown"


def _owner(path: str):
    module, _, attributes = path.partition(":")
    owner = importlib.import_module(module)
    for name in attributes.split("."):
        owner = getattr(owner, name)
    return owner


def missing_members() -> list[str]:
    """``Owner.member (purpose)`` for every entry of :data:`MEMBERS` the installed Lightning lacks.

    A member is looked up on the class (instance attributes such as ``_last_global_step_saved``
    are set in ``__init__``, so those are checked on a default instance)."""
    missing = []
    for path, member, purpose in MEMBERS:
        name = path.partition(":")[2]
        try:
            owner = _owner(path)
        except (ImportError, AttributeError):
            missing.append(f"{path.replace(':', '.')} ({purpose})")
            continue
        if hasattr(owner, member) or member in _instance_attributes(owner):
            continue
        missing.append(f"{name}.{member} ({purpose})")
    return missing


def _instance_attributes(owner) -> set[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    if owner is ModelCheckpoint:
        return set(vars(ModelCheckpoint()))
    return set()


def _error(members: list[str]) -> LightningCompatError:
    return LightningCompatError(
        f"lightning {_lightning_version()} lacks {', '.join(members)}: a private member linformer_lab relies on "
        f"(linformer_lab/lightning_compat.py lists them); install the Lightning release pyproject.toml pins "
        f"(uv sync), or adapt lightning_compat.py to this one."
    )


def check() -> None:
    """Raise :class:`LightningCompatError` naming every member of :data:`MEMBERS` that is missing."""
    missing = missing_members()
    if missing:
        raise _error(missing)


def _member(obj, name: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error([f"{type(obj).__name__}.{name}"]) from None


# ---------------------------------------------------------------------- ModelCheckpoint


def save_last_checkpoint(callback, trainer) -> None:
    """Write ``callback``'s ``last.ckpt`` now, named from the metrics logged so far."""
    candidates = _member(callback, "_monitor_candidates")(trainer)
    _member(callback, "_save_last_checkpoint")(trainer, candidates)


def last_saved_step(callback) -> int:
    """The ``global_step`` of the last checkpoint ``callback`` wrote (0 before any)."""
    return _member(callback, "_last_global_step_saved")


def saves_at_train_epoch_end(callback, trainer) -> bool:
    """Whether ``callback`` saves at the training epoch's end (no validation in that epoch)
    rather than at validation end."""
    return _member(callback, "_should_save_on_train_epoch_end")(trainer)


# ---------------------------------------------------------------------- loops


def stop_is_allowed(trainer) -> bool:
    """False while ``min_steps`` / ``min_epochs`` overrule a requested stop."""
    return bool(_member(trainer.fit_loop, "_can_stop_early"))


# ---------------------------------------------------------------------- warnings


def ignore_upstream_warnings() -> None:
    """Install ``ignore`` filters for :data:`UPSTREAM_WARNINGS` (call inside ``warnings.catch_warnings()``
    to keep them local) and :data:`UPSTREAM_INFO_FILTER` on Lightning's info loggers."""
    for message, category in UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in UPSTREAM_INFO_LOGGERS:  # a logging filter outlives the block: it drops the UPSTREAM_INFO lines only
        logger = logging.getLogger(name)
        if UPSTREAM_INFO_FILTER not in logger.filters:
            logger.addFilter(UPSTREAM_INFO_FILTER)
