"""Every private member of Lightning and jsonargparse linformer_lab reads, in the checkpoint callbacks
(``tasks/checkpointing.py``) and the CLI (:data:`MEMBERS`, read only through the functions below;
:func:`check`, run before any work, names a missing one in one line rather than an
``AttributeError`` an hour into training), the forms of jsonargparse's error messages the CLI
reads facts from (``tests/cli/test_compat.py`` makes the installed release write each), and the
upstream warnings and info lines no setting of ours can avoid.
"""

from __future__ import annotations

import importlib
import logging
import re
import warnings
from importlib.metadata import version

_CHECKPOINT, _CLI, _PARSER = ("lightning.pytorch.callbacks:ModelCheckpoint", "lightning.pytorch.cli:LightningCLI",
                               "jsonargparse:ArgumentParser")
#: (owner as ``module:attribute``, member, what linformer_lab uses it for)
MEMBERS: tuple[tuple[str, str, str], ...] = (
    (_CHECKPOINT, "_should_save_on_train_epoch_end",
     "LastCheckpoint saves where the best-model callback does (validation or epoch end)"),
    ("lightning.pytorch.loops.fit_loop:_FitLoop", "_can_stop_early",
     "LastCheckpoint ignores a stop that min_steps / min_epochs overrule"),
    (_CLI, "_parse_ckpt_path", "the CLI overrides it so the configuration, not the checkpoint, sets the model"),
    (_CLI, "_run_subcommand", "the CLI overrides it to release the checkpoint-directory lock after the run"),
    (_PARSER, "_actions", "the CLI retypes Lightning's int | float trainer arguments int-first"),
    (_PARSER, "_option_string_actions", "the CLI's did-you-mean for an unknown option compares it with the parser's options"),
    ("jsonargparse._typehints:ActionTypeHint", "_typehint", "the CLI retypes Lightning's int | float trainer arguments"),
)

#: The forms of jsonargparse's parser errors the CLI reads (each names the fact it captures).
JSONARGPARSE_MESSAGES: dict[str, str] = {
    # "unrecognized arguments: --trainer.max_step 3" -> the words given
    "unrecognized": r"unrecognized arguments: (.*)",
    # a subclass-mode group's option: 'Parser key "model": ... class_path '...CopyTask': ... Option
    # 'n_layer' is not accepted' (a dataclass argument adds its own 'Parser key "attention"' inside)
    "nested_value": r"NestedArg\(key='[^']*', val=(.*)\)\s*$",
    "not_accepted": r"Option '([^']+)' is not accepted",
    "class_path": r"class_path '([\w.]+)'",
    # a config file's key of a plain group, or (after other options) of the subcommand
    "group_option": r"(Group|Subcommand) '([\w.]+)' does not accept option '([^']+)'",
    # a value of the wrong type: 'Parser key "trainer.precision": ... Expected a typing.Literal[...] ... Given value: 17'
    "parser_key": r'Parser key "([^"]+)":',
    "given_value": r"(?:Given|Got) value: (.*)$",
    "expected": r"Expected an? (typing\.Literal\[.*\]|<class '[\w.]+'>|dot import path|path)",
}

#: The lines of jsonargparse's nested union report that frame its findings: the CLI keeps only the findings.
UNION_REPORT_FRAME = ("Does not validate", "Subtypes:", "Errors:", "Given value type:", "Problem with")

#: Lightning warnings of every normal run that nothing on our side avoids (regular expressions).
UPSTREAM_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # Lightning 2.6 builds torch's deprecated LeafSpec for every dataloader it wraps (torch >= 2.9 warns)
    (re.escape("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
               "treespec.is_leaf()` instead."), FutureWarning),
    # mixed precision keeps the weights in fp32, which is what the summary's fallback assumes
    (r"Precision (?:bf)?16-mixed is not supported by the model summary\.", UserWarning),
)
#: Lightning's advertisement printed at every command, by its start, and the loggers it comes through.
UPSTREAM_INFO: tuple[str, ...] = ("💡 Tip: For seamless cloud logging",)
UPSTREAM_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class CompatError(RuntimeError):
    """The installed Lightning or jsonargparse lacks a private member linformer_lab relies on."""


def _missing() -> list[tuple[str, str]]:
    """(distribution, ``Owner.member (purpose)``) for every member of :data:`MEMBERS` missing."""
    missing = []
    for path, member, purpose in MEMBERS:
        module, _, name = path.partition(":")
        try:
            owner = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            missing.append((module.split(".")[0], f"{path.replace(':', '.')} ({purpose})"))
            continue
        if not (hasattr(owner, member) or member in _instance_attributes(owner)):
            missing.append((module.split(".")[0], f"{name}.{member} ({purpose})"))
    return missing


def _instance_attributes(owner) -> set[str]:
    """The members ``owner`` sets in ``__init__``, read off a small instance."""
    import jsonargparse

    if owner is jsonargparse.ArgumentParser:
        return set(vars(owner()))
    if owner.__name__ == "ActionTypeHint":  # what the parser makes of a typed argument
        parser = jsonargparse.ArgumentParser()
        try:
            parser.add_argument("--count", type=int | None)
        except AttributeError:  # a release whose action lacks a member it reads itself: reported as missing
            return set()
        return {name for action in vars(parser).get("_actions", []) if type(action) is owner for name in vars(action)}
    return set()


def _error(missing: list[tuple[str, str]]) -> CompatError:
    """One line naming the missing members by the distribution that lacks them."""
    by_distribution: dict[str, list[str]] = {}
    for distribution, shown in missing:
        by_distribution.setdefault(distribution, []).append(shown)
    lacks = "; ".join(f"{name} {version(name)} lacks {', '.join(shown)}" for name, shown in by_distribution.items())
    return CompatError(f"{lacks}: a private member linformer_lab relies on (linformer_lab/compat.py lists them); "
                       f"install the release pyproject.toml pins (uv sync), or adapt compat.py to this one.")


def check() -> None:
    """Raise :class:`CompatError` naming every member of :data:`MEMBERS` that is missing."""
    if missing := _missing():
        raise _error(missing)


def _member(obj, name: str, distribution: str = "lightning"):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error([(distribution, f"{type(obj).__name__}.{name}")]) from None


def saves_at_train_epoch_end(callback, trainer) -> bool:
    """Whether ``callback`` saves at the training epoch's end rather than at validation end."""
    return _member(callback, "_should_save_on_train_epoch_end")(trainer)


def stop_is_allowed(trainer) -> bool:
    """False while ``min_steps`` / ``min_epochs`` overrule a requested stop."""
    return bool(_member(trainer.fit_loop, "_can_stop_early"))


def parser_actions(parser) -> list:
    return list(_member(parser, "_actions", "jsonargparse"))


def option_strings(parser) -> list[str]:
    return list(_member(parser, "_option_string_actions", "jsonargparse"))


def retype(action, typehint) -> None:
    """Make a typed argument ``action`` of a jsonargparse parser parse its value as ``typehint``."""
    _member(action, "_typehint", "jsonargparse")
    action._typehint = typehint


def _no_upstream_info(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(UPSTREAM_INFO)


def ignore_upstream_warnings() -> None:
    """Ignore :data:`UPSTREAM_WARNINGS` (call inside ``warnings.catch_warnings()`` to keep it local)
    and drop the :data:`UPSTREAM_INFO` lines from Lightning's info loggers."""
    for message, category in UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in UPSTREAM_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if _no_upstream_info not in logger.filters:
            logger.addFilter(_no_upstream_info)
