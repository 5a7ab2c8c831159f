"""The command line before the parser (no torch, no Lightning): argv as LightningCLI gets it
(:func:`prepare_argv`), ``--config NAME`` found under configs/, :class:`UsageError` (one line, exit 2)."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path

#: configs/ of the source checkout (cli.py lives at its root); searched after ./configs.
REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")

#: Trainer arguments typed ``int | float`` that Lightning reads as a count when given an int and as a
#: fraction when given a float: the CLI types them int-first (``limit_val_batches 1`` is one batch).
COUNT_OR_FRACTION = (
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches", "val_check_interval",
)

#: The LightningCLI subcommands (``export``, ``plot`` and ``plugins`` are ours and need no Lightning).
SUBCOMMANDS = {
    "fit": "train (and validate) a model",
    "validate": "run one validation epoch",
    "test": "run one test epoch",
    "predict": "predict and save the predictions",
}

#: Short names ``--model.help`` / ``--data.help`` accept (besides a class name or a class path).
HELP_NAMES = {
    "model": {
        "copy": "linformer_lab.tasks.copy_task.CopyTask",
        "image": "linformer_lab.tasks.image_generation.ImageGenerationTask",
        "speech": "linformer_lab.tasks.speech.SpeechRecognitionTask",
    },
    "data": {
        "copy": "linformer_lab.data.copy.CopyDataModule",
        "mnist": "linformer_lab.data.images.MNISTDataModule",
        "cifar10": "linformer_lab.data.images.CIFAR10DataModule",
        "speech": "linformer_lab.data.speech.SpeechDataModule",
    },
}


class UsageError(ValueError):
    """A command line the CLI refuses: its message is the one line printed, exit code 2."""


def did_you_mean(given: str, choices: typing.Iterable[str], cutoff: float = 0.6) -> str:
    """``"; did you mean X?"`` for the closest of ``choices``, else ``""``."""
    close = difflib.get_close_matches(given, list(choices), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]}?" if close else ""


def known_configs() -> list[str]:
    """Names of the shipped configs (``./configs`` and this checkout's ``configs/``)."""
    return sorted({p.name for folder in (Path("configs"), REPO_CONFIG_DIR) if folder.is_dir() for p in folder.iterdir()
                   if p.suffix in CONFIG_SUFFIXES})


def find_config(value: str) -> str:
    """``--config`` value -> a path: as given if it exists, else ``configs/VALUE`` (also with ``.yaml``
    added) in the working directory, then in this checkout. Inline YAML passes through."""
    if "\n" in value or ":" in value.split("/")[-1] or value.lstrip().startswith("{") or Path(value).exists():
        return value
    names = [value] if value.endswith(CONFIG_SUFFIXES) else [value, f"{value}.yaml"]
    for folder in (Path("configs"), REPO_CONFIG_DIR):
        for name in names:
            if (folder / name).is_file():
                return str(folder / name)
    known = known_configs()
    hint = did_you_mean(Path(names[-1]).name, known) or f"; the configs are {', '.join(known) or '(none)'}"
    raise UsageError(f"error: config file {value!r} not found in ., ./configs or {REPO_CONFIG_DIR}{hint}")


def checked_config(value: str) -> str:
    """:func:`find_config`, and the file parsed as YAML: a syntax error names the file and the line
    (jsonargparse would name "<unicode string>")."""
    import yaml

    found = find_config(value)
    is_file = Path(found).is_file()
    try:
        yaml.safe_load(Path(found).read_text() if is_file else found)
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None) or str(err).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        after = f" ({context} from line {start.line + 1}, column {start.column + 1})" if context and start else ""
        name = f"config file {found}" if is_file else f"--config {found!r}"
        raise UsageError(f"error: {name} is not valid YAML: {problem}{where}{after}") from None
    return found


def option_places(argv: list[str], flags: tuple[str, ...] = ("-c", "--config")) -> list[tuple[int, str, str, str]]:
    """(index of the value, flag, what precedes the value in its argument, value) of every ``FLAG X``
    and ``FLAG=X`` in ``argv``: ``argv[index] = before + new`` replaces a value."""
    places = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags and eq:
            places.append((i, flag, flag + eq, value))
        elif arg in flags and i + 1 < len(argv):
            places.append((i + 1, arg, "", argv[i + 1]))
    return places


def resolve_config_args(argv: list[str]) -> list[str]:
    """Every ``--config X`` / ``-c X`` / ``--config=X`` of ``argv`` through :func:`checked_config`."""
    out = list(argv)
    for i, _, before, value in option_places(argv):
        out[i] = before + checked_config(value)
    return out


def config_values(argv: list[str]) -> list[str]:
    return [value for *_, value in option_places(argv)]


#: what :func:`config_value` answers for a key a config file does not set (None is a value: ``key: null``)
UNSET = object()


def config_value(config: str, path: list[str]):
    """What the config file ``config`` sets at ``path`` (``["model", "n_layer"]``: ``model: {init_args:
    {n_layer: ...}}`` or ``model: {n_layer: ...}``), else :data:`UNSET`."""
    import yaml

    try:
        node = yaml.safe_load(Path(config).read_text()) if Path(config).is_file() else None
    except (OSError, yaml.YAMLError):
        return UNSET
    for key in path:
        if isinstance(node, dict) and key not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]
        node = node.get(key, UNSET) if isinstance(node, dict) else UNSET
    return node


def help_class_path(group: str, value: str) -> str:
    """``--model.help`` / ``--data.help`` value -> a class path: a short name of :data:`HELP_NAMES`,
    a class name of one (``CopyTask``) or a class path (passed on)."""
    if "." in value:
        return value
    table = HELP_NAMES[group]
    by_class = {path.rsplit(".", 1)[1].lower(): path for path in table.values()}
    found = table.get(value.lower()) or by_class.get(value.lower())
    if found:
        return found
    choices = [*table, *(path.rsplit(".", 1)[1] for path in table.values())]
    raise UsageError(f"error: --{group}.help {value!r}: no such {'task' if group == 'model' else 'data module'}"
                     f"{did_you_mean(value, choices)} (choices: {', '.join(choices)}, or a class path)")


def prepare_argv(argv: list[str]) -> list[str]:
    """The argv LightningCLI gets: a top-level ``-c X`` moved behind the subcommand (``-c X fit`` means
    ``fit --config X``), configs found, ``--model.help`` / ``--data.help`` short names made class paths."""
    leading, other, i = [], [], 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in ("-c", "--config") and i + 1 < len(argv):
            leading += argv[i:i + 2]
            i += 2
            continue
        (leading if argv[i].startswith("--config=") else other).append(argv[i])
        i += 1
    ours = ["export", "plot", "plugins"]  # answered by entry.py before Lightning
    if i >= len(argv):
        raise UsageError(f"error: name a subcommand ({', '.join(SUBCOMMANDS)}, {', '.join(ours)}), e.g. "
                         f"cli.py fit {' '.join(leading) or '--config copy_linear.yaml'}")
    subcommand = argv[i]
    if subcommand not in SUBCOMMANDS:
        raise UsageError(f"error: unknown subcommand {subcommand!r}{did_you_mean(subcommand, [*SUBCOMMANDS, *ours])} "
                         f"(choices: {', '.join([*SUBCOMMANDS, *ours])})")
    if other:
        raise UsageError(f"error: {' '.join(other)} goes after the subcommand: cli.py {subcommand} {' '.join(other)} ...")
    out = [subcommand, *leading, *argv[i + 1:]]
    for j, flag, before, value in option_places(out, ("--model.help", "--data.help")):
        out[j] = before + help_class_path(flag[2:-5], value)
    return resolve_config_args(out)


def help_requested(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def with_ckpt_path(argv: list[str], path: str | None) -> list[str]:
    """``argv`` with every ``--ckpt_path last|best`` replaced by ``path`` (removed when None)."""
    out, drop = list(argv), set()
    for index, _, before, value in option_places(argv, ("--ckpt_path",)):
        if value not in ("last", "best"):
            continue
        if path:
            out[index] = before + path
        else:  # ``--ckpt_path=last`` is one argument, ``--ckpt_path last`` two
            drop |= {index} if before else {index - 1, index}
    return [arg for i, arg in enumerate(out) if i not in drop]
