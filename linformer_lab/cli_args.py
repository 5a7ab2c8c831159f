"""The command line around parsing: ``--config NAME`` lookup under configs/, ``--ckpt_path last|best``
replaced by the file it resolved to (for DDP ranks), and the names of the
count-or-fraction trainer arguments (:data:`COUNT_OR_FRACTION`)."""

from __future__ import annotations

import sys
from pathlib import Path

#: configs/ of the source checkout (cli.py lives at its root); searched after ./configs.
REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

#: Trainer arguments typed ``int | float`` that Lightning reads as a count when given an int and
#: as a fraction when given a float: ``limit_val_batches=1`` is one batch, ``1.0`` all of them.
#: The CLI types them int-first (Lightning's float-first hint made every "1" a 1.0).
COUNT_OR_FRACTION = (
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches", "val_check_interval",
)


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
