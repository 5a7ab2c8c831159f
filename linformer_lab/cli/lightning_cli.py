"""The Lightning subcommands of ``python cli.py SUBCOMMAND --config NAME.yaml [--key value ...]``:
``fit``, ``validate``, ``test``, ``predict``. See docs/cli.md for the user's view; this module is
the wiring:

* :func:`~linformer_lab.cli.entry.main` answers ``--help`` and ``plugins`` without importing
  Lightning, finds ``--config NAME.yaml`` under ``configs/`` and hands the rest to
  :func:`run_lightning_cli`, which discovers the entry-point plugins and runs :class:`LinformerCLI`;
* :class:`LinformerArgumentParser` makes the parser's errors one line with a did-you-mean;
* :class:`LinformerCLI` is a LightningCLI in subclass mode for model and data (any
  LightningModule / LightningDataModule, chosen by ``class_path``), which adds:
  - data -> model links (``vocab_size``, ``sequence_length``) read from the instantiated data module;
  - per-run directories: ``trainer.default_root_dir`` defaults to ``logs/<config name>``; every
    run gets a new ``<root>/version_N`` (metrics, saved config, ``checkpoints/``) and a resumed
    fit continues in the directory of the run it resumes (:mod:`linformer_lab.cli.checkpoints`);
  - default checkpointing (:class:`~linformer_lab.cli.checkpoints.CheckpointSettings`,
    ``--checkpoint.*``): ``last.ckpt`` after every validation and the best checkpoint by the
    task's ``monitor`` / ``monitor_mode`` (:class:`~linformer_lab.tasks.base.Task`);
  - the ``int | float`` trainer arguments typed int-first (``limit_val_batches 1`` is one batch,
    not 100 %, also in the saved config; :data:`~linformer_lab.cli.args.COUNT_OR_FRACTION`), and
    no abbreviated flags (``--trainer.limit_val`` is an error, not ``limit_val_batches``);
  - precision fallback (fp16 AMP has no CPU kernels: ``16-mixed`` -> ``bf16-mixed`` on CPU);
  - checks before any work, each one paragraph and exit code 2: a ``--ckpt_path`` that does not fit
    the configured model, a checkpoint directory that cannot be written or is in use, a model
    argument that contradicts the data it is linked to.
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
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import linformer_lab.cli.compat as compat
from linformer_lab.cli.args import (
    COUNT_OR_FRACTION,
    SUBCOMMANDS,
    condense_parse_error,
    help_requested,
    parse_error_line,
    with_ckpt_path,
)
from linformer_lab.cli.callbacks import (
    INTERRUPTED_EXIT_CODE,
    finished_fit_lines,
    init_from_error,
    interrupted_message,
    rank_zero_log,
    without_interrupt_notice,
)
from linformer_lab.cli.checkpoints import (
    CheckpointMismatchError,
    CheckpointSettings,
    CheckpointSetupError,
    claim_checkpoint_dir,
    default_checkpoint_callbacks,
    new_run_version,
    resolve_checkpoint_path,
    resumed_run_dir,
    saved_run_checkpoint_dir,
)
from linformer_lab.cli.checks import (
    CHECKPOINT_ERROR_EXIT_CODE,
    cpu_recipe,
    exit_with_error,
    experiment_name,
    linked_argument_error,
    none_strings_to_none,
    resolve_precision,
    trainer_value_error,
    type_error_line,
)
from linformer_lab.cli.export import read_checkpoint, use_export
from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError
from linformer_lab.tasks.base import Task
from linformer_lab.tasks.callbacks import RunTimeEstimate, StepsProgressBar
from linformer_lab.validation import ConfigurationError

#: Data-module attributes copied into the model argument of the same name when both exist
#: (jsonargparse skips a link whose source attribute or target argument is missing, so one list
#: serves every task). Add a name here to link a new one.
DATA_TO_MODEL_LINKS = ("vocab_size", "sequence_length", "num_phonemes")


class LinformerArgumentParser(LightningArgumentParser):
    """LightningCLI's parser whose errors are one line (no usage block, which runs to 56-64 lines
    here): an unknown option with a did-you-mean (:func:`~linformer_lab.cli.args.parse_error_line`),
    any other fault condensed. ``JSONARGPARSE_DEBUG=1`` shows jsonargparse's own report."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, ex)  # a parser asked to raise (jsonargparse's own lenient checks)
        parser = getattr(ex, "subcommand_parser", None) or self
        # "cli.py [options] fit" (the name in sys.argv[0]); a config's key is reported by the top parser
        subcommand = next((word for word in (parser.prog.split()[-1], *sys.argv[1:2]) if word in SUBCOMMANDS), None)
        prog = f"cli.py {subcommand}" if subcommand else "cli.py"
        options = [o for o in compat.option_strings(parser) if o.startswith("--")]
        line = parse_error_line(message, options, prog, sys.argv)
        if line is None:
            wrong_type = type_error_line(message, sys.argv)
            line = f"error: {wrong_type or condense_parse_error(message)} ({prog} --help lists the options)"
        sys.stderr.write(line + "\n")
        sys.exit(2)


class LinformerCLI(LightningCLI):
    """LightningCLI with model and data in subclass mode plus the defaults described in the module docstring.

    Example (what ``main`` does)::

        LinformerCLI(args=["fit", "--config", "configs/copy_linear.yaml", "--trainer.max_steps", "10"])
    """

    def __init__(self, args=None, run: bool = True, **kwargs):
        try:  # the private Lightning and jsonargparse members we rely on, before any work (cli/compat.py)
            compat.check()
        except compat.CompatError as err:
            exit_with_error(str(err))
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_class", LinformerArgumentParser)
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

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # argparse would take --trainer.limit_val for --trainer.limit_val_batches (and any other
        # unique prefix): a typo would silently set another argument
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Lightning types these Union[float, int, None]; parsed float-first, "1" became 1.0 (all
        # batches) in the run and in the saved config. Int-first keeps 1 a count and 1.0 a fraction.
        for action in compat.parser_actions(parser):
            name = action.dest[len("trainer."):] if action.dest.startswith("trainer.") else None
            if name in COUNT_OR_FRACTION and name != "val_check_interval":  # that one is int-first already
                compat.retype(action, int | float | None)
        parser.add_class_arguments(CheckpointSettings, "checkpoint")
        for name in DATA_TO_MODEL_LINKS:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would load the checkpoint here (crashing on a corrupt file) and replace the
        # configured model arguments with the checkpoint's hyper-parameters, silently overriding
        # the command line. We keep the configuration as the source of truth and check the
        # checkpoint against it in instantiate_trainer instead.
        return

    # ------------------------------------------------------------------ config fix-ups

    def _section(self):
        """The parsed config of the running subcommand (or the whole config without one)."""
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        config = self._section()
        none_strings_to_none(config.get("model"))
        trainer = config.trainer
        out_of_range = trainer_value_error(trainer)
        if out_of_range:  # Lightning would find it after the run's folder is made, in a traceback
            exit_with_error(out_of_range)
        if trainer.get("default_root_dir") is None:
            trainer.default_root_dir = str(Path("logs") / experiment_name(config))
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
                f"error: cannot build the configured classes: {type(root).__name__}: {root} "
                f"(LINFORMER_LAB_TRACEBACK=1 shows the traceback)\n"
            )
            sys.exit(CHECKPOINT_ERROR_EXIT_CODE)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        given = (self._section().get("model") or {}).get("init_args") or {}
        contradiction = linked_argument_error(type(self.model), given, self.datamodule, DATA_TO_MODEL_LINKS)
        if contradiction:
            exit_with_error(contradiction)
        section = self.config_init.get(str(self.subcommand), self.config_init)
        config = section.get("trainer")
        settings: CheckpointSettings = section.get("checkpoint")
        root = Path(config["default_root_dir"])
        fitting = self.subcommand == "fit"
        resume = self._resolve_ckpt_path(root, settings)
        quick_check = bool(config.get("fast_dev_run"))  # Lightning then logs and saves nothing

        if self.subcommand and self.datamodule is not None and rank_zero_only.rank == 0 and not quick_check:
            # Data that is not there (files, a corpus root) stops the run before its folder is
            # made; Lightning calls prepare_data again, which then has nothing left to do. (A
            # CLI built without a subcommand, run=False, only builds the classes.)
            try:
                self.datamodule.prepare_data()
            except ConfigurationError as err:
                exit_with_error(str(err))

        # Every process logs into a new version_N (a logger reopening an old one would delete its
        # metrics.csv); a resumed fit keeps writing checkpoints where the run it resumes did.
        if config.get("logger") in (None, True) and not quick_check:
            version = None
            if rank_zero_only.rank == 0:  # other DDP ranks get rank 0's directories by broadcast
                try:
                    version = new_run_version(root)
                except OSError as err:
                    exit_with_error(f"cannot create the run directory under {root}: {err.strerror or err}. "
                                    f"Choose a writable place with --trainer.default_root_dir DIR.")
                self._new_run_dir = root / f"version_{version}"
            config["logger"] = default_logger(str(root), version)

        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        has_own = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        if not settings.enabled and not has_own:
            # "no checkpoints": otherwise Lightning would add its own default ModelCheckpoint
            config["enable_checkpointing"] = False
        ours = []
        if settings.enabled and config.get("enable_checkpointing") is not False and not has_own:
            ours = default_checkpoint_callbacks(settings, self.model, dirpath=None)
        # a bar whose total is what max_steps lets the epoch run, not the whole epoch
        bar = [StepsProgressBar()] if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks) else []
        # every fit says once how long it will take (on a CPU, for a GPU-sized config, its CPU recipe)
        recipe = cpu_recipe(experiment_name(self._section()))
        estimate = [RunTimeEstimate(cpu_recipe=recipe)] if fitting and not quick_check else []
        config["callbacks"] = callbacks + bar + estimate + ours
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            # a value Lightning refuses that the checks before did not know: one line, no folder
            if os.environ.get("LINFORMER_LAB_TRACEBACK"):
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
                    self._stop(init_from_error(err, init_from))

        if ours:
            run_dir = trainer.log_dir or str(root)  # None under fast_dev_run (which saves nothing)
            pinned = self._saved_run_checkpoints()  # a resumed run keeps writing into its own folder
            resumed = resumed_run_dir(resume, root) or (resumed_run_dir(resume, Path(pinned).parent) if pinned else None)
            dirpath = settings.dirpath or resumed or str(Path(run_dir) / "checkpoints")
            for callback in ours:
                callback.dirpath = os.path.realpath(dirpath)
            if fitting and trainer.is_global_zero and not quick_check:
                try:
                    # a CSV logger warns about (and clears) a non-empty log dir it opens later:
                    # open it before checkpoints/ exists
                    opened = [logger.experiment for logger in trainer.loggers]
                    del opened
                    # kept open: the lock lasts as long as this process
                    self._checkpoint_lock = claim_checkpoint_dir(dirpath, resume)
                except CheckpointSetupError as err:
                    self._stop(str(err))
                except OSError as err:
                    self._stop(f"cannot write the run's logs under {trainer.log_dir}: {err.strerror or err}. "
                               f"Choose a writable place with --trainer.default_root_dir DIR.")
        return trainer

    def _stop(self, message: str) -> None:
        """Stop before any work (exit code 2), removing the run directory this process made:
        a refused run leaves nothing behind."""
        self._discard_run_dir()
        exit_with_error(message)

    def _discard_run_dir(self) -> None:
        """Remove the run directory this process made unless it holds a checkpoint."""
        run_dir = getattr(self, "_new_run_dir", None)
        if run_dir is not None and not any(run_dir.glob("**/*.ckpt")):
            shutil.rmtree(run_dir, ignore_errors=True)

    def _resolve_ckpt_path(self, root: Path, settings: CheckpointSettings) -> str | None:
        """Resolve and check ``--ckpt_path`` (``last``/``best`` among this root's runs of the
        configured model) and hand Lightning the file; stops with exit code 2 on a mismatch."""
        if not self.subcommand or not self.config_init[self.subcommand].get("ckpt_path"):
            return None
        if use_export(self.model, self.config_init[self.subcommand], self.subcommand):  # a folder cli.py export wrote
            return None
        ckpt_path = self.config_init[self.subcommand]["ckpt_path"]
        dirpath = settings.dirpath or self._saved_run_checkpoints()
        try:
            path = resolve_checkpoint_path(ckpt_path, self.model, root, dirpath, fitting=self.subcommand == "fit")
        except CheckpointMismatchError as err:
            exit_with_error(str(err))
        if ckpt_path in ("last", "best"):
            # Lightning gets the file; DDP's other ranks re-run sys.argv, so they get it too
            # (the newest run could change between the ranks' starts). The saved config keeps
            # what the user wrote, so re-running it means the same thing.
            self.config_init[self.subcommand]["ckpt_path"] = path
            sys.argv = with_ckpt_path(sys.argv, path)
            if rank_zero_only.rank == 0:
                found = path or f"no checkpoint under {dirpath or root} yet; training from scratch"
                print(f"--ckpt_path {ckpt_path}: {found}")
        return path

    def _saved_run_checkpoints(self) -> str | None:
        """The checkpoints/ of the run whose saved config this command was given, if any
        (:func:`~linformer_lab.cli.checkpoints.saved_run_checkpoint_dir`)."""
        sources = self._section().get("config") or []
        folder = saved_run_checkpoint_dir(getattr(s, "absolute", None) or str(s) for s in sources)
        return str(folder) if folder is not None else None

    # ------------------------------------------------------------------ subcommands

    def _run_subcommand(self, subcommand: str) -> None:
        sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C after the first; ours again after
        rank_zero_log.addFilter(without_interrupt_notice)
        try:
            super()._run_subcommand(subcommand)
        except SystemExit as stop:
            if self.trainer.state.status != TrainerStatus.INTERRUPTED:
                raise
            # Lightning ends a Ctrl-C with exit code 1 after "attempting graceful shutdown":
            # say instead what survives, with the shell's code for a SIGINT
            sys.stderr.write(f"{interrupted_message(self.trainer)}\n")
            raise SystemExit(INTERRUPTED_EXIT_CODE) from stop
        except ConfigurationError:
            # refused at the start of the run (data that is not there, Task.setup's checks):
            # reported as one line by run_lightning_cli, and the refused run leaves no folder
            self._discard_run_dir()
            raise
        finally:  # the checkpoint directory is free for the next run (also one in this process)
            signal.signal(signal.SIGINT, sigint)
            rank_zero_log.removeFilter(without_interrupt_notice)
            lock = getattr(self, "_checkpoint_lock", None)
            if lock is not None:
                lock.close()

    def after_fit(self) -> None:
        # where the run and its best checkpoint are, and what to run next, printed by rank 0; every
        # rank reads them, as trainer.log_dir is a broadcast under DDP (rank 0 alone would wait forever)
        lines = finished_fit_lines(self.trainer)
        if lines and self.trainer.is_global_zero:
            print("\n".join(lines))

    def predict(self, model, datamodule=None, ckpt_path=None, return_predictions=None, **kwargs):
        """Runs ``trainer.predict`` and saves the predictions to ``<log_dir>/predictions.pt``.

        The project's data modules without a predict split of their own predict on their test
        split (:class:`~linformer_lab.data.sampling.PredictsOnTestSplit`); a run where neither
        the data module nor the model says what to predict on stops with one line.
        """
        if datamodule is not None and not any(
                is_overridden("predict_dataloader", owner, base)
                for owner, base in ((datamodule, L.LightningDataModule), (model, L.LightningModule))):
            self._stop(f"{type(datamodule).__name__} has no predict split (predict_dataloader), nor has "
                       f"{type(model).__name__}; give the data module one (linformer_lab.data.sampling."
                       f"PredictsOnTestSplit predicts on the test split)")
        predictions = self.trainer.predict(model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=True, **kwargs)
        log_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        rank = self.trainer.global_rank
        name = "predictions.pt" if self.trainer.world_size == 1 else f"predictions_rank{rank}.pt"
        log_dir.mkdir(parents=True, exist_ok=True)
        torch.save(predictions, log_dir / name)
        print(f"saved {len(predictions or [])} batches of predictions to {log_dir / name}")


# ---------------------------------------------------------------------- defaults


def _root_cause(err: BaseException) -> BaseException:
    """The error to show: the first of ours down the cause chain (a PluginError names the plugin
    and its distribution; the import error beneath it would lose both), else the root cause."""
    while err.__cause__ is not None and not isinstance(err, PluginError):
        err = err.__cause__
    return err


def default_logger(save_dir: str, version: int | None = None):
    """Metrics as CSV (``metrics.csv``, which the benchmarks read) and, when tensorboard is
    installed, TensorBoard too, both in ``save_dir/version_N``."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = [CSVLogger(save_dir=save_dir, name="", version=version)]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(save_dir=save_dir, name="", version=version))
    return loggers


# ---------------------------------------------------------------------- entry point


def run_lightning_cli(argv: list[str]) -> int:
    """Run :class:`LinformerCLI` on ``argv`` as :func:`~linformer_lab.cli.args.prepare_argv`
    left it (``main``, in :mod:`linformer_lab.cli.entry`, answers what needs no Lightning);
    returns the exit code. ``SUBCOMMAND --help`` (without a config: ``main`` answers that one
    from the config, :mod:`linformer_lab.cli.config_help`) ends with where the model's options are."""
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
            # generated in the main process on purpose: a batch costs far less than a training step.
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            compat.ignore_upstream_warnings()
            LinformerCLI()
    except SystemExit as done:
        if done.code not in (0, None) or not help_requested(argv):
            raise
        # with a config, main answers from it (linformer_lab.cli.config_help) without coming here
        print("\nThe model's and data's options: add --config NAME (or --model.help copy; cli.py --help lists the names).")
    except ConfigurationError as err:
        # a check at the start of the run (Task.setup) refused the configuration: one line, as
        # for the checks made while building the classes
        if os.environ.get("LINFORMER_LAB_TRACEBACK"):
            raise
        sys.stderr.write(f"error: {err} (LINFORMER_LAB_TRACEBACK=1 shows the traceback)\n")
        return CHECKPOINT_ERROR_EXIT_CODE
    finally:
        sys.argv = saved_argv
    return 0
