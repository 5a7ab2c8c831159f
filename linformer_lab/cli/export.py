"""``python cli.py export SOURCE [--ckpt_path best|last] [--output DIR]``: a trained model, rebuilt
from its checkpoint's hyper-parameters, as a folder of ``model.safetensors`` and ``config.json``
(:mod:`linformer_lab.tasks.export`) that ``linformer_lab.from_pretrained`` loads. The Lightning
commands read such a folder where they read a checkpoint (:func:`use_export`, ``--model.init_from``:
:func:`~linformer_lab.tasks.checkpoint_files.read_checkpoint`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from linformer_lab.cli import checkpoints
from linformer_lab.cli.checks import exit_with_error
from linformer_lab.tasks.checkpoint_files import (
    CheckpointMismatchError,
    check_checkpoint,
    checkpoint_task,
    load_checkpoint_header,
    read_checkpoint,
)
from linformer_lab.tasks.export import CONFIG_NAME, WEIGHTS_NAME, ExportError, is_export, save_pretrained


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        exit_with_error(f"{message} (cli.py export --help lists the options)")


def export_command(argv: list[str]) -> int:
    """``cli.py export``; returns the exit code (2 with one ``error:`` line for what it cannot use)."""
    parser = _OneLineParser(prog="cli.py export", description=(
        f"Write a trained model as OUTPUT/{WEIGHTS_NAME} and OUTPUT/{CONFIG_NAME}, which linformer_lab.from_pretrained "
        f"loads (and --ckpt_path OUTPUT for test and predict)."))
    parser.add_argument("source", help="a run folder (logs/NAME/version_N), a root of runs (logs/NAME: its newest run) "
                                       "or a checkpoint file")
    parser.add_argument("--ckpt_path", choices=("best", "last"), default="best",
                        help="of a folder: its best checkpoint (default) or its last.ckpt")
    parser.add_argument("--output", default=None, help="the folder to write (default: the run folder's export/)")
    args = parser.parse_args(argv)
    try:
        checkpoint = source_checkpoint(Path(args.source), args.ckpt_path)
        ckpt = load_checkpoint_header(str(checkpoint))
        task = checkpoint_task(ckpt, checkpoint)
        check_checkpoint(str(checkpoint), task, ckpt)
        task.load_state_dict(ckpt["state_dict"])
        # the run folder of version_N/checkpoints/X.ckpt, else the checkpoint's own folder
        run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
        output = Path(args.output) if args.output else run / "export"
        # new, empty or an earlier export (replaced): an export never mixes its files with others
        if output.exists() and not output.is_dir():
            raise ExportError(f"--output {output} is a file; name a folder (it is made if missing)")
        others = sorted(p.name for p in output.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME)) if output.is_dir() else []
        if others:
            raise ExportError(f"--output {output} holds other files ({', '.join(others[:3])}); name a new or empty folder, "
                              f"or one holding an earlier export")
        save_pretrained(task, output)
    except (CheckpointMismatchError, ExportError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    attention = task.hparams.get("attention") or {}
    print(f"exported {checkpoint} ({type(task).__name__}, attention {attention.get('backend')}"
          f"{'/' + attention['feature_map'] if attention.get('feature_map') else ''}, "
          f"{sum(t.numel() for t in task.state_dict().values()):,} values) to {output}/: {WEIGHTS_NAME}, {CONFIG_NAME}")
    print(f"load it with linformer_lab.from_pretrained({str(output)!r}), or --ckpt_path {output} for test and predict")
    return 0


def source_checkpoint(source: Path, which: str) -> Path:
    """The checkpoint ``cli.py export SOURCE --ckpt_path WHICH`` exports: a file as given, else the
    newest run's ``last.ckpt`` or the best one that records."""
    if source.is_file():
        return source
    if not source.is_dir():
        raise ExportError(f"{source} does not exist; pass a run folder (logs/NAME/version_N), a root of runs "
                          f"or a checkpoint file")
    # a root or run folder (runs keep checkpoints/last.ckpt), or a folder holding last.ckpt itself (--checkpoint.dirpath)
    runs = checkpoints.last_checkpoints(source) or checkpoints.last_checkpoints(source, str(source))
    if not runs:
        logged = " (a resumed fit writes into the checkpoints/ of the run it resumes, an evaluation writes none)" \
            if (source / "config.yaml").is_file() else ""
        raise ExportError(f"{source} holds no checkpoints/last.ckpt of a run{logged}; pass a run folder "
                          f"(logs/NAME/version_N), a root of runs or a checkpoint file")
    task = checkpoint_task(load_checkpoint_header(str(runs[0])), runs[0])
    return Path(checkpoints.resolve_checkpoint_path(which, task, source, dirpath=str(runs[0].parent), fitting=False))


def use_export(model, section: dict, subcommand: str) -> bool:
    """``--ckpt_path FOLDER`` naming an exported model (not for ``fit``: no optimizer state or step):
    checked against ``model``, its weights loaded, ``section["ckpt_path"]`` cleared; True when it did."""
    path = section.get("ckpt_path")
    if not path or not is_export(path):
        return False
    if subcommand == "fit":
        exit_with_error(f"--ckpt_path {path} is an exported model: weights only, no optimizer state or step to resume; "
                        f"start a new run from its weights with --model.init_from {path}")
    try:
        ckpt = check_checkpoint(path, model, read_checkpoint(path))
    except CheckpointMismatchError as err:
        exit_with_error(str(err))
    model.load_state_dict(ckpt["state_dict"])
    section["ckpt_path"] = None
    print(f"--ckpt_path {path}: an exported model; its weights are loaded")
    return True
