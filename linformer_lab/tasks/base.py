"""What every task gives the command line: :class:`Task`, a LightningModule whose three class
attributes the CLI (``linformer_lab/cli/``) reads to set up checkpointing and check a
``--ckpt_path``. Another LightningModule runs with :class:`Task`'s defaults (no best-checkpoint
tracking, every hyper-parameter compared).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import lightning as L
import torch
import torchmetrics

from linformer_lab.attention.base import backends_with
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.context_parallel import check_splittable, context_grid, context_parallel, context_segment
from linformer_lab.tasks.conversion import Distillation, WeightTransfer, distill_attention, initialise_from
from linformer_lab.tasks.export import from_pretrained, save_pretrained
from linformer_lab.validation import ConfigurationError, check_at_least

#: where a checkpoint keeps the sums of the epoch-level training metrics (:attr:`Task.epoch_metrics`)
EPOCH_SUMS_KEY = "linformer_lab_epoch_sums"


class Task(L.LightningModule):
    """Base class of the project's LightningModules.

    Class attributes read by the CLI:

    * ``monitor``: the logged metric the best checkpoint is chosen by (``val/loss``); None keeps
      only ``last.ckpt``.
    * ``monitor_mode``: ``"min"`` or ``"max"`` for ``monitor``.
    * ``hparams_free_to_change``: hyper-parameters that may differ between a checkpoint and the
      configuration that loads it (optimisation and decoding settings); every other one must
      match, or the CLI refuses the checkpoint with the differences named.
    * ``hparams_of_the_optimizer``: those of them that a fit resumed from a checkpoint takes from
      the optimizer and learning-rate schedule it restores: there the configuration must match
      too (it would be ignored), and ``--model.init_from`` starts a new run that uses them.

    ``epoch_metrics``: ``(logged name, attribute)`` pairs of epoch-level training metrics, each a
    torchmetrics ``Metric`` that ``training_step`` updates and does not log. The base logs each
    only at the end of an epoch that ran to its last batch (one cut short by ``max_steps`` or
    ``max_time`` would read as whole). Their sums travel in the checkpoint, so a run resumed
    mid-epoch reports the whole epoch; where the epoch's first part cannot be accounted for (a
    checkpoint without the sums, or more than one process on either side: rank 0's checkpoint
    cannot hold their sums) that epoch's value is not logged.

    :meth:`setup` runs :meth:`check_run` before the first batch of every stage, so a configuration
    that cannot run stops with a :class:`~linformer_lab.validation.ConfigurationError` naming why.

    Training losses are means over the global batch of all processes (:meth:`global_mean`), so
    ``p`` processes at batch size ``b`` train as one at ``p * b``.
    """

    monitor: str | None = None
    monitor_mode: str = "min"
    hparams_free_to_change: tuple[str, ...] = ()
    hparams_of_the_optimizer: tuple[str, ...] = ()
    epoch_metrics: tuple[tuple[str, str], ...] = ()

    #: True while the running epoch's metric sums miss batches run before a resume
    epoch_sums_incomplete: bool = False
    #: set by :meth:`initialise_from`: the ``init_from`` checkpoint's weights are in, and the
    #: distillation's teacher (when ``distill_steps``) is built
    init_from_applied: bool = False
    #: attention distillation still to run before training (:meth:`initialise_from` sets it)
    distillation: Distillation | None = None

    def store_attention(self, config: AttentionConfig) -> AttentionConfig:
        """Keep ``config`` (coerced by the task or the model it builds: docs/ARCHITECTURE.md, "The
        configuration boundary") as ``attention_config`` and in ``hparams`` as plain data; returns it.

        Call after ``save_hyperparameters()``: the checkpoint then holds a dict, which loads under
        ``torch.load(weights_only=True)`` (it refuses arbitrary classes) and keeps hparams.yaml
        readable; ``load_from_checkpoint`` hands that dict back to the task.
        """
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"store_attention takes an AttentionConfig, got {type(config).__name__}")
        self.attention_config = config
        self.hparams["attention"] = config.to_hparams()
        return config

    #: processes that split every sequence of a batch (a task's ``context_parallel`` argument; the
    #: data modules share batches by it: data.sampling.process_share)
    context_parallel: int = 1
    #: this rank's group of ``context_parallel`` processes, made by :meth:`join_context_grid`
    context_group = None

    def set_context_parallel(self, context_parallel: int, **exclusive) -> None:
        """Keep ``context_parallel`` (processes per sequence) once it is checked against this task's
        attention layers and the ``exclusive`` settings (:func:`check_context_parallel`): call from
        ``__init__`` after the model is built."""
        check_context_parallel(context_parallel, self, **exclusive)
        self.context_parallel = context_parallel

    def join_context_grid(self) -> None:
        """With ``context_parallel`` P > 1: this rank's group of the run's (data x context) grid, P
        consecutive ranks per batch, and this task's linear attention layers split over it
        (:func:`~linformer_lab.attention.context_parallel.context_parallel`). :meth:`setup` calls it:
        groups are made collectively, by every process in the same order. A distillation's teacher
        is no submodule (``self.distillation`` is plain data): it stays whole."""
        if self.context_parallel > 1 and self.context_group is None:
            self.context_group = context_grid(self.context_parallel)
            context_parallel(self, group=self.context_group)

    def context_positions(self, length: int) -> tuple[int, int]:
        """``(start, stop)``: the positions of a sequence of ``length`` this process runs, its
        segment under context parallelism, all of them otherwise."""
        return (0, length) if self.context_group is None else context_segment(length, self.context_group)

    def setup(self, stage: str) -> None:
        # not in __init__: only now are the data module and the device known; the model is not
        # on that device yet (the strategy moves it after setup), hence not self.device
        trainer = attached_trainer(self)
        if trainer is None:
            return
        init_from = self.hparams.get("init_from")
        if stage == "fit" and init_from and not self.init_from_applied:
            # a silent fit from scratch would look like a converted model
            raise ConfigurationError(
                f"init_from {init_from} is read by the command line (python cli.py fit); from Python, call "
                f"task.initialise_from(linformer_lab.tasks.checkpoint_files.read_checkpoint(path), path) before trainer.fit"
            )
        self.check_run(getattr(trainer, "datamodule", None), trainer.strategy.root_device)
        self.join_context_grid()

    # ------------------------------------------------------------------ exported models (tasks/export.py)

    @classmethod
    def from_pretrained(cls, folder, device: str | torch.device = "cpu") -> Task:
        """The model ``cli.py export`` wrote to ``folder`` (``model.safetensors``, ``config.json``),
        in eval mode on ``device``; the folder must hold this class (``Task.from_pretrained``: any task)."""
        return from_pretrained(folder, None if cls is Task else cls, device)

    def save_pretrained(self, folder) -> None:
        """Write this model to ``folder`` as ``model.safetensors`` and ``config.json`` (what ``cli.py export`` does)."""
        save_pretrained(self, folder)

    # ------------------------------------------------------------------ converting a trained model

    def initialise_from(self, checkpoint: dict, source: str) -> WeightTransfer:
        """Start from ``checkpoint``, a trained model of this task with another attention
        (:func:`~linformer_lab.tasks.conversion.initialise_from`; the CLI calls it for ``init_from``)."""
        return initialise_from(self, checkpoint, source)

    def forward_batch(self, batch) -> torch.Tensor:
        """The training loss's forward pass on ``batch``, which attention distillation runs the
        teacher on; tasks that convert models define it."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward_batch, which attention distillation needs")

    def on_train_start(self) -> None:
        # a resumed run (global_step > 0) distilled before its first update already
        if self.distillation is not None and self.global_step == 0:
            distill_attention(self)
        self.distillation = None  # the teacher is needed no more

    # ------------------------------------------------------------------ epoch-level training metrics

    def on_train_epoch_start(self) -> None:
        # not called for the epoch a run resumes in: its sums come from on_load_checkpoint
        for _, attribute in self.epoch_metrics:
            getattr(self, attribute).reset()
        self.epoch_sums_incomplete = False

    def on_train_epoch_end(self) -> None:
        if not self.epoch_metrics or not epoch_ran_to_end(self.trainer):
            return
        for name, attribute in self.epoch_metrics:
            if not self.epoch_sums_incomplete:
                with warnings.catch_warnings():
                    # resumed at an epoch's end, the sums are the checkpoint's: no update() ran in this process
                    warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method")
                    value = getattr(self, attribute).compute()  # summed over processes: every rank logs the same
                self.log(name, value, on_step=False, on_epoch=True)
            getattr(self, attribute).reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if not self.epoch_metrics:
            return
        trainer = attached_trainer(self)
        checkpoint[EPOCH_SUMS_KEY] = {
            "world_size": trainer.world_size if trainer is not None else 1,
            "incomplete": bool(self.epoch_sums_incomplete),
            "metrics": {attribute: {name: _detached(value) for name, value in getattr(self, attribute).metric_state.items()}
                        for _, attribute in self.epoch_metrics},
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if not self.epoch_metrics:
            return
        trainer = attached_trainer(self)
        saved = checkpoint.get(EPOCH_SUMS_KEY)
        usable = (saved is not None and saved["world_size"] == 1 and not saved["incomplete"]
                  and (trainer is None or trainer.world_size == 1))
        # Lightning then calls on_train_epoch_start only if the checkpoint ends an epoch, which resets both.
        self.epoch_sums_incomplete = not usable
        if usable:
            for attribute, states in saved["metrics"].items():
                metric = getattr(self, attribute)
                for name, value in states.items():  # a tensor state onto the metric's device, a list state as saved
                    setattr(metric, name, value.to(getattr(metric, name).device) if isinstance(value, torch.Tensor) else value)

    def global_mean(self, total: torch.Tensor, count: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, mean)`` of a loss summed over this process's share of the global batch.

        ``total``: scalar sum of this process's per-token (per-utterance, per-dimension) losses;
        ``count``: how many it summed. ``mean`` (detached) is ``sum(totals) / sum(counts)`` over all
        processes, what one process given the whole batch logs. ``loss``, for ``training_step``, is
        ``p * total / sum(counts)``: DDP averages gradients over the ``p`` processes, so the result
        is the mean's gradient (a mean per process would weigh a token of a share with few tokens
        more). One process: both are ``total / count``.
        """
        count = torch.as_tensor(count, dtype=torch.float32, device=total.device)
        trainer = attached_trainer(self)
        world_size = trainer.world_size if trainer is not None else 1
        if world_size == 1:
            mean = total / count
            return mean, mean.detach()
        sums = torch.stack([total.detach().float(), count])
        sums = trainer.strategy.reduce(sums, reduce_op="sum")  # every process gets both sums
        return total * (world_size / sums[1]), sums[0] / sums[1]

    def summed_predict_tally(self, names: tuple[str, ...]) -> dict | None:
        """The ``_predict_tally`` that ``predict_step`` filled (a dict of counts and examples), its
        counts ``names`` summed over processes, or None when there is none or nothing was counted."""
        tally = getattr(self, "_predict_tally", None)
        if not tally:
            return None
        # under DDP each process predicted its share: the counts are of all of them
        counts = self.trainer.strategy.reduce(torch.tensor([tally[n] for n in names], device=self.device), reduce_op="sum")
        tally.update(zip(names, counts.tolist()))
        return tally if any(tally[n] for n in names) else None

    def check_run(self, datamodule=None, device: torch.device | str | None = None) -> None:
        """Raise a :class:`~linformer_lab.validation.ConfigurationError` if this task cannot run with
        ``datamodule`` on ``device`` (None: not checked). The base asks every submodule that defines
        ``check_device(device)`` (an attention backend such as ``linear_cuda``); tasks add their data checks."""
        if device is not None:
            for submodule in self.modules():
                if callable(check := getattr(submodule, "check_device", None)):
                    check(torch.device(device))


class WeightedMean(torchmetrics.Metric):
    """A running mean for an evaluation metric (``update(value, weight)``, logged as a metric object):
    ``sum(value * weight) / sum(weight)`` over the epoch and all processes. Not Lightning's epoch
    mean of a value logged with ``batch_size``: under DDP it averages the summed weights in their
    integer type, dropping the fraction of an odd total. Not torchmetrics' MeanMetric: it ignores
    the weights when told to keep NaNs, and a NaN must stay in so a diverged run shows."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # float64 sums, as in BitsPerDim: the last digits of the result do not depend on batching
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: float | torch.Tensor) -> None:
        """``value``: a scalar (detached here); ``weight``: what it is a mean over (tokens, utterances)."""
        self.total += value.detach().double() * weight
        self.weight += weight

    def compute(self) -> torch.Tensor:
        return (self.total / self.weight).float()


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The Trainer running ``module``, or None outside one (``module.trainer`` raises then)."""
    try:
        return module.trainer
    except RuntimeError:
        return None


def epoch_ran_to_end(trainer: L.Trainer) -> bool:
    """Whether the training epoch ending now ran its last batch (False for an epoch cut short by
    ``max_steps``, ``max_time`` or a requested stop)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return [_detached(v) for v in value]


def check_segment_length(segment_length: int | None, transformer, backend: str) -> None:
    """Raise a ValueError unless ``segment_length`` is None or usable with this transformer."""
    if segment_length is None:
        return
    if int(segment_length) < 1:
        raise ValueError(f"segment_length must be a positive number of positions or None, got {segment_length}")
    if not transformer.has_recurrent_form:
        raise ValueError(
            f"segment_length needs an attention backend whose state carries the past exactly "
            f"({backends_with('has_recurrent_form')}); {backend!r} has no recurrent form "
            f"(its outputs depend on later positions)"
        )


def check_context_parallel(context_parallel: int, transformer, **exclusive) -> None:
    """Raise a ConfigurationError unless ``context_parallel`` (processes per sequence) can split
    ``transformer``'s sequences: an integer >= 1, a backend with a fixed-size state, and none of
    the ``exclusive`` settings (name -> value) set, which need the whole sequence."""
    check_at_least("context_parallel", context_parallel, 1, "processes that split each sequence")
    if context_parallel == 1:
        return
    check_splittable(transformer)
    for name, value in exclusive.items():
        if value and value != "none":
            raise ConfigurationError(f"context_parallel = {context_parallel} splits every sequence over processes; "
                                     f"{name} = {value!r} needs the whole sequence in one: set one of them")


class TaskSettings(NamedTuple):
    """What the command line reads from a task (:class:`Task` declares each)."""

    monitor: str | None
    monitor_mode: str
    hparams_free_to_change: tuple[str, ...]
    hparams_of_the_optimizer: tuple[str, ...]


def task_settings(model: L.LightningModule) -> TaskSettings:
    """The :class:`TaskSettings` of any LightningModule: a :class:`Task`'s declared values, or the
    defaults above for other modules."""
    cls = model if isinstance(model, Task) else Task
    return TaskSettings(cls.monitor, cls.monitor_mode, tuple(cls.hparams_free_to_change), tuple(cls.hparams_of_the_optimizer))
