"""Prediction (``trainer.predict``, generation from a checkpoint) of
:class:`~linformer_lab.tasks.image_generation.ImageGenerationTask`, and the files it writes:

* Each predict batch of images is *completed*: the top half given (``prefix``), the bottom half
  generated. The intended source is the test split:
  ``trainer.predict(task, dataloaders=datamodule.test_dataloader(), ckpt_path=...)`` (or a
  datamodule with a ``predict_dataloader``); ``limit_predict_batches`` sets how many.
* ``predict_num_samples`` unconditional samples are generated alongside, as many per batch as
  the batch has images, the remainder on the last batch.
* Under DDP every process writes its own completions and ``predict_num_samples`` samples into
  ``output_dir/rankN``.
* With no dataloader and no datamodule, :meth:`predict_dataloader` yields index batches of
  ``predict_batch_size`` and only unconditional samples are made.

Files under ``output_dir`` (default ``<log_dir>/predictions``): ``samples/sample_XXXXX.png``,
``completions/completion_XXXXX.png`` (``occluded | completion | original``, titled
``prompt (top half) | generated | original``), ``samples_grid.png``, ``completions_grid.png`` (the
first 64) and ``throughput.json``: images/second and seconds/image of each kind (also printed and logged).
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
from torch.utils.data import DataLoader

from linformer_lab.tasks.callbacks import log_dir_of
from linformer_lab.tasks.image_grids import (
    COMPLETION_LEGEND,
    completion_triptychs,
    image_grid,
    save_png,
    top_half_rows,
)

__all__ = ["ImagePrediction"]

#: images of each kind in the grids written at the end of predict
_GRID_LIMIT = 64


class ImagePrediction:
    """Lightning's predict hooks of an image task (mixed in before
    :class:`~linformer_lab.tasks.base.Task`). The task provides ``model`` (a
    :class:`~linformer_lab.models.pixel_transformer.PixelTransformer`), ``_images(batch)`` and the
    hyper-parameters ``temperature``, ``step_weights``, ``decoder``, ``predict_num_samples``,
    ``predict_batch_size``, ``output_dir`` and ``png_scale``; ``_predict_state`` starts as None."""

    def predict_dataloader(self):
        """Index batches, one unconditional sample per index (only without dataloader and datamodule)."""
        return DataLoader(range(self.hparams.predict_num_samples), batch_size=self.hparams.predict_batch_size)

    def output_dir(self) -> str:
        directory = self.hparams.output_dir or os.path.join(log_dir_of(self.trainer), "predictions")
        if self.trainer.world_size > 1:  # one folder per process: file indices restart on each
            directory = os.path.join(directory, f"rank{self.trainer.global_rank}")
        return directory

    def on_predict_epoch_start(self) -> None:
        self._predict_state = {
            "dir": self.output_dir(),
            "samples": [], "completions": [],  # uint8 images (samples) / triptychs, for the grids
            "count": {"samples": 0, "completions": 0},
            "seconds": {"samples": 0.0, "completions": 0.0},
        }

    def _timed_generate(self, kind: str, batch_size: int, **kwargs) -> torch.Tensor:
        if self.device.type == "cuda":  # time the work, not the launch
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        images = self.model.generate(batch_size, temperature=self.hparams.temperature,
                                     step_weights=self.hparams.step_weights,
                                     decoder=self.hparams.get("decoder", "auto"), **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._predict_state["seconds"][kind] += time.perf_counter() - start
        return images

    def predict_step(self, batch, batch_idx, dataloader_idx=0) -> dict[str, torch.Tensor]:
        """Returns ``{"samples": uint8 (S, C, H, W)}`` and, for image batches,
        ``"completions"``: uint8 ``(B, C, H, W)``, while writing PNGs (see the module doc)."""
        if self._predict_state is None:
            self.on_predict_epoch_start()
        state, out = self._predict_state, {}
        images = self._images(batch)
        is_index_batch = images.dim() == 1  # from predict_dataloader: unconditional only
        batch_size = len(images)

        wanted = self.hparams.predict_num_samples - state["count"]["samples"]
        n_samples = min(batch_size, wanted)
        if not is_index_batch:
            total = self.trainer.num_predict_batches[dataloader_idx]
            if math.isfinite(total) and batch_idx == int(total) - 1:  # the last batch: the remainder, in batches of this size
                n_samples = wanted
        samples = [self._timed_generate("samples", min(batch_size, n_samples - done))
                   for done in range(0, max(n_samples, 0), batch_size)]
        if samples:
            out["samples"] = torch.cat(samples)
            self._write("samples", out["samples"])

        if not is_index_batch:
            rows = top_half_rows(self.model.image_shape)
            out["completions"] = self._timed_generate("completions", batch_size, prefix=images[:, :, :rows])
            self._write("completions", completion_triptychs(images, out["completions"], rows))
        return out

    def _write(self, kind: str, images: torch.Tensor) -> None:
        """Write one PNG per image (per completion triptych for ``completions``)."""
        state = self._predict_state
        images = images.cpu()
        folder = os.path.join(state["dir"], kind)
        if kind == "completions":
            triptychs = images.view(-1, 3, *images.shape[1:])
            for triptych in triptychs:
                save_png(image_grid(triptych, ncols=3), os.path.join(folder, f"completion_{state['count'][kind]:05d}.png"),
                         scale=self.hparams.png_scale, legend=COMPLETION_LEGEND, tile_width=self.model.image_shape[-1])
                state["count"][kind] += 1
        else:
            for image in images:
                save_png(image, os.path.join(folder, f"sample_{state['count'][kind]:05d}.png"), scale=self.hparams.png_scale)
                state["count"][kind] += 1
        kept = sum(len(x) for x in state[kind])
        limit = _GRID_LIMIT * (3 if kind == "completions" else 1)
        if kept < limit:
            state[kind].append(images[: limit - kept])

    def on_predict_epoch_end(self) -> None:
        state = self._predict_state
        if state is None:
            return
        for kind, ncols in (("samples", 8), ("completions", 6)):
            if state[kind]:
                save_png(image_grid(torch.cat(state[kind]), ncols=ncols), os.path.join(state["dir"], f"{kind}_grid.png"),
                         scale=self.hparams.png_scale, tile_width=self.model.image_shape[-1],
                         legend=COMPLETION_LEGEND if kind == "completions" else None)
        report = {"device": str(self.device), "temperature": self.hparams.temperature,
                  "step_weights": self.hparams.step_weights, "sequence_length": self.model.seq_len}
        for kind in ("samples", "completions"):
            n, seconds = state["count"][kind], state["seconds"][kind]
            if n:
                report[kind] = {"images": n, "seconds": seconds, "images_per_second": n / seconds,
                                "seconds_per_image": seconds / n}
                self.print(f"predict: {n} {kind} in {seconds:.2f} s: {n / seconds:.3f} images/s, "
                           f"{seconds / n:.3f} s/image -> {state['dir']}")
        os.makedirs(state["dir"], exist_ok=True)
        with open(os.path.join(state["dir"], "throughput.json"), "w") as f:
            json.dump(report, f, indent=2)
        metrics = {f"predict/{kind}_images_per_second": report[kind]["images_per_second"]
                   for kind in ("samples", "completions") if kind in report}
        for logger in self.trainer.loggers:
            if metrics:
                logger.log_metrics(metrics, step=self.trainer.global_step)
                logger.save()
        self._predict_state = None
