"""The Lightning subcommands (``fit``, ``validate``, ``test``, ``predict``): :class:`LinformerCLI`, a
LightningCLI in subclass mode for model and data, and the first import of Lightning. LightningCLI
parses, instantiates and saves the config; this subclass adds (docs/cli.md) data -> model links, a
new ``version_N`` per run whose checkpoints never overwrite another run's, ``--ckpt_path last|best``
checked against the configured model, int-first ``int | float`` trainer arguments, the precision
fallback, and one-line errors (exit code 2) before anything is written.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import linformer_lab.compat as compat
from linformer_lab.cli import callbacks, checkpoints, checks
from linformer_lab.cli.args import COUNT_OR_FRACTION, SUBCOMMANDS, with_ckpt_path
from linformer_lab.cli.checks import exit_with_error
from linformer_lab.cli.export import use_export
from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError
from linformer_lab.tasks.base import Task
from linformer_lab.tasks.callbacks import RunTimeEstimate, StepsProgressBar
from linformer_lab.tasks.checkpoint_files import CheckpointMismatchError, read_checkpoint
from linformer_lab.tasks.checkpointing import DivergedError
from linformer_lab.validation import ConfigurationError

#: Data-module attributes linked to the model argument of the same name (jsonargparse skips a link
#: whose source or target is missing: one list serves every task).
DATA_TO_MODEL_LINKS = ("vocab_size", "sequence_length", "num_phonemes")
#: set to see the traceback behind a one-line error
TRACEBACK = "LINFORMER_LAB_TRACEBACK"


class LinformerArgumentParser(LightningArgumentParser):
    """Errors in one line (:func:`~linformer_lab.cli.checks.parse_error_line`), not a 60-line usage
    block; ``JSONARGPARSE_DEBUG=1`` shows jsonargparse's own report."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, ex)  # a parser asked to raise (jsonargparse's own lenient checks)
        parser = getattr(ex, "subcommand_parser", None) or self
        # "cli.py [options] fit" (the name in sys.argv[0]); a config's key is reported by the top parser
        subcommand = next((word for word in (parser.prog.split()[-1], *sys.argv[1:2]) if word in SUBCOMMANDS), None)
        options = [o for o in compat.option_strings(parser) if o.startswith("--")]
        prog = f"cli.py {subcommand}" if subcommand else "cli.py"
        sys.stderr.write(checks.parse_error_line(message, options, prog, sys.argv) + "\n")
        sys.exit(2)


class LinformerCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule chosen by ``class_path``, e.g.
    ``LinformerCLI(args=["fit", "--config", "configs/copy_linear.yaml", "--trainer.max_steps", "10"])``."""

    def __init__(self, args=None, run: bool = True, **kwargs):
        try:  # the private Lightning and jsonargparse members we rely on, before any work
            compat.check()
        except compat.CompatError as err:
            exit_with_error(str(err))
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_class", LinformerArgumentParser)
        # every run logs into its own version_N; a pinned logger version or none writes the same place each time
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                         args=args, run=run, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # argparse would take --trainer.limit_val for --trainer.limit_val_batches: a typo would set another argument
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Lightning types these float-first: "1" became 1.0 (all batches) in the run and the saved config
        for action in compat.parser_actions(parser):
            name = action.dest[len("trainer."):] if action.dest.startswith("trainer.") else None
            if name in COUNT_OR_FRACTION and name != "val_check_interval":  # that one is int-first already
                compat.retype(action, int | float | None)
        parser.add_class_arguments(checkpoints.CheckpointSettings, "checkpoint")
        for name in DATA_TO_MODEL_LINKS:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would load the checkpoint here (crashing on a corrupt file) and let its
        # hyper-parameters override the configuration; instantiate_trainer checks it against the configuration
        return

    def _section(self, config=None):
        """The running subcommand's part of ``config`` (default: the parsed config), or all of it."""
        config = self.config if config is None else config
        return config[self.subcommand] if self.subcommand else config

    def before_instantiate_classes(self) -> None:
        config = self._section()
        checks.none_strings_to_none(config.get("model"))
        trainer = config.trainer
        out_of_range = checks.trainer_value_error(trainer)
        if out_of_range:  # Lightning would find it after the run's folder is made, in a traceback
            exit_with_error(out_of_range)
        if trainer.get("default_root_dir") is None:
            trainer.default_root_dir = str(Path("logs") / checks.experiment_name(config))
        trainer.precision = checks.resolve_precision(trainer.get("precision"), trainer.get("accelerator"))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:  # e.g. an unknown attention backend: one line, not a nested union report
            if os.environ.get(TRACEBACK):
                raise
            root = err  # the first of ours down the cause chain (a PluginError names its distribution), else the root
            while root.__cause__ is not None and not isinstance(root, PluginError):
                root = root.__cause__
            exit_with_error(f"cannot build the configured classes: {type(root).__name__}: {root} "
                            f"({TRACEBACK}=1 shows the traceback)")

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        given = (self._section().get("model") or {}).get("init_args") or {}
        contradiction = checks.linked_argument_error(type(self.model), given, self.datamodule, DATA_TO_MODEL_LINKS)
        if contradiction:
            exit_with_error(contradiction)
        section = self._section(self.config_init)
        config, settings = section.get("trainer"), section.get("checkpoint")
        root, fitting = Path(config["default_root_dir"]), self.subcommand == "fit"
        resume = self._resolve_ckpt_path(root, settings)
        quick_check = bool(config.get("fast_dev_run"))  # Lightning then logs and saves nothing

        if self.subcommand and self.datamodule is not None and rank_zero_only.rank == 0 and not quick_check:
            # missing data stops the run before its folder is made (Lightning's call then has nothing to do)
            try:
                self.datamodule.prepare_data()
            except ConfigurationError as err:
                exit_with_error(str(err))

        # a new version_N for every process (a logger reopening an old one would delete its metrics.csv)
        if config.get("logger") in (None, True) and not quick_check:
            version = None
            if rank_zero_only.rank == 0:  # other DDP ranks get rank 0's directories by broadcast
                try:
                    version = checkpoints.new_run_version(root)
                except OSError as err:
                    exit_with_error(f"cannot create the run directory under {root}: {err.strerror or err}. "
                                    f"Choose a writable place with --trainer.default_root_dir DIR.")
                self._new_run_dir = root / f"version_{version}"
            from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

            config["logger"] = [CSVLogger(save_dir=str(root), name="", version=version)]  # metrics.csv, read by benchmarks
            if importlib.util.find_spec("tensorboard") is not None:
                config["logger"].append(TensorBoardLogger(save_dir=str(root), name="", version=version))

        listed = config.get("callbacks") or []  # the user's
        listed = list(listed) if isinstance(listed, (list, tuple)) else [listed]
        has_own = any(isinstance(c, ModelCheckpoint) for c in listed)
        if not settings.enabled and not has_own:  # else Lightning would add its own ModelCheckpoint
            config["enable_checkpointing"] = False
        ours = []
        if settings.enabled and config.get("enable_checkpointing") is not False and not has_own:
            ours = checkpoints.default_checkpoint_callbacks(settings, self.model, dirpath=None)
        # a bar whose total is what max_steps lets the epoch run, and how long a fit will take
        bar = [StepsProgressBar()] if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in listed) else []
        recipe = checks.cpu_recipe(checks.experiment_name(self._section()))
        estimate = [RunTimeEstimate(cpu_recipe=recipe)] if fitting and not quick_check else []
        config["callbacks"] = listed + bar + estimate + ours
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            if os.environ.get(TRACEBACK):
                raise
            self._stop(f"the trainer refuses the configuration: {str(err).strip().splitlines()[0]}")
        if isinstance(self.model, Task):  # data that does not fit the model, a backend the device cannot run
            try:
                self.model.check_run(self.datamodule, trainer.strategy.root_device)
            except ConfigurationError as err:
                self._stop(str(err))
            init_from = self.model.hparams.get("init_from")
            if fitting and init_from and resume:  # the checkpoint holds the weights: init_from is not read (it may be gone)
                self.model.init_from_applied = True
            elif fitting and init_from:  # a trained model of another attention to start from (tasks/conversion.py)
                try:
                    self.model.initialise_from(read_checkpoint(init_from), init_from)
                except (CheckpointMismatchError, ConfigurationError) as err:
                    self._stop(callbacks.init_from_error(err, init_from))

        if ours:
            pinned = self._saved_run_checkpoints()  # a resumed run keeps writing into its own folder
            resumed = checkpoints.resumed_run_dir(resume, root) or (
                checkpoints.resumed_run_dir(resume, Path(pinned).parent) if pinned else None)
            # log_dir is None under fast_dev_run (which saves nothing)
            dirpath = settings.dirpath or resumed or str(Path(trainer.log_dir or root) / "checkpoints")
            for callback in ours:
                callback.dirpath = os.path.realpath(dirpath)
            if fitting and trainer.is_global_zero and not quick_check:
                try:
                    # a CSV logger clears a non-empty log dir it opens later: open it before checkpoints/ exists
                    for logger in trainer.loggers:
                        logger.experiment  # noqa: B018
                    self._checkpoint_lock = checkpoints.claim_checkpoint_dir(dirpath, resume)  # held as long as this process
                except checkpoints.CheckpointSetupError as err:
                    self._stop(str(err))
                except OSError as err:
                    self._stop(f"cannot write the run's logs under {trainer.log_dir}: {err.strerror or err}. "
                               f"Choose a writable place with --trainer.default_root_dir DIR.")
        return trainer

    def _stop(self, message: str) -> None:
        """Stop before any work (exit code 2), leaving no folder behind."""
        self._discard_run_dir()
        exit_with_error(message)

    def _discard_run_dir(self) -> None:
        run_dir = getattr(self, "_new_run_dir", None)
        if run_dir is not None and not any(run_dir.glob("**/*.ckpt")):
            shutil.rmtree(run_dir, ignore_errors=True)

    def _resolve_ckpt_path(self, root: Path, settings: checkpoints.CheckpointSettings) -> str | None:
        """``--ckpt_path`` resolved and checked against the configured model; Lightning gets the file."""
        section = self._section(self.config_init)
        if not section.get("ckpt_path") or use_export(self.model, section, self.subcommand):  # an exported folder
            return None
        ckpt_path, dirpath = section["ckpt_path"], settings.dirpath or self._saved_run_checkpoints()
        try:
            path = checkpoints.resolve_checkpoint_path(ckpt_path, self.model, root, dirpath, fitting=self.subcommand == "fit")
        except CheckpointMismatchError as err:
            exit_with_error(str(err))
        if ckpt_path in ("last", "best"):
            # DDP's other ranks re-run sys.argv: they get the same file (the newest run could change
            # meanwhile); the saved config keeps what the user wrote
            section["ckpt_path"] = path
            sys.argv = with_ckpt_path(sys.argv, path)
            if rank_zero_only.rank == 0:
                print(f"--ckpt_path {ckpt_path}: {path or f'no checkpoint under {dirpath or root} yet; training from scratch'}")
        return path

    def _saved_run_checkpoints(self) -> str | None:
        """The checkpoints/ of the run whose saved config this command was given, if any."""
        sources = self._section().get("config") or []
        folder = checkpoints.saved_run_checkpoint_dir(getattr(s, "absolute", None) or str(s) for s in sources)
        return str(folder) if folder is not None else None

    def _run_subcommand(self, subcommand: str) -> None:
        sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C after the first; ours again after
        callbacks.rank_zero_log.addFilter(callbacks.without_interrupt_notice)
        try:
            super()._run_subcommand(subcommand)
        except SystemExit as stop:
            if self.trainer.state.status != TrainerStatus.INTERRUPTED:
                raise
            # Lightning ends a Ctrl-C with exit code 1: say instead what survives, with a shell's code for the signal
            line, code = callbacks.stop_line(self.trainer, stop)
            sys.stderr.write(f"{line}\n")
            raise SystemExit(code) from stop
        except ConfigurationError:  # refused at the start of the run (Task.setup): no folder left behind
            self._discard_run_dir()
            raise
        except DivergedError as err:  # the run's folder stays: its last.ckpt holds the last finite weights
            if self.trainer.is_global_zero:
                sys.stderr.write(f"error: {err}\n")
            raise SystemExit(1) from err
        finally:  # the checkpoint directory is free for the next run (also one in this process)
            signal.signal(signal.SIGINT, sigint)
            callbacks.rank_zero_log.removeFilter(callbacks.without_interrupt_notice)
            if getattr(self, "_checkpoint_lock", None) is not None:
                self._checkpoint_lock.close()

    def after_fit(self) -> None:
        stopped = callbacks.stop_line(self.trainer)
        if stopped is not None:  # Ctrl-C or SIGTERM, at the end of an update: nothing lost, but not finished
            if self.trainer.is_global_zero:
                sys.stderr.write(f"{stopped[0]}\n")
            raise SystemExit(stopped[1])
        # every rank reads trainer.log_dir (a broadcast under DDP: rank 0 alone would wait forever)
        lines = callbacks.finished_fit_lines(self.trainer)
        if lines and self.trainer.is_global_zero:
            print("\n".join(lines))

    def predict(self, model, datamodule=None, ckpt_path=None, return_predictions=None, **kwargs):
        """``trainer.predict`` into ``<log_dir>/predictions.pt``; one line where nothing says what to predict on."""
        if datamodule is not None and not any(
                is_overridden("predict_dataloader", owner, base)
                for owner, base in ((datamodule, L.LightningDataModule), (model, L.LightningModule))):
            self._stop(f"{type(datamodule).__name__} has no predict split (predict_dataloader), nor has "
                       f"{type(model).__name__}; give the data module one (linformer_lab.data.sampling."
                       f"PredictsOnTestSplit predicts on the test split)")
        previous = signal.signal(signal.SIGTERM, _raise_sigterm)  # Lightning's prediction loop would run on to its end
        try:
            predictions = self.trainer.predict(model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=True,
                                               **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)
        log_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        name = "predictions.pt" if self.trainer.world_size == 1 else f"predictions_rank{self.trainer.global_rank}.pt"
        log_dir.mkdir(parents=True, exist_ok=True)
        torch.save(predictions, log_dir / name)
        print(f"saved {len(predictions or [])} batches of predictions to {log_dir / name}")


def _raise_sigterm(signum, frame):
    raise SIGTERMException  # as validation and testing end on SIGTERM


def run_lightning_cli(argv: list[str]) -> int:
    """Run :class:`LinformerCLI` on ``argv`` (after :func:`~linformer_lab.cli.args.prepare_argv`); returns the exit code."""
    # the entry points (metadata only), so a config naming a third-party plugin is checked against all installed
    ATTENTION.names()
    FEATURE_MAPS.names()
    # LightningCLI reads sys.argv, and DDP re-launches the other ranks from it: it holds the resolved command
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "cli.py"] + argv
    try:
        with warnings.catch_warnings():
            # the copy data is generated in the main process on purpose: a batch costs far less than a step
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            compat.ignore_upstream_warnings()
            LinformerCLI()
    except SystemExit as done:  # --print_config, --model.help
        if done.code not in (0, None):
            raise
    except ConfigurationError as err:  # a check at the start of the run (Task.setup)
        if os.environ.get(TRACEBACK):
            raise
        sys.stderr.write(f"error: {err} ({TRACEBACK}=1 shows the traceback)\n")
        return checks.CHECKPOINT_ERROR_EXIT_CODE
    finally:
        sys.argv = saved_argv
    return 0
