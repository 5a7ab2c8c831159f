"""What a run shows while it trains: image grids of samples and completions (paper Fig. 3/4,
drawn with :mod:`linformer_lab.tasks.image_grids`), its progress bar (:class:`StepsProgressBar`)
and the projected time of the whole run (:class:`RunTimeEstimate`)."""

from __future__ import annotations

import math
import os
import threading
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_warn

from linformer_lab.tasks.image_grids import COMPLETION_LEGEND, completion_triptychs, image_grid, save_png, top_half_rows

__all__ = ["ImageSampleCallback", "StepsProgressBar", "RunTimeEstimate"]


def log_dir_of(trainer: L.Trainer) -> str:
    """Where run artefacts go: the logger's directory (beside metrics.csv or the TensorBoard
    events), else the trainer's default root dir."""
    return trainer.log_dir or trainer.default_root_dir


class ImageSampleCallback(L.Callback):
    """After validation, write unconditional samples and completions as PNG grids.

    Args:
        num_samples: images of each kind (unconditional samples; completions).
        every_n_epochs: only after every n-th validation epoch (generation takes N sequential
            model steps per batch of images).
        temperature: sampling temperature (see ``DiscretizedMixtureOfLogistics.sample``).
        split: where the images to complete come from: ``"test"`` (as the paper's figures) or
            ``"val"``; the first ``num_samples`` images, the same every epoch so progress is
            comparable. Without a datamodule, the first validation batch.
        scale: enlargement factor of the written PNGs (28x28 digits are tiny).
        seed: seeds the sampling so successive epochs use the same noise.

    Files: ``<log_dir>/images/epoch=EEEE-samples.png`` and ``...-completions.png`` (rows
    ``occluded | completion | original``), also ``add_image``-ed to a TensorBoard logger. Runs on
    global rank 0 outside the sanity check; needs ``pl_module.model.generate`` (a :class:`PixelTransformer`).
    """

    def __init__(self, num_samples: int = 8, every_n_epochs: int = 1, temperature: float = 1.0,
                 split: str = "test", scale: int = 4, seed: int = 0):
        super().__init__()
        if num_samples < 1 or every_n_epochs < 1:
            raise ValueError(f"num_samples and every_n_epochs must be >= 1, got {num_samples}, {every_n_epochs}")
        if split not in ("test", "val"):
            raise ValueError(f"split must be 'test' or 'val', got {split!r}")
        self.num_samples, self.every_n_epochs, self.temperature = num_samples, every_n_epochs, temperature
        self.split, self.scale, self.seed = split, scale, seed
        self._references: torch.Tensor | None = None
        self._fallback: torch.Tensor | None = None
        self.written: list[str] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        # the images to complete when there is no datamodule to ask
        if self._fallback is None and batch_idx == 0 and dataloader_idx == 0:
            images = batch[0] if isinstance(batch, (list, tuple)) else batch
            self._fallback = images[: self.num_samples].detach().cpu()

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        self.write(trainer, pl_module)

    def reference_images(self, trainer) -> torch.Tensor | None:
        """The first ``num_samples`` images of the chosen split, uint8 ``(B, C, H, W)``."""
        if self._references is None:
            loader_hook = getattr(trainer.datamodule, f"{self.split}_dataloader", None)
            collected, count = [], 0
            if loader_hook is not None:
                try:
                    loader = loader_hook()
                except Exception as err:  # e.g. a datamodule without that split
                    rank_zero_warn(f"ImageSampleCallback: no {self.split} images to complete ({type(err).__name__}: {err}); "
                                   f"using the first validation batch instead")
                    loader = []
                for batch in loader:
                    images = batch[0] if isinstance(batch, (list, tuple)) else batch
                    collected.append(images[: self.num_samples - count])
                    count += len(collected[-1])
                    if count >= self.num_samples:
                        break
            if collected:
                self._references = torch.cat(collected).cpu()
            else:
                return self._fallback
        return self._references

    def write(self, trainer, pl_module) -> list[str]:
        """Generate and write both grids now; returns the written paths."""
        model = pl_module.model
        device = pl_module.device
        generator = torch.Generator(device=device).manual_seed(self.seed)
        out_dir = os.path.join(log_dir_of(trainer), "images")
        tag = f"epoch={trainer.current_epoch:04d}"
        paths = []

        samples = model.generate(self.num_samples, temperature=self.temperature, generator=generator)
        grids = {"samples": image_grid(samples, ncols=min(8, self.num_samples))}

        originals = self.reference_images(trainer)
        if originals is not None and len(originals):
            rows = top_half_rows(model.image_shape)
            originals = originals.to(device)
            completions = model.generate(len(originals), temperature=self.temperature,
                                         prefix=originals[:, :, :rows], generator=generator)
            grids["completions"] = image_grid(completion_triptychs(originals, completions, rows), ncols=3)

        for name, grid in grids.items():
            path = os.path.join(out_dir, f"{tag}-{name}.png")
            legend = COMPLETION_LEGEND if name == "completions" else None
            save_png(grid, path, scale=self.scale, legend=legend, tile_width=model.image_shape[-1])
            paths.append(path)
            for logger in trainer.loggers:
                experiment = getattr(logger, "experiment", None) if _is_tensorboard(logger) else None
                if experiment is not None and hasattr(experiment, "add_image"):
                    experiment.add_image(name, grid, global_step=trainer.global_step, dataformats="CHW")
        self.written.extend(paths)
        return paths


def _is_tensorboard(logger) -> bool:
    from lightning.pytorch.loggers import TensorBoardLogger

    return isinstance(logger, TensorBoardLogger)


class StepsProgressBar(TQDMProgressBar):
    """Lightning's progress bar, whose epoch total is the batches the run will actually train in
    it: when ``max_steps`` cuts an epoch short, the bar and its time estimate end where training
    does (Lightning's does so only without ``max_epochs``). A resumed epoch's bar starts at the
    batches already run."""

    _done_at_start = 0  # batches of the current epoch run before this process took over

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        total = trainer.num_training_batches
        if trainer.max_steps is None or trainer.max_steps < 0:
            return total
        remaining = max(trainer.max_steps - trainer.global_step, 0) * trainer.accumulate_grad_batches
        return min(total, self._done_at_start + remaining)

    def on_train_start(self, trainer, pl_module) -> None:
        # a run resumed mid-epoch gets no on_train_epoch_start for that epoch: size the bar here
        self._done_at_start = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        super().on_train_start(trainer, pl_module)
        total = self.total_train_batches
        self.train_progress_bar.total = None if math.isinf(total) else int(total)
        # tqdm's rate is (n - initial) / elapsed: the restored batches took no time in this process
        self.train_progress_bar.initial = self._done_at_start
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    def on_train_epoch_start(self, trainer, *args) -> None:
        self._done_at_start = 0  # a new epoch (Lightning calls this hook for no resumed one)
        super().on_train_epoch_start(trainer, *args)


def format_duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3 h 20 min``, ``14 d 6 h``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def validations_within(batches: int, epoch: int, batch_in_epoch: int, epoch_batches: int, every_n_batches: int,
                       every_n_epochs: int) -> int:
    """How many validations Lightning runs in the next ``batches`` training batches from batch
    ``batch_in_epoch`` of ``epoch``: one after every ``every_n_batches``-th batch of every
    ``every_n_epochs``-th epoch (``every_n_batches`` = the epoch's batches: one at its end)."""
    count = 0
    while batches > 0 and epoch_batches > 0:
        run = min(epoch_batches - batch_in_epoch, batches)
        if (epoch + 1) % every_n_epochs == 0:
            count += (batch_in_epoch + run) // every_n_batches - batch_in_epoch // every_n_batches
        batches -= run
        epoch, batch_in_epoch = epoch + 1, 0
    return count


class RunTimeEstimate(L.Callback):
    """Says once, when the rate has settled, how long the whole run takes on this machine: the
    updates ``max_steps`` / ``max_epochs`` allow and the validations among them, at the time per
    update measured over ``measure`` updates after a warm-up (first calls build kernels and fill
    caches). Each phase also ends on time, so slow updates are heard of within a minute: the
    warm-up after ``warmup`` updates or ``warmup_s`` seconds, the measurement after ``measure``
    updates or ``max_wait_s`` seconds (either at least one update). A validation batch costs what
    this run's validations measured, before any a third of an update (a forward pass). Over an
    hour on a CPU the line names ``cpu_recipe``, the config sized for a CPU. Rank 0 only.
    ``clock``: monotonic seconds (a test's fake one). A sanity check still running after
    ``notice_s`` seconds is announced (:func:`sanity_check_notice`)."""

    def __init__(self, warmup: int = 10, measure: int = 30, max_wait_s: float = 15.0, cpu_recipe: str | None = None,
                 warmup_s: float = 15.0, clock=time.perf_counter, notice_s: float | None = 5.0):
        self.warmup, self.measure, self.max_wait_s, self.cpu_recipe = warmup, measure, max_wait_s, cpu_recipe
        self.warmup_s, self.clock, self.notice_s = warmup_s, clock, notice_s
        self.notice_timer: threading.Timer | None = None
        self.line: str | None = None
        self._start_step, self._started = 0, 0.0
        self._measure_from: tuple[int, float, float] | None = None  # (step, time, validation time) at the warm-up's end
        self._val_time, self._val_batches, self._val_started = 0.0, 0, None

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        # Lightning's bar alone does not say why nothing trains yet (long on a CPU with a GPU-sized model)
        if trainer.is_global_zero and self.notice_s is not None:
            self.notice_timer = threading.Timer(self.notice_s, sanity_check_notice, (trainer,))
            self.notice_timer.daemon = True
            self.notice_timer.start()

    def on_sanity_check_end(self, trainer, pl_module) -> None:
        if self.notice_timer is not None:
            self.notice_timer.cancel()
            self.notice_timer = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step, self._measure_from, self.line = trainer.global_step, None, None
        self._started = self.clock()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_started = None if trainer.sanity_checking else self.clock()

    def on_validation_batch_end(self, trainer, *args) -> None:
        if self._val_started is not None:
            self._val_batches += 1

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_started is not None:
            self._val_time += self.clock() - self._val_started
            self._val_started = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.line is not None or not trainer.is_global_zero:
            return
        done = trainer.global_step - self._start_step
        now = self.clock()
        if self._measure_from is None:
            if done >= self.warmup or (done >= 1 and now - self._started - self._val_time >= self.warmup_s):
                self._measure_from = (done, now, self._val_time)
            return
        start, since, val_time = self._measure_from
        measured = done - start
        if measured >= self.measure or (measured >= 1 and now - since - (self._val_time - val_time) >= self.max_wait_s):
            per_update = (now - since - (self._val_time - val_time)) / measured
            self.line = self.describe(trainer, per_update)
            bar = trainer.progress_bar_callback
            (bar.print if bar is not None else print)(self.line)

    def describe(self, trainer, per_update: float) -> str:
        """The line for ``trainer``'s run at ``per_update`` seconds an update."""
        accumulate = trainer.accumulate_grad_batches
        epoch_batches = trainer.num_training_batches
        limits = [trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else math.inf]
        if trainer.max_epochs is not None and trainer.max_epochs >= 0 and not math.isinf(epoch_batches):
            limits.append(trainer.max_epochs * math.ceil(epoch_batches / accumulate))
        total = min(limits)
        if math.isinf(total):
            return (f"time: {per_update:.3g} s an update on this machine; the run has no end "
                    f"(max_steps and max_epochs -1): stop it with Ctrl-C or set --trainer.max_steps.")
        total, left = int(total), max(int(total) - trainer.global_step, 0)
        measured_val = self._val_batches > 0
        per_batch = self._val_time / self._val_batches if measured_val else per_update / 3
        val_batches = validation_batches(trainer)
        every = trainer.val_check_batch
        validations = all_validations = 0
        if val_batches and every is not None and not math.isinf(every) and not math.isinf(epoch_batches):
            every, done = int(every), trainer.global_step * accumulate
            if trainer.check_val_every_n_epoch is None:  # every `every` batches, counted across epochs
                validations = (done + left * accumulate) // every - done // every
                all_validations = total * accumulate // every
            else:
                validations = validations_within(left * accumulate, trainer.current_epoch,
                                                 trainer.fit_loop.epoch_loop.batch_progress.current.ready,
                                                 int(epoch_batches), every, trainer.check_val_every_n_epoch)
                all_validations = validations_within(total * accumulate, 0, 0, int(epoch_batches), every,
                                                     trainer.check_val_every_n_epoch)
        in_all = total * per_update + all_validations * val_batches * per_batch
        remaining = left * per_update + validations * val_batches * per_batch
        line = (f"time: about {format_duration(in_all)} for this run on this machine"
                f"{f', {format_duration(remaining)} of it left' if 0 < left < total else ''} ({total:,} updates at "
                f"{per_update:.3g} s, {all_validations:,} validation{'s' * (all_validations != 1)} of {val_batches} "
                f"batch{'es' * (val_batches != 1)} at "
                f"{per_batch:.3g} s{'' if measured_val else ' (estimated: a third of an update)'})")
        if self.cpu_recipe and in_all > 3600 and trainer.strategy.root_device.type == "cpu":
            line += f"; this config is sized for a GPU, its CPU recipe: python cli.py fit --config {self.cpu_recipe}"
        return line + "."


def sanity_check_notice(trainer) -> str:
    """Prints and returns the line saying what a slow sanity check does (its batches once its
    loader is set up, else ``num_sanity_val_steps``)."""
    batches = int(sum(b for b in trainer.num_sanity_val_batches if not math.isinf(b))) or trainer.num_sanity_val_steps
    line = (f"sanity check: {batches} validation batch{'es' * (batches != 1)} before the first update, "
            f"to find a fault in validation before hours of training (--trainer.num_sanity_val_steps 0 skips it)")
    bar = trainer.progress_bar_callback
    (bar.print if bar is not None else print)(line)
    return line


def validation_batches(trainer) -> int:
    """Batches of one validation during fit: Lightning's count once validation was set up, else
    the data module's validation loader as ``limit_val_batches`` cuts it; 0 without one."""
    counted = [b for b in trainer.num_val_batches if not math.isinf(b)]
    if counted:
        return int(sum(counted))
    loader_hook = getattr(trainer.datamodule, "val_dataloader", None)
    try:
        batches = len(loader_hook()) if loader_hook is not None else 0
    except Exception:  # no length, no validation split, any data module's own refusal: the line is only advice
        return 0
    limit = trainer.limit_val_batches
    return int(min(batches, limit) if isinstance(limit, int) else batches * limit)
