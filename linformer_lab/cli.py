"""Command line of linformer_lab: ``python cli.py SUBCOMMAND --config NAME.yaml [--key value ...]``.

Subcommands: ``fit``, ``validate``, ``test``, ``predict`` (LightningCLI) and ``plugins`` (ours).
See docs/cli.md for the user's view; this module is the wiring:

* :func:`main` handles ``plugins`` itself (LightningCLI takes no extra subcommands), finds
  ``--config NAME.yaml`` under ``configs/`` when it is not in the working directory, discovers
  the entry-point plugins and runs :class:`LinformerCLI`.
* :class:`LinformerCLI` is a LightningCLI in subclass mode for model and data (any
  LightningModule / LightningDataModule, chosen by ``class_path``), which adds:
  - data -> model links (``vocab_size``, ``sequence_length``) read from the instantiated data module;
  - per-experiment directories: ``trainer.default_root_dir`` defaults to ``logs/<config name>``,
    checkpoints go to ``<root>/checkpoints`` (stable, so ``--ckpt_path last`` finds the previous
    run's) and metrics + the saved config to a new ``<root>/version_N`` per run;
  - default checkpointing (:class:`CheckpointSettings`, ``--checkpoint.*``): ``last.ckpt`` and
    the best checkpoint by the task's ``monitor`` / ``monitor_mode``;
  - precision fallback (fp16 AMP has no CPU kernels: ``16-mixed`` -> ``bf16-mixed`` on CPU);
  - a checkpoint check before any ``--ckpt_path`` is used: unreadable, other-task or
    other-shape checkpoints stop with one clear paragraph and exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError
from linformer_lab.tasks.base import task_settings

#: configs/ of the source checkout (cli.py lives at its root); searched after ./configs.
REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

#: Data-module attributes copied into the model argument of the same name when both exist
#: (jsonargparse skips a link whose source attribute or target argument is missing, so one list
#: serves every task). Add a name here to link a new one.
DATA_TO_MODEL_LINKS = ("vocab_size", "sequence_length", "num_phonemes")

CHECKPOINT_ERROR_EXIT_CODE = 2

#: Trainer arguments typed ``int | float`` that Lightning reads as a count when given an int and
#: as a fraction when given a float: ``limit_val_batches=1`` is one batch, ``1.0`` all of them.
#: jsonargparse (as pinned) hands every one of them over as a float, so the CLI restores the int
#: that the command line or the YAML wrote (:func:`integer_trainer_arguments`).
COUNT_OR_FRACTION = (
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches", "val_check_interval",
)


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


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


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
