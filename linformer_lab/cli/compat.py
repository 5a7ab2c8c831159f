"""Every private member of Lightning and jsonargparse the command line reads, named in one place,
and the forms of jsonargparse's error messages it reads facts from.

Lightning offers no public way to write ``last.ckpt`` at the moments
:class:`~linformer_lab.cli.callbacks.LastCheckpoint` needs (after every validation, at a
stop), nor to keep the CLI from loading a checkpoint before we check it; jsonargparse none to
list a parser's options for a did-you-mean, nor to retype an argument Lightning declared. Those
uses reach into private members, which a release may rename or remove without notice. Each one is
listed in :data:`MEMBERS` with what it is for, and read only through the functions below;
:func:`check` (which the CLI runs before any work) verifies they all exist, so an upgrade that
drops one stops at once with one line naming the member, not with an ``AttributeError`` at the
first save an hour into training. ``pyproject.toml`` pins the tested Lightning release.

jsonargparse hands its parser errors over as text only (a nested union's report is built as a
string), so the CLI's one-line errors read the facts (the option, the value, the expected types)
from that text: :data:`JSONARGPARSE_MESSAGES` holds every form read, and
``tests/cli/test_compat.py`` makes the installed jsonargparse produce each one.

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
    "MEMBERS", "UPSTREAM_WARNINGS", "CompatError", "check", "missing_members",
    "save_last_checkpoint", "last_saved_step", "saves_at_train_epoch_end", "stop_is_allowed",
    "parser_actions", "option_strings", "retype", "JSONARGPARSE_MESSAGES", "UNION_REPORT_FRAME",
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
    ("jsonargparse:ArgumentParser", "_actions",
     "the CLI retypes Lightning's int | float trainer arguments int-first"),
    ("jsonargparse:ArgumentParser", "_option_string_actions",
     "the CLI's did-you-mean for an unknown option compares it with the parser's options"),
    ("jsonargparse._typehints:ActionTypeHint", "_typehint",
     "the CLI retypes Lightning's int | float trainer arguments int-first"),
)

#: The forms of jsonargparse's parser errors the CLI reads (regular expressions; each names the
#: fact it captures). jsonargparse passes an error's facts as text only.
JSONARGPARSE_MESSAGES: dict[str, str] = {
    # "unrecognized arguments: --trainer.max_step 3" -> the words given
    "unrecognized": r"unrecognized arguments: (.*)",
    # an option of a subclass-mode group, from the command line or a config file: 'Parser key "model":
    # ... class_path '...CopyTask': ... Option 'n_layer' is not accepted' (a dataclass argument adds its
    # own 'Parser key "attention"' inside) -> each key (parser_key, below), the class_path it was
    # checked against, the option; the value given on the command line
    "nested_value": r"NestedArg\(key='[^']*', val=(.*)\)\s*$",
    "not_accepted": r"Option '([^']+)' is not accepted",
    "class_path": r"class_path '([\w.]+)'",
    # a config file's key of a plain group: "Group 'trainer' does not accept option 'max_step'", or
    # (after other options) "Subcommand 'fit' does not accept option 'trainer.max_step'"
    "group_option": r"(Group|Subcommand) '([\w.]+)' does not accept option '([^']+)'",
    # a value of the wrong type: 'Parser key "trainer.precision": ... Expected a typing.Literal[...]
    # ... Given value: 17' -> each key, the given value, the expected types
    "parser_key": r'Parser key "([^"]+)":',
    "given_value": r"(?:Given|Got) value: (.*)$",
    "expected": r"Expected an? (typing\.Literal\[.*\]|<class '[\w.]+'>|dot import path|path)",
}

#: The lines of jsonargparse's nested union report that frame its findings (by their start, after
#: the list marks ``- ``): the CLI keeps only the findings.
UNION_REPORT_FRAME = ("Does not validate", "Subtypes:", "Errors:", "Given value type:", "Problem with")

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


class CompatError(RuntimeError):
    """The installed Lightning or jsonargparse lacks a private member the CLI relies on (the message names it)."""


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:  # pragma: no cover - only the standalone pytorch-lightning package
        return "unknown"


def _owner(path: str):
    module, _, attributes = path.partition(":")
    owner = importlib.import_module(module)
    for name in attributes.split("."):
        owner = getattr(owner, name)
    return owner


def missing_members() -> list[str]:
    """``Owner.member (purpose)`` for every entry of :data:`MEMBERS` the installed Lightning or
    jsonargparse lacks.

    A member is looked up on the class (instance attributes such as ``_last_global_step_saved``
    or a parser's ``_actions`` are set in ``__init__``, so those are checked on a small instance)."""
    return [shown for _, shown in _missing()]


def _missing() -> list[tuple[str, str]]:
    """(distribution, ``Owner.member (purpose)``) for every member of :data:`MEMBERS` missing."""
    missing = []
    for path, member, purpose in MEMBERS:
        name = path.partition(":")[2]
        distribution = path.split(".")[0].split(":")[0]
        try:
            owner = _owner(path)
        except (ImportError, AttributeError):
            missing.append((distribution, f"{path.replace(':', '.')} ({purpose})"))
            continue
        if hasattr(owner, member) or member in _instance_attributes(owner):
            continue
        missing.append((distribution, f"{name}.{member} ({purpose})"))
    return missing


def _instance_attributes(owner) -> set[str]:
    import jsonargparse
    from lightning.pytorch.callbacks import ModelCheckpoint

    if owner is ModelCheckpoint:
        return set(vars(ModelCheckpoint()))
    if owner is jsonargparse.ArgumentParser:
        return set(vars(jsonargparse.ArgumentParser()))
    if owner.__name__ == "ActionTypeHint":  # what the parser makes of a typed argument
        parser = jsonargparse.ArgumentParser()
        try:
            parser.add_argument("--count", type=int | None)
        except AttributeError:  # a release whose action lacks a member it reads itself: reported as missing
            return set()
        return {name for action in vars(parser).get("_actions", []) if type(action) is owner for name in vars(action)}
    return set()


def _error(missing: list[tuple[str, str]]) -> CompatError:
    """One line naming the missing members, by the distribution (``lightning``, ``jsonargparse``) that lacks them."""
    by_distribution: dict[str, list[str]] = {}
    for distribution, shown in missing:
        by_distribution.setdefault(distribution, []).append(shown)
    lacks = "; ".join(f"{name} {_version(name)} lacks {', '.join(members)}" for name, members in by_distribution.items())
    return CompatError(
        f"{lacks}: a private member linformer_lab relies on (linformer_lab/cli/compat.py lists them); install "
        f"the release pyproject.toml pins (uv sync), or adapt cli/compat.py to this one."
    )


def check() -> None:
    """Raise :class:`CompatError` naming every member of :data:`MEMBERS` that is missing."""
    missing = _missing()
    if missing:
        raise _error(missing)


def _member(obj, name: str, distribution: str = "lightning"):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error([(distribution, f"{type(obj).__name__}.{name}")]) from None


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


# ---------------------------------------------------------------------- jsonargparse


def parser_actions(parser) -> list:
    """Every action (argument) of a jsonargparse ``parser``."""
    return list(_member(parser, "_actions", "jsonargparse"))


def option_strings(parser) -> list[str]:
    """Every option string of ``parser`` (``--trainer.max_steps``, ``-c``, ...)."""
    return list(_member(parser, "_option_string_actions", "jsonargparse"))


def retype(action, typehint) -> None:
    """Make a typed argument ``action`` of a jsonargparse parser parse its value as ``typehint``."""
    _member(action, "_typehint", "jsonargparse")
    action._typehint = typehint


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
