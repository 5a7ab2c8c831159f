"""Pixel-by-pixel image generation (paper §4.2) as a LightningModule.

Training/evaluation: bits/dim of the :class:`PixelTransformer` over all ``N = C H W``
sub-pixels, logged as ``train/bits_per_dim`` (per step), ``train/bits_per_dim_epoch`` (whole
epochs only: ``Task.epoch_metrics``), ``val/bits_per_dim`` and ``test/bits_per_dim``
(epoch-level :class:`BitsPerDim` metrics, summed across processes, so correct under DDP).

Prediction (generation from a checkpoint) and its files: :mod:`linformer_lab.tasks.image_prediction`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.generation.sampling import DECODERS
from linformer_lab.models.mixture_of_logistics import BitsPerDim
from linformer_lab.models.pixel_transformer import PixelTransformer
from linformer_lab.models.transformer import segmented_forward
from linformer_lab.tasks.base import Task, check_segment_length
from linformer_lab.tasks.conversion import check_conversion
from linformer_lab.tasks.graphed_update import GraphedTraining
from linformer_lab.tasks.image_prediction import ImagePrediction
from linformer_lab.validation import ConfigurationError, check_at_least, check_non_negative, check_positive

__all__ = ["ImageGenerationTask"]

LR_SCHEDULES = ("constant", "cosine")
#: ``compile``: nothing; the mixture-of-logistics loss alone; the whole loss of a batch (model and loss).
COMPILE_CHOICES = ("none", "loss", "model")


class ImageGenerationTask(GraphedTraining, ImagePrediction, Task):
    """Autoregressive image model trained by maximum likelihood (bits/dim).

    Args:
        attention: which attention (see :class:`AttentionConfig`; YAML:
            ``attention: {backend: lsh, kwargs: {n_hashes: 4, bucket_size: 29}}``), or a backend
            name alone (``attention: softmax``: that backend, the other fields at their defaults).
        image_shape: ``(C, H, W)`` of the data: MNIST ``[1, 28, 28]``, CIFAR-10 ``[3, 32, 32]``.
        n_layers, n_heads, d_model, d_ff, num_mixtures, dropout, position_embedding: :class:`PixelTransformer`.
        lr: RAdam learning rate (paper: 1e-4).
        weight_decay: RAdam weight decay (paper: none).
        warmup_steps: the learning rate rises linearly to ``lr`` over this many updates (0: none).
        lr_schedule: ``"constant"`` (the paper) or ``"cosine"``: after the warm-up, ``lr`` falls
            along a half cosine to 0 at the run's last update (``trainer.max_steps``, or the
            steps that ``max_epochs`` implies), so a fixed budget of updates ends annealed.
        temperature: sampling temperature for predict.
        step_weights: the weight copy predict's generation reads (``"model"``, ``"bfloat16"``,
            ``"int8"``; see :meth:`PixelTransformer.generate`): the lossy ones trade a little
            accuracy for CPU latency where the weight products dominate a step, wide models (the
            paper's d_model 256) at batch 1; on small ones (d_model 64 or 128) ``int8`` is slower
            than the exact weights (docs/cli.md has the measurements).
        predict_num_samples: unconditional samples made by a predict run (0: completions only).
        predict_batch_size: batch size of the unconditional-only predict run (no dataloader).
        output_dir: predict's output folder (default ``<log_dir>/predictions``).
        png_scale: enlargement of the PNGs predict writes.
        segment_length: train on consecutive segments of this many sub-pixels with the attention
            state carried across (None: the whole sequence at once); peak memory then follows the
            segment (:func:`~linformer_lab.models.transformer.segmented_forward`), the loss and,
            without ``detach_state``, the gradient are one pass's.
        detach_state: cut the gradient at segment boundaries (truncated back-propagation
            through time).
        compile: ``"none"``; ``"loss"``: the mixture-of-logistics loss as one ``torch.compile``-d
            function (``log_prob(fused=True)``); ``"model"``: the whole per-batch loss compiled in
            ``configure_model``, for GPUs, where an eager step is many small kernel launches. The
            first batches compile (seconds to minutes); weights and checkpoints stay the eager model's.
        cuda_graph: run each training update (forward, backward, RAdam step) as one CUDA graph,
            captured after a few eager updates (:mod:`~linformer_lab.tasks.graphed_update`), so the
            GPU no longer waits on Python's launches. Needs one CUDA device and a fixed batch shape
            (another shape runs eagerly); with ``compile`` the compiled loss is captured. What the
            graph cannot hold (a CPU, several processes, gradient accumulation or clipping,
            16-mixed) stops the run at its start, saying why.
        decoder: how predict's generation steps (``PixelTransformer.generate(decoder=...)``):
            ``"auto"`` a CUDA graph on a GPU, the ``fast_step`` loop on CPU.
        init_from: a checkpoint of this task with another attention (a trained softmax model) to
            start ``fit`` from: every weight whose name and shape match is loaded
            (:meth:`Task.initialise_from`, a table of what loaded printed), the rest keeps its
            initial values.
        distill_steps: before the first update, this many updates of attention distillation
            (Hedgehog's first stage): only the feature maps' weights train, to match the softmax
            attention weights of the ``init_from`` model (:mod:`linformer_lab.tasks.conversion`).
        distill_lr: Adam learning rate of those updates.
        context_parallel: P, the processes that split every image's sequence into P consecutive
            segments (:func:`~linformer_lab.attention.context_parallel.context_parallel`; linear
            attention), P consecutive ranks per batch: a (data x context) grid of the run's
            processes. Training, validation and test losses are those of one process on the same
            global batch; generation (``predict``) runs whole sequences on every process.
    """

    monitor = "val/bits_per_dim"
    monitor_mode = "min"
    #: logged by Task at the end of every whole epoch (its sums kept in checkpoints)
    epoch_metrics = (("train/bits_per_dim_epoch", "train_bpd"),)
    hparams_free_to_change = ("lr", "weight_decay", "warmup_steps", "lr_schedule", "dropout", "temperature",
                              "step_weights", "predict_num_samples", "predict_batch_size", "output_dir", "png_scale",
                              "segment_length", "detach_state", "compile", "cuda_graph", "decoder",
                              "init_from", "distill_steps", "distill_lr", "context_parallel")
    hparams_of_the_optimizer = ("lr", "weight_decay")  # the schedule's shape comes from the configuration

    def __init__(
        self,
        attention: AttentionConfig | str | None = None,
        image_shape: Sequence[int] = (1, 28, 28),
        n_layers: int = 8,
        n_heads: int = 8,
        d_model: int = 256,
        d_ff: int = 1024,
        num_mixtures: int = 10,
        dropout: float = 0.0,
        position_embedding: str = "pixel",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        temperature: float = 1.0,
        step_weights: str = "model",
        predict_num_samples: int = 16,
        predict_batch_size: int = 16,
        output_dir: str | None = None,
        png_scale: int = 4,
        segment_length: int | None = None,
        detach_state: bool = False,
        compile: str = "none",
        cuda_graph: bool = False,
        decoder: str = "auto",
        init_from: str | None = None,
        distill_steps: int = 0,
        distill_lr: float = 1e-3,
        context_parallel: int = 1,
    ):
        super().__init__()
        image_shape = [int(s) for s in image_shape]
        check_positive("lr", lr, "learning rate")
        check_non_negative("weight_decay", weight_decay)
        check_at_least("warmup_steps", warmup_steps, 0, "updates of linear learning-rate warm-up")
        if lr_schedule not in LR_SCHEDULES:
            raise ConfigurationError(f"lr_schedule must be one of {', '.join(map(repr, LR_SCHEDULES))}, got {lr_schedule!r}")
        check_non_negative("temperature", temperature, "0 = the most likely value at every step")
        check_at_least("predict_num_samples", predict_num_samples, 0, "unconditional samples made by predict")
        check_at_least("predict_batch_size", predict_batch_size, 1)
        check_at_least("png_scale", png_scale, 1, "enlargement of the PNGs")
        if compile not in COMPILE_CHOICES:
            raise ConfigurationError(f"compile must be one of {', '.join(map(repr, COMPILE_CHOICES))}, got {compile!r}")
        if decoder not in DECODERS:
            raise ConfigurationError(f"decoder must be one of {', '.join(map(repr, DECODERS))}, got {decoder!r}")
        check_conversion(init_from, distill_steps, distill_lr)
        if cuda_graph and segment_length:
            raise ConfigurationError("cuda_graph captures one pass over the whole sequence; segment_length trains "
                                     "in checkpointed segments, which it does not capture: set one of them")
        self.save_hyperparameters()
        self.model = PixelTransformer(  # coerces the attention argument: the one place on this path
            attention=attention, n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_ff=d_ff,
            num_mixtures=num_mixtures, image_shape=image_shape, dropout=dropout, position_embedding=position_embedding,
        )
        config = self.store_attention(self.model.attention_config)
        self.model.check_step_weights(step_weights)  # a bad config fails here, not at predict time
        self.model.fused_loss = compile == "loss"
        self._batch_nll = self.model.nll  # compiled in configure_model with compile="model"
        check_segment_length(segment_length, self.model.transformer, config.backend)
        self.set_context_parallel(context_parallel, segment_length=segment_length,
                                  compile=compile if compile == "model" else None, cuda_graph=cuda_graph)
        self.train_bpd = BitsPerDim()
        self.val_bpd = BitsPerDim()
        self.test_bpd = BitsPerDim()
        self._predict_state: dict | None = None

    # ------------------------------------------------------------------ training

    def check_run(self, datamodule=None, device=None) -> None:
        """Also: the data module's ``image_shape`` (when it has one) is the model's, so a model built
        for other images stops before the first batch."""
        super().check_run(datamodule, device)
        data_shape = getattr(datamodule, "image_shape", None)
        if data_shape is not None and tuple(data_shape) != self.model.image_shape:
            raise ConfigurationError(
                f"model.image_shape is {list(self.model.image_shape)} but the data module "
                f"{type(datamodule).__name__} yields images of shape {list(data_shape)}; "
                f"set model.image_shape to {list(data_shape)} (or use a data module with {list(self.model.image_shape)} images)"
            )

    @staticmethod
    def _images(batch) -> torch.Tensor:
        """Batches are ``(images, labels)`` (docs/ARCHITECTURE.md, "Contracts") or bare images."""
        return batch[0] if isinstance(batch, (list, tuple)) else batch

    def configure_model(self) -> None:
        """With ``compile="model"``: the per-batch loss through ``torch.compile`` (once; the
        module and its state dict stay the eager ones)."""
        if self.hparams.get("compile", "none") == "model" and self._batch_nll == self.model.nll:
            self._batch_nll = torch.compile(self.model.nll)

    def _nll(self, batch) -> torch.Tensor:
        """``(B, N)`` nats; under context parallelism ``(B, N / P)``, this process's positions."""
        if self.context_group is None:
            return self._batch_nll(self._images(batch))
        sequence = self.model.to_sequence(self._images(batch))
        start, stop = self.context_positions(sequence.shape[1])
        nll = self.model.segment_nll(sequence, start, stop)[0]
        # DDP waits for every weight's gradient on every process, and only position 0 reads the
        # start vector: the other segments' processes give it a gradient of zeros
        return nll if start == 0 else nll + 0.0 * self.model.start.sum()

    def forward_batch(self, batch) -> torch.Tensor:
        """The training loss's forward pass on ``batch``: ``(B, N)`` nats (attention distillation runs the teacher on it)."""
        return self.model.nll(self._images(batch))

    def update_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``(loss, (loss, nll (B, N) nats))``: the bits/dim to differentiate and what ``training_step``
        logs; what ``cuda_graph`` captures, so built from shapes alone (no number read on the host)."""
        nll = self._batch_nll(images)
        loss = nll.sum() / (math.log(2.0) * nll.numel())
        return loss, (loss, nll)

    def training_step(self, batch, batch_idx):
        if self.uses_cuda_graph():  # forward, backward and RAdam's step: one replay (check_run made sure it can)
            loss, nll = self.graphed_update(self._images(batch))
            self.train_bpd.update(nll)
            self.log("train/bits_per_dim", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=nll.shape[0])
            return loss
        if self.hparams.get("segment_length"):
            sequence = self.model.to_sequence(self._images(batch))
            pieces = segmented_forward(
                lambda start, stop, state: self.model.segment_nll(sequence, start, stop, state),
                sequence.shape[1], self.hparams.segment_length, self.hparams.detach_state,
            )
            nll = torch.cat(pieces, dim=1)  # (B, N) nats, as one pass gives
        else:
            nll = self._nll(batch)
        # bits/dim over the global batch of all processes (Task.global_mean)
        loss, mean = self.global_mean(nll.sum() / math.log(2.0), nll.numel())
        self.train_bpd.update(nll)
        self.log("train/bits_per_dim", mean, on_step=True, on_epoch=False, prog_bar=True, batch_size=nll.shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        nll = self._nll(batch)
        self.val_bpd.update(nll)
        self.log("val/bits_per_dim", self.val_bpd, on_epoch=True, prog_bar=True, batch_size=nll.shape[0])

    def test_step(self, batch, batch_idx):
        nll = self._nll(batch)
        self.test_bpd.update(nll)
        self.log("test/bits_per_dim", self.test_bpd, on_epoch=True, batch_size=nll.shape[0])

    def configure_optimizers(self):
        optimizer = torch.optim.RAdam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.get("warmup_steps", 0)
        cosine = self.hparams.get("lr_schedule", "constant") == "cosine"
        if not warmup and not cosine:
            return optimizer
        total = max(int(self.trainer.estimated_stepping_batches), warmup + 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if not cosine:
                return 1.0
            return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, total - warmup) / (total - warmup)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
