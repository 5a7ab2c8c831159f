"""Command line of linformer_lab: ``python cli.py SUBCOMMAND --config NAME.yaml [--key value ...]``.

Subcommands: ``fit``, ``validate``, ``test``, ``predict`` (LightningCLI) and ``plugins`` (ours).
See docs/cli.md for the user's view; this module is the wiring:

* :func:`main` handles ``plugins`` itself (LightningCLI takes no extra subcommands), finds
  ``--config NAME.yaml`` under ``configs/`` when it is not in the working directory
  (:mod:`linformer_lab.cli_args`), discovers the entry-point plugins and runs :class:`LinformerCLI`.
* :class:`LinformerCLI` is a LightningCLI in subclass mode for model and data (any
  LightningModule / LightningDataModule, chosen by ``class_path``), which adds:
  - data -> model links (``vocab_size``, ``sequence_length``) read from the instantiated data module;
  - per-experiment directories: ``trainer.default_root_dir`` defaults to ``logs/<config name>``,
    checkpoints go to ``<root>/checkpoints`` (stable, so ``--ckpt_path last`` finds the previous
    run's) and metrics + the saved config to a new ``<root>/version_N`` per run;
  - default checkpointing (:class:`~linformer_lab.checkpoints.CheckpointSettings`,
    ``--checkpoint.*``): ``last.ckpt`` and the best checkpoint by the task's ``monitor`` /
    ``monitor_mode`` (:class:`~linformer_lab.tasks.base.Task`);
  - integers stay integers for the ``int | float`` trainer arguments (``limit_val_batches 1`` is
    one batch, not 100 %; :data:`~linformer_lab.cli_args.COUNT_OR_FRACTION`);
  - precision fallback (fp16 AMP has no CPU kernels: ``16-mixed`` -> ``bf16-mixed`` on CPU);
  - a checkpoint check before any ``--ckpt_path`` is used (:mod:`linformer_lab.checkpoints`):
    unreadable, other-task or other-shape checkpoints stop with one clear paragraph and exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from linformer_lab.checkpoints import (
    CHECKPOINT_ERROR_EXIT_CODE,
    CheckpointMismatchError,
    CheckpointSettings,
    check_checkpoint,
    default_checkpoint_callbacks,
    resolve_checkpoint_path,
)
from linformer_lab.cli_args import integer_trainer_arguments, resolve_config_args
from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError

#: Data-module attributes copied into the model argument of the same name when both exist
#: (jsonargparse skips a link whose source attribute or target argument is missing, so one list
#: serves every task). Add a name here to link a new one.
DATA_TO_MODEL_LINKS = ("vocab_size", "sequence_length", "num_phonemes")


class LinformerCLI(LightningCLI):
    """LightningCLI with model and data in subclass mode plus the defaults described in the module docstring.

    Example (what ``main`` does)::

        LinformerCLI(args=["fit", "--config", "configs/copy_linear.yaml", "--trainer.max_steps", "10"])
    """

    def __init__(self, args=None, run: bool = True, **kwargs):
        # what the user wrote, to tell an integer 1 from 1.0 after parsing (COUNT_OR_FRACTION)
        self._raw_args = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        kwargs.setdefault("seed_everything_default", 0)
        # Every run logs into its own version_N directory, so the saved config never collides;
        # overwrite=True covers runs that pin the logger version or disable the logger (then
        # the config lands in default_root_dir, the same place every time).
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(
            model_class=None,  # None = any LightningModule, chosen by class_path
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            **kwargs,
        )

    # ------------------------------------------------------------------ parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(CheckpointSettings, "checkpoint")
        for name in DATA_TO_MODEL_LINKS:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would load the checkpoint here (crashing on a corrupt file) and replace the
        # configured model arguments with the checkpoint's hyper-parameters, silently overriding
        # the command line. We keep the configuration as the source of truth and check the
        # checkpoint against it in after_instantiate_classes instead.
        return

    # ------------------------------------------------------------------ config fix-ups

    def _section(self):
        """The parsed config of the running subcommand (or the whole config without one)."""
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        config = self._section()
        _none_strings_to_none(config.get("model"))
        trainer = config.trainer
        if trainer.get("default_root_dir") is None:
            trainer.default_root_dir = str(Path("logs") / _experiment_name(config))
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        trainer.precision = resolve_precision(trainer.get("precision"), trainer.get("accelerator"))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:
            # A bad value found while building the classes (e.g. an unknown attention backend,
            # which AttentionConfig checks against the registry): one line, not jsonargparse's
            # nested union report. LINFORMER_LAB_TRACEBACK=1 shows the full traceback.
            if os.environ.get("LINFORMER_LAB_TRACEBACK"):
                raise
            root = _root_cause(err)
            sys.stderr.write(
                f"error: cannot build the configured classes: {type(root).__name__}: {root}\n"
                f"(set LINFORMER_LAB_TRACEBACK=1 for the traceback)\n"
            )
            sys.exit(2)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        config = self._get(self.config_init, "trainer")
        # here, not before instantiation: building the classes casts these back to float
        for name, value in integer_trainer_arguments(self._raw_args, self.subcommand).items():
            if isinstance(config.get(name), float) and config.get(name) == value:
                config[name] = value
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        settings: CheckpointSettings = self._get(self.config_init, "checkpoint")
        has_own = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        if not settings.enabled and not has_own:
            # "no checkpoints": otherwise Lightning would add its own default ModelCheckpoint
            config["enable_checkpointing"] = False
        if settings.enabled and config.get("enable_checkpointing") is not False and not has_own:
            callbacks += default_checkpoint_callbacks(settings, self.model)
        config["callbacks"] = callbacks
        if config.get("logger") in (None, True):
            config["logger"] = default_logger(config["default_root_dir"])
        return super().instantiate_trainer(**kwargs)

    def after_instantiate_classes(self) -> None:
        if not self.subcommand:
            return
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if not ckpt_path:
            return
        settings = self.config[self.subcommand].checkpoint
        path = resolve_checkpoint_path(ckpt_path, settings.dirpath)
        if path is None:
            return  # "last" before any checkpoint exists: Lightning warns and starts from scratch
        try:
            check_checkpoint(path, self.model)
        except CheckpointMismatchError as err:
            sys.stderr.write(f"error: {err}\n")
            sys.exit(CHECKPOINT_ERROR_EXIT_CODE)
        if ckpt_path == "best":  # Lightning only knows "best" inside the process that trained
            self.config_init[self.subcommand]["ckpt_path"] = path

    # ------------------------------------------------------------------ subcommands

    def predict(self, model, datamodule=None, ckpt_path=None, return_predictions=None, **kwargs):
        """Runs ``trainer.predict`` and saves the predictions to ``<log_dir>/predictions.pt``.

        Data modules without a predict split predict on their test split.
        """
        if datamodule is not None and not is_overridden("predict_dataloader", datamodule, L.LightningDataModule):
            rank_zero_info(f"{type(datamodule).__name__} has no predict split: predicting on its test split")
            datamodule.predict_dataloader = datamodule.test_dataloader
        predictions = self.trainer.predict(model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=True, **kwargs)
        log_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        rank = self.trainer.global_rank
        name = "predictions.pt" if self.trainer.world_size == 1 else f"predictions_rank{rank}.pt"
        log_dir.mkdir(parents=True, exist_ok=True)
        torch.save(predictions, log_dir / name)
        print(f"saved {len(predictions or [])} batches of predictions to {log_dir / name}")


# ---------------------------------------------------------------------- defaults


def _experiment_name(config) -> str:
    """Stem of the first --config file, else the model class name (for logs/<name>)."""
    for source in config.get("config") or []:
        path = getattr(source, "relative", None) or getattr(source, "absolute", None) or str(source)
        return Path(str(path)).stem
    class_path = (config.get("model") or {}).get("class_path") or "run"
    return class_path.rsplit(".", 1)[-1].lower()


def _none_strings_to_none(node) -> None:
    """Turn the string "None" back into None inside the model's arguments.

    jsonargparse 4.53 parses ``--model.attention.feature_map=null`` (a ``str | None`` field of a
    dataclass nested in a subclass-mode class) as the string "None"; from YAML it is None.
    """
    items = node.items() if hasattr(node, "items") else []
    for key, value in list(items):
        if value == "None":
            node[key] = None
        elif hasattr(value, "items"):
            _none_strings_to_none(value)


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def default_logger(save_dir: str):
    """TensorBoard when installed, else CSV; logs into ``save_dir/version_N`` (a new N per run)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if importlib.util.find_spec("tensorboard") is None:
        return CSVLogger(save_dir=save_dir, name="")
    return TensorBoardLogger(save_dir=save_dir, name="")


def _accelerator_is_cpu(accelerator) -> bool:
    if accelerator in (None, "auto"):
        return not (torch.cuda.is_available() or torch.backends.mps.is_available())
    if isinstance(accelerator, str):
        return accelerator == "cpu"
    return type(accelerator).__name__ == "CPUAccelerator"


def resolve_precision(precision, accelerator):
    """Map a precision the chosen device cannot run to the closest one it can (with a warning).

    * fp16 AMP (``16-mixed``/``16``) on CPU -> ``bf16-mixed``: autocast on CPU exists for bf16
      only; bf16 keeps the intent (mixed precision, half-size activations), while 32 would
      silently change memory and speed by 2x.
    * bf16 (``bf16-mixed``/``bf16``) on a CUDA GPU without bf16 support (pre-Ampere) -> ``16-mixed``.
    Anything else is returned unchanged (Lightning validates it).
    """
    if precision is None:
        return None
    value = str(precision)
    if _accelerator_is_cpu(accelerator) and value in ("16", "16-mixed"):
        rank_zero_warn(f"precision={value!r} (fp16 AMP) is not available on CPU; using 'bf16-mixed' instead")
        return "bf16-mixed"
    if (
        not _accelerator_is_cpu(accelerator)
        and value in ("bf16", "bf16-mixed")
        and torch.cuda.is_available()
        and not torch.cuda.is_bf16_supported()
    ):
        rank_zero_warn(f"precision={value!r}: this GPU has no bfloat16 support; using '16-mixed' instead")
        return "16-mixed"
    return precision


# ---------------------------------------------------------------------- plugins subcommand


def plugins_command(argv: list[str]) -> int:
    """``python cli.py plugins [--check] [--json]``: every registered backend and feature map
    with the distribution(s) that register it; ``--check`` also imports each one."""
    import argparse

    parser = argparse.ArgumentParser(prog="cli.py plugins", description=plugins_command.__doc__)
    parser.add_argument("--check", action="store_true", help="import every plugin and report failures")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    report = {}
    failed = False
    for title, registry in (("attention", ATTENTION), ("feature_maps", FEATURE_MAPS)):
        entries = []
        for name, dists in registry.distributions().items():
            entry = {"name": name, "distributions": dists, "status": "conflict" if len(dists) > 1 else "ok"}
            if args.check and len(dists) == 1:
                try:
                    registry.get(name)
                except PluginError as err:
                    entry["status"], failed = f"broken: {err}", True
            failed |= len(dists) > 1
            entries.append(entry)
        report[title] = {"group": registry.group, "plugins": entries}

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for title, section in report.items():
            print(f"{title} (entry-point group {section['group']!r}):")
            for e in section["plugins"]:
                status = "" if e["status"] == "ok" else f"  [{e['status']}]"
                print(f"  {e['name']:<16} {', '.join(e['distributions'])}{status}")
    return 1 if failed else 0


# ---------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cli.py``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plugins":
        return plugins_command(argv[1:])
    if argv[:1] in ([], ["-h"], ["--help"]):
        # LightningCLI's usage lists only its own subcommands
        print("subcommands: fit, validate, test, predict (below) and plugins (cli.py plugins --help); see docs/cli.md\n")
    argv = resolve_config_args(argv)
    # Discover the entry points (metadata only, no imports) before parsing, so a config naming a
    # third-party backend or feature map is validated against everything installed.
    ATTENTION.names()
    FEATURE_MAPS.names()
    # LightningCLI reads sys.argv; DDP also re-launches the other ranks from it, so it must hold
    # the resolved command.
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "cli.py"] + argv
    try:
        with warnings.catch_warnings():
            # Lightning's hint that it could use more dataloader workers: the copy data is
            # generated in the main process on purpose (0.1 ms per batch).
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            LinformerCLI()
    finally:
        sys.argv = saved_argv
    return 0
