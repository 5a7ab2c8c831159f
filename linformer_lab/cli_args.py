"""The command line before parsing: ``--config NAME`` lookup under configs/, and the integer
trainer arguments that the parser would turn into floats (:data:`COUNT_OR_FRACTION`)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

#: configs/ of the source checkout (cli.py lives at its root); searched after ./configs.
REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

#: Trainer arguments typed ``int | float`` that Lightning reads as a count when given an int and
#: as a fraction when given a float: ``limit_val_batches=1`` is one batch, ``1.0`` all of them.
#: jsonargparse (as pinned) hands every one of them over as a float, so the CLI restores the int
#: that the command line or the YAML wrote (:func:`integer_trainer_arguments`).
COUNT_OR_FRACTION = (
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches", "val_check_interval",
)



def integer_trainer_arguments(argv: list[str], subcommand: str | None) -> dict[str, int]:
    """The :data:`COUNT_OR_FRACTION` trainer arguments whose last setting in ``argv`` is written
    as an integer: a ``--trainer.NAME VALUE`` / ``--trainer.NAME=VALUE`` flag, or ``trainer: NAME:``
    in a ``--config`` file or inline YAML, read in command-line order (later settings win)."""
    written: dict[str, object] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            i += 1
        elif (arg in ("-c", "--config") or arg.startswith("--trainer.")) and i + 1 < len(argv):
            key, value = arg, argv[i + 1]
            i += 2
        else:
            i += 1
            continue
        if key in ("-c", "--config"):
            written.update(_trainer_settings_in_config(value, subcommand))
        elif key.startswith("--trainer.") and key[len("--trainer."):] in COUNT_OR_FRACTION:
            written[key[len("--trainer."):]] = value
    integers = {}
    for name, value in written.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            integers[name] = value
        elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            integers[name] = int(value)
    return integers


def _trainer_settings_in_config(source: str, subcommand: str | None) -> dict:
    """``trainer:`` entries of :data:`COUNT_OR_FRACTION` in a config file path or inline YAML."""
    try:
        text = Path(source).read_text() if Path(source).is_file() else source
        config = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return {}  # not ours to report: the parser names a bad config
    if not isinstance(config, dict):
        return {}
    if subcommand and isinstance(config.get(subcommand), dict):  # a config given before the subcommand
        config = config[subcommand]
    trainer = config.get("trainer")
    return {k: v for k, v in trainer.items() if k in COUNT_OR_FRACTION} if isinstance(trainer, dict) else {}


def find_config(value: str) -> str:
    """``--config`` value -> a path: as given if it exists, else ``configs/VALUE`` (also without
    the ``.yaml``) in the working directory, then in this checkout. Inline YAML passes through."""
    if "\n" in value or value.lstrip().startswith("{") or Path(value).exists():
        return value
    names = [value] if value.endswith((".yaml", ".yml", ".json")) else [value, f"{value}.yaml"]
    for folder in (Path("configs"), REPO_CONFIG_DIR):
        for name in names:
            if (folder / name).is_file():
                return str(folder / name)
    if value.endswith((".yaml", ".yml", ".json")):
        known = sorted(p.name for p in REPO_CONFIG_DIR.glob("*.yaml")) if REPO_CONFIG_DIR.is_dir() else []
        sys.stderr.write(
            f"error: config file {value!r} not found (looked in ., ./configs and {REPO_CONFIG_DIR}). "
            f"Known configs: {', '.join(known) or '(none)'}\n"
        )
        sys.exit(2)
    return value


def resolve_config_args(argv: list[str]) -> list[str]:
    """Rewrite every ``--config X`` / ``-c X`` / ``--config=X`` with :func:`find_config`."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "--config") and i + 1 < len(argv):
            out += [arg, find_config(argv[i + 1])]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + find_config(arg[len("--config="):])
        out.append(arg)
        i += 1
    return out
