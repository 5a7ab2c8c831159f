"""What every task gives the command line: :class:`Task`.

A task is a LightningModule; the CLI (``linformer_lab/cli.py``) reads three class attributes
from it to set up checkpointing and to check a ``--ckpt_path`` against the configuration.
A LightningModule that is not a :class:`Task` still runs under the CLI with the defaults
written here (no best-checkpoint tracking, every hyper-parameter compared).
"""

from __future__ import annotations

import lightning as L
import torch

from linformer_lab.attention.config import AttentionConfig


class Task(L.LightningModule):
    """Base class of the project's LightningModules.

    Class attributes read by the CLI:

    * ``monitor``: the logged metric the best checkpoint is chosen by (``val/loss``); None keeps
      only ``last.ckpt``.
    * ``monitor_mode``: ``"min"`` or ``"max"`` for ``monitor``.
    * ``hparams_free_to_change``: hyper-parameters that may differ between a checkpoint and the
      configuration that loads it (optimisation and decoding settings); every other one must
      match, or the CLI refuses the checkpoint with the differences named.

    :meth:`setup` runs :meth:`check_run` before the first batch of every stage, so a
    configuration that cannot run (a backend the device cannot run, data the model was not
    built for) stops with a :class:`~linformer_lab.validation.ConfigurationError` naming it.
    """

    monitor: str | None = None
    monitor_mode: str = "min"
    hparams_free_to_change: tuple[str, ...] = ()

    def store_attention(self, config: AttentionConfig) -> AttentionConfig:
        """Keep ``config`` as ``attention_config`` and in ``hparams`` as plain data; returns it.

        The task's ``attention`` argument (None, a backend name, a dict, a config) is coerced
        once: by the whole model the task builds (``PixelTransformer``, ``TransformerCTC``),
        whose ``attention_config`` comes here, or by the task itself when it builds from the
        building blocks (``CopyTask``). Call after ``save_hyperparameters()``: the checkpoint
        then holds a dict (it loads with ``torch.load(weights_only=True)``, PyTorch's default,
        which refuses arbitrary classes, and hparams.yaml stays readable), and
        ``load_from_checkpoint`` hands that dict back to the task.
        """
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"store_attention takes an AttentionConfig, got {type(config).__name__}")
        self.attention_config = config
        self.hparams["attention"] = config.to_hparams()
        return config

    def setup(self, stage: str) -> None:
        # Here, not in __init__: only now are the data module and the run's device known. The
        # model is not on that device yet (the strategy moves it after setup), hence the
        # strategy's root device rather than self.device.
        trainer = self._trainer
        if trainer is None:
            return
        self.check_run(getattr(trainer, "datamodule", None), trainer.strategy.root_device)

    def check_run(self, datamodule=None, device: torch.device | str | None = None) -> None:
        """Raise a :class:`~linformer_lab.validation.ConfigurationError` if this task cannot
        run with ``datamodule`` on ``device`` (None: not checked). The base checks that every
        attention backend can run on ``device``; tasks add their own data checks."""
        if device is not None:
            check_attention_devices(self, torch.device(device))


def check_segment_length(segment_length: int | None, transformer, backend: str) -> None:
    """Raise a ValueError unless ``segment_length`` is None or usable with this transformer."""
    if segment_length is None:
        return
    if int(segment_length) < 1:
        raise ValueError(f"segment_length must be a positive number of positions or None, got {segment_length}")
    if not transformer.has_recurrent_form:
        raise ValueError(
            f"segment_length needs an attention backend whose state carries the past exactly ('linear', "
            f"'linear_cuda', 'softmax'); {backend!r} has no recurrent form (its outputs depend on later positions)"
        )


def check_attention_devices(module: torch.nn.Module, device: torch.device) -> None:
    """Raise a ConfigurationError if an attention backend inside ``module`` cannot run on
    ``device``: backends that can say so define ``check_device(device)`` (``linear_cuda``)."""
    for submodule in module.modules():
        check = getattr(submodule, "check_device", None)
        if callable(check):
            check(device)


def task_settings(model: L.LightningModule) -> tuple[str | None, str, tuple[str, ...]]:
    """``(monitor, monitor_mode, hparams_free_to_change)`` of any LightningModule: a :class:`Task`'s
    declared values, or the defaults above for other modules."""
    cls = model if isinstance(model, Task) else Task
    return cls.monitor, cls.monitor_mode, tuple(cls.hparams_free_to_change)
