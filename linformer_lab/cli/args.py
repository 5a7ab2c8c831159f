"""The command line before Lightning: argv, ``--config`` look-up and one-line errors with a
did-you-mean, for :mod:`~linformer_lab.cli.entry` and :class:`~linformer_lab.cli.lightning_cli.LinformerCLI`.

* :func:`prepare_argv`: the argv LightningCLI gets: ``--config NAME`` looked up under configs/
  (:func:`find_config`), a top-level ``-c X`` moved behind the subcommand, and the task and data
  short names of ``--model.help`` / ``--data.help`` (:data:`HELP_NAMES`) made class paths.
* Faults found here are a :class:`UsageError`: one line with a did-you-mean, exit code 2.
  :func:`parse_error_line` turns the parser's own errors into such a line too (reading
  jsonargparse's message in the forms :data:`~linformer_lab.cli.compat.JSONARGPARSE_MESSAGES` lists).
* :data:`COUNT_OR_FRACTION`, the trainer arguments typed int-first, and :func:`with_ckpt_path`.

Nothing here imports torch or Lightning (nor does :mod:`linformer_lab.registry`):
``tests/cli/test_cli_startup.py`` checks that ``--help`` and ``plugins`` load neither.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import re
import typing
from pathlib import Path

from linformer_lab.cli.compat import JSONARGPARSE_MESSAGES, UNION_REPORT_FRAME

#: configs/ of the source checkout (cli.py lives at its root); searched after ./configs.
REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

#: Trainer arguments typed ``int | float`` that Lightning reads as a count when given an int and
#: as a fraction when given a float: ``limit_val_batches=1`` is one batch, ``1.0`` all of them.
#: The CLI types them int-first (Lightning's float-first hint made every "1" a 1.0).
COUNT_OR_FRACTION = (
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches", "val_check_interval",
)

#: The LightningCLI subcommands (``plugins`` is ours and needs no Lightning).
SUBCOMMANDS = {
    "fit": "train (and validate) a model",
    "validate": "run one validation epoch",
    "test": "run one test epoch",
    "predict": "predict and save the predictions",
}

#: Short names ``--model.help`` / ``--data.help`` accept for the built-in tasks and data modules
#: (besides a class name such as ``CopyTask`` or a full class path).
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

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")

#: The class whose arguments a plain group of the subcommands sets, for the did-you-mean of a
#: misspelt key of that group in a config file (the parser reporting it knows only its own options).
GROUP_CLASSES = {"trainer": "lightning.pytorch.Trainer"}


class UsageError(ValueError):
    """A command line :func:`main` refuses: its message is the one line printed, exit code 2."""


# ---------------------------------------------------------------------- suggestions


def did_you_mean(given: str, choices: typing.Iterable[str], cutoff: float = 0.6) -> str:
    """``"; did you mean X?"`` for the closest of ``choices`` (difflib), else ``""``."""
    close = difflib.get_close_matches(given, list(choices), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]}?" if close else ""


def suggest_option(flag: str, options: typing.Iterable[str]) -> str:
    """The did-you-mean for an unknown ``--group.name``: compared within its group first (the
    shared ``--trainer.`` prefix would make any two trainer flags look alike), then over all."""
    options = sorted(set(options))
    group, _, rest = flag.rpartition(".")
    same_group = {o[len(group) + 1:]: o for o in options if group and o.startswith(group + ".")}
    close = difflib.get_close_matches(rest, list(same_group), n=1, cutoff=0.6) if rest else []
    if close:
        return f"; did you mean {same_group[close[0]]}?"
    return did_you_mean(flag, options, cutoff=0.8)


def class_option_names(cls: type, prefix: str) -> list[str]:
    """Every ``--PREFIX.NAME`` that sets an argument of ``cls.__init__`` (its parents' too
    where it passes ``**kwargs`` on), one level into class-typed arguments:
    ``class_option_names(CopyTask, "model")`` holds ``--model.n_layers`` and
    ``--model.attention.backend``."""
    names = []
    for name, annotation in _init_parameters(cls):
        names.append(f"--{prefix}.{name}")
        for inner in _classes_in(annotation):
            names += [f"--{prefix}.{name}.{sub}" for sub, _ in _init_parameters(inner)]
    return names


def _init_parameters(cls: type) -> list[tuple[str, typing.Any]]:
    found = []
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        try:
            signature = inspect.signature(klass.__init__)
        except (TypeError, ValueError):  # a C-implemented __init__
            break
        try:
            hints = typing.get_type_hints(klass.__init__)
        except Exception:  # an annotation that does not resolve: names without types still help
            hints = {}
        params = list(signature.parameters.values())[1:]
        found += [(p.name, hints.get(p.name)) for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return found


def _classes_in(annotation) -> list[type]:
    """The classes of our own kind in an annotation (``AttentionConfig | None`` -> AttentionConfig)."""
    members = typing.get_args(annotation) or (annotation,)
    return [m for m in members if inspect.isclass(m) and m.__module__.split(".")[0] not in
            ("builtins", "typing", "collections", "torch", "pathlib")]


def parse_error_line(message: str, options: typing.Iterable[str], prog: str, argv: typing.Sequence[str] = ()) -> str | None:
    """One line for a jsonargparse error ``message`` about an unknown option, with a
    did-you-mean over ``options`` (the parser's own) and, for ``--model.*`` / ``--data.*``,
    the arguments of the class the message names; the config file of ``argv`` that holds the
    key, when one does. None when the error is of another kind."""
    def tip(flag: str) -> str:
        if flag.startswith(("--model.", "--data.")):
            return f"({prog} --config NAME --help lists the model's and data's options)"
        return f"({prog} --help lists the options)"

    unknown = re.match(JSONARGPARSE_MESSAGES["unrecognized"], message)
    if unknown:
        flag = next((word for word in unknown.group(1).split() if word.startswith("-")), unknown.group(1).split()[0])
        flag = flag.split("=", 1)[0]
        return f"error: unknown option {flag}{suggest_option(flag, options)} {tip(flag)}"
    candidates = list(options)
    in_group = re.search(JSONARGPARSE_MESSAGES["group_option"], message)  # a config's key of a plain group (trainer)
    rejected = list(re.finditer(JSONARGPARSE_MESSAGES["not_accepted"], message))
    if in_group:
        kind, group, option = in_group.groups()
        path = [*(group.split(".") if kind == "Group" else []), *option.split(".")]
        if path[0] in GROUP_CLASSES:  # reported by the top parser, whose options are not the subcommand's
            with contextlib.suppress(ImportError, AttributeError):
                candidates += class_option_names(import_class(GROUP_CLASSES[path[0]]), path[0])
    elif rejected:
        # the innermost rejection, under the keys that lead to it: 'Parser key "model"' (a group),
        # then 'Parser key "attention"' (a dataclass argument of the model), then the option
        before = message[:rejected[-1].start()]
        path = [*re.findall(JSONARGPARSE_MESSAGES["parser_key"], before), rejected[-1].group(1)]
        class_path = re.search(JSONARGPARSE_MESSAGES["class_path"], before)
        if class_path and len(path) > 1:
            # jsonargparse found the class a moment ago; without it the parser's own names remain
            with contextlib.suppress(ImportError, AttributeError):
                candidates += class_option_names(import_class(class_path.group(1)), path[0])
    else:
        return None
    flag = "--" + ".".join(path)
    source = config_holding(path, config_values(list(argv)))
    return f"error: unknown option {flag}{f' in {source}' if source else ''}{suggest_option(flag, candidates)} {tip(flag)}"


def config_holding(path: list[str], configs: typing.Sequence[str]) -> str | None:
    """The last of the config files ``configs`` that sets the key ``path`` (``["model", "n_layer"]``
    is ``model: {init_args: {n_layer: ...}}`` or ``model: {n_layer: ...}``); None when none does
    (the key came from the command line)."""
    import yaml

    for config in reversed(configs):
        try:
            node = yaml.safe_load(Path(config).read_text()) if Path(config).is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        for key in path:
            if isinstance(node, dict) and key not in node and isinstance(node.get("init_args"), dict):
                node = node["init_args"]
            node = node.get(key, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError:
            return config
    return None


def condense_parse_error(message: str) -> str:
    """jsonargparse's nested union report -> its informative lines (the bad value, the reason),
    without the structure around them (``Does not validate against any of the Union subtypes``)."""
    lines = [line.strip().lstrip("- ") for line in message.splitlines()]
    kept = [line for line in lines if line and not line.startswith(UNION_REPORT_FRAME)]
    return "; ".join(dict.fromkeys(kept)) or message


def import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


# ---------------------------------------------------------------------- configs


def config_dirs() -> list[Path]:
    return [Path("configs"), REPO_CONFIG_DIR]


def known_configs() -> list[str]:
    """Names of the shipped configs (``./configs`` and this checkout's ``configs/``)."""
    return sorted({p.name for folder in config_dirs() if folder.is_dir() for p in folder.iterdir()
                   if p.suffix in CONFIG_SUFFIXES})


def find_config(value: str) -> str:
    """``--config`` value -> a path: as given if it exists, else ``configs/VALUE`` (also without
    the ``.yaml``) in the working directory, then in this checkout. Inline YAML passes through;
    a name found nowhere is a :class:`UsageError` with the closest config's name."""
    if "\n" in value or ":" in value.split("/")[-1] or value.lstrip().startswith("{") or Path(value).exists():
        return value
    names = [value] if value.endswith(CONFIG_SUFFIXES) else [value, f"{value}.yaml"]
    for folder in config_dirs():
        for name in names:
            if (folder / name).is_file():
                return str(folder / name)
    wanted = Path(names[-1]).name
    known = known_configs()
    hint = did_you_mean(wanted, known) or f"; the configs are {', '.join(known) or '(none)'}"
    raise UsageError(f"error: config file {value!r} not found in ., ./configs or {REPO_CONFIG_DIR}{hint}")


def checked_config(value: str) -> str:
    """:func:`find_config`, and the file (or inline text) parsed as YAML: a syntax error is a
    :class:`UsageError` naming the file and the line (the parser would name "<unicode string>")."""
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


def resolve_config_args(argv: list[str]) -> list[str]:
    """Rewrite every ``--config X`` / ``-c X`` / ``--config=X`` with :func:`checked_config`."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "--config") and i + 1 < len(argv):
            out += [arg, checked_config(argv[i + 1])]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + checked_config(arg[len("--config="):])
        out.append(arg)
        i += 1
    return out


def config_values(argv: list[str]) -> list[str]:
    """The ``--config`` / ``-c`` values in ``argv``, in order."""
    return [argv[i + 1] if arg in ("-c", "--config") else arg[len("--config="):] for i, arg in enumerate(argv)
            if (arg in ("-c", "--config") and i + 1 < len(argv)) or arg.startswith("--config=")]


# ---------------------------------------------------------------------- argv


def help_class_path(group: str, value: str) -> str:
    """``--model.help`` / ``--data.help`` value -> a class path: a short name of
    :data:`HELP_NAMES`, a class name of one (``CopyTask``) or a class path (passed on)."""
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
    """The argv LightningCLI gets: a top-level ``-c X`` / ``--config X`` moved behind the
    subcommand (``-c X fit`` means ``fit --config X``), configs found (:func:`find_config`),
    ``--model.help`` / ``--data.help`` short names made class paths. Raises :class:`UsageError`."""
    leading, other, i = [], [], 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in ("-c", "--config") and i + 1 < len(argv):
            leading += argv[i:i + 2]
            i += 2
            continue
        (leading if argv[i].startswith("--config=") else other).append(argv[i])
        i += 1
    if i >= len(argv):
        raise UsageError(f"error: name a subcommand ({', '.join(SUBCOMMANDS)}, export, plot or plugins), e.g. "
                         f"cli.py fit {' '.join(leading) or '--config copy_linear.yaml'}")
    subcommand = argv[i]
    if subcommand not in SUBCOMMANDS:
        ours = ["export", "plot", "plugins"]  # answered by entry.py before Lightning
        raise UsageError(f"error: unknown subcommand {subcommand!r}{did_you_mean(subcommand, [*SUBCOMMANDS, *ours])} "
                         f"(choices: {', '.join([*SUBCOMMANDS, *ours])})")
    if other:
        raise UsageError(f"error: {' '.join(other)} goes after the subcommand: cli.py {subcommand} {' '.join(other)} ...")
    out = [subcommand, *leading, *argv[i + 1:]]
    for j in range(1, len(out) - 1):
        group = {"--model.help": "model", "--data.help": "data"}.get(out[j])
        if group:
            out[j + 1] = help_class_path(group, out[j + 1])
    for j, arg in enumerate(out):
        group, eq, value = arg.partition("=")
        if eq and group in ("--model.help", "--data.help"):
            out[j] = f"{group}={help_class_path(group[2:-5], value)}"
    return resolve_config_args(out)


def help_requested(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def with_ckpt_path(argv: list[str], path: str | None) -> list[str]:
    """``argv`` with every ``--ckpt_path last|best`` replaced by ``path`` (removed when None)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--ckpt_path" and i + 1 < len(argv) and argv[i + 1] in ("last", "best"):
            out += ["--ckpt_path", path] if path else []
            i += 2
            continue
        if argv[i] in ("--ckpt_path=last", "--ckpt_path=best"):
            out += [f"--ckpt_path={path}"] if path else []
        else:
            out.append(argv[i])
        i += 1
    return out
