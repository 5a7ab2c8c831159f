"""Image generation (MNIST; CIFAR-10 on test files) and speech recognition under DDP through
``cli.py`` (2 gloo processes on CPU, ``--trainer.devices 2 --trainer.strategy ddp``): fit,
resume after a ``max_steps`` stop, validate, test and predict, each process on its own share,
equal to one process at twice the batch. The copy task, the resume after ``kill -9``, nodes and
bf16: tests/tasks/test_ddp.py.

One job (``job``, module-scoped) runs every DDP command of this file (tests/tasks/ddp_driver.py)
as SLURM would: two processes started here with the variables ``srun --ntasks-per-node 2`` gives
its tasks (Lightning's SLURM environment then takes the ranks from them). The one-process
references run in this process. The speech
corpus has 17 training utterances: at 2 x 3 the last global batch of each epoch has 5, split 3
and 2, so a mean over each process's own utterances would differ from the mean over the batch.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, checkpoint_dir, run_cli, tiny_mnist_args
from ddp_driver import assert_same_weights, free_port, metrics, only, run_job, save_weights, slurm_env, weights
from test_resume import assert_resumed_like_straight

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

DDP = ("--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=2")
MNIST_STEPS, MNIST_STOP = 7, 5  # 16 images in batches of 4: 4 steps an epoch
SPEECH_STEPS, SPEECH_STOP = 6, 4  # 17 utterances in batches of 6: 3 steps an epoch
SPEECH_HOURS = 0.022


def mnist_args(root: Path, batch_size: int, *extra: str) -> list[str]:
    """MNIST at toy size: 16 training, 6 validation, 4 test images, ``batch_size`` per process."""
    return tiny_mnist_args(
        root, f"--data.batch_size={batch_size}", "--data.limit_train=16", "--data.limit_val=6", "--data.limit_test=4",
        "--trainer.limit_train_batches=null", "--trainer.limit_val_batches=null", "--trainer.val_check_interval=null",
        "--trainer.check_val_every_n_epoch=1", "--trainer.max_epochs=null", "--trainer.callbacks=[]",
        "--trainer.limit_predict_batches=1", "--model.predict_num_samples=0", *extra)


def cifar_args(root: Path, data: Path, *extra: str) -> list[str]:
    return [
        "--config", "cifar10_linear.yaml", f"--data.root={data}", "--data.verify_checksums=false", "--data.val_size=4",
        "--data.batch_size=2", "--model.n_layers=1", "--model.d_model=16", "--model.n_heads=2", "--model.d_ff=32",
        "--model.num_mixtures=2", "--model.predict_num_samples=0", "--trainer.precision=32-true",
        "--trainer.max_epochs=1", "--trainer.log_every_n_steps=1", "--trainer.callbacks=[]",
        "--trainer.limit_predict_batches=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={root}", *extra]


def speech_args(root: Path, corpus: Path, batch_size: int, *extra: str) -> list[str]:
    return [
        "--config", "speech_cpu_linear.yaml", f"--data.root={corpus}", f"--data.hours={SPEECH_HOURS}",
        f"--data.batch_size={batch_size}", "--data.progress=false", "--model.d_model=12", "--model.n_heads=2",
        "--model.n_layers=1", "--model.warmup_steps=2", "--trainer.accelerator=cpu", "--trainer.max_epochs=null",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={root}", *extra]


def write_cifar_files(root: Path) -> None:
    """CIFAR-10 files in the torchvision format, as tests/data/test_data_images.py writes them:
    20 training images (16 after the 4 of validation) and 4 test images."""
    spec = importlib.util.spec_from_file_location("cifar_test_files", REPO / "tests" / "data" / "test_data_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_cifar(root, n_per_batch=4, n_test=4)


def story(args, total: int, stop: int, straight: Path, stopped: Path, *, extra=()) -> list[list[str]]:
    """The DDP commands of one task: fit ``straight`` to ``total`` steps; fit ``stopped`` to
    ``stop``, resume it with ``--ckpt_path last`` to ``total``; validate, test, predict its last."""
    return [
        ["fit", *args(straight, f"--trainer.max_steps={total}", save_weights(straight / "weights_"), *DDP, *extra)],
        ["fit", *args(stopped, f"--trainer.max_steps={stop}", *DDP, *extra)],
        ["fit", *args(stopped, f"--trainer.max_steps={total}", *DDP, *extra), "--ckpt_path", "last"],
        *[[command, *args(stopped, *DDP, *extra), "--ckpt_path", "last"] for command in ("validate", "test", "predict")],
    ]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tasks_ddp")
    write_cifar_files(out / "cifar_data")
    from linformer_lab.data.speech import SpeechDataModule

    SpeechDataModule(root=str(out / "corpus"), hours=SPEECH_HOURS, progress=False).prepare_data()  # once, here
    mnist = story(lambda root, *a: mnist_args(root, 2, *a), MNIST_STEPS, MNIST_STOP, out / "mnist", out / "mnist_stopped")
    speech = story(lambda root, *a: speech_args(root, out / "corpus", 3, *a), SPEECH_STEPS, SPEECH_STOP,
                   out / "speech", out / "speech_stopped")
    cifar = [["fit", *cifar_args(out / "cifar", out / "cifar_data", *DDP)]]
    cifar += [[command, *cifar_args(out / "cifar", out / "cifar_data", *DDP), "--ckpt_path", "last"]
              for command in ("validate", "test", "predict")]
    port = free_port()
    run_job(mnist + speech + cifar, out, [([sys.executable], slurm_env(rank, 2, port)) for rank in (0, 1)])
    return out


def one_process(command: str, args: list[str], *ckpt: str) -> None:
    code, _, err = run_cli([command, *args, *ckpt])
    assert code == 0, err[-3000:]


def assert_steps_equal(got: dict, want: dict, count: int) -> None:
    assert sorted(got) == sorted(want) and len(got) == count, (got, want)
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5)


def test_mnist_two_processes_train_resume_and_evaluate_as_one_at_twice_the_batch(job):
    single = job / "mnist_single"
    one_process("fit", mnist_args(single, 4, f"--trainer.max_steps={MNIST_STEPS}", save_weights(single / "weights_")))
    straight, stopped = job / "mnist", job / "mnist_stopped"
    rank0 = weights(straight / "weights_rank0.pt")
    assert_same_weights(weights(straight / "weights_rank1.pt"), rank0)
    assert_same_weights(rank0, weights(single / "weights_rank0.pt"), atol=1e-6)
    assert_steps_equal(metrics(straight / "version_0", "train/bits_per_dim"),
                       metrics(single / "version_0", "train/bits_per_dim"), MNIST_STEPS)
    assert_steps_equal(metrics(straight / "version_0", "val/bits_per_dim"),
                       metrics(single / "version_0", "val/bits_per_dim"), 1)

    assert max(metrics(stopped / "version_0", "train/bits_per_dim")) == MNIST_STOP - 1
    resumed = metrics(stopped / "version_1", "train/bits_per_dim")
    straight_steps = metrics(straight / "version_0", "train/bits_per_dim")
    assert sorted(resumed) == list(range(MNIST_STOP, MNIST_STEPS))
    assert [resumed[s] for s in resumed] == pytest.approx([straight_steps[s] for s in resumed], abs=1e-6)

    last = str(checkpoint_dir(stopped) / "last.ckpt")
    for command in ("validate", "test"):
        one_process(command, mnist_args(single, 4), "--ckpt_path", last)
    for key, ddp_version, single_version in (("val/bits_per_dim", 2, 1), ("test/bits_per_dim", 3, 2)):
        assert only(metrics(stopped / f"version_{ddp_version}", key)) == pytest.approx(
            only(metrics(single / f"version_{single_version}", key)), rel=1e-5), key
    # predict: each process completed its own share of the first test batch, in its own folder
    for rank in (0, 1):
        assert len(list((stopped / "version_4" / "predictions" / f"rank{rank}" / "completions").glob("*.png"))) == 2
        shares = torch.load(stopped / "version_4" / f"predictions_rank{rank}.pt", weights_only=False)
        assert [tuple(batch["completions"].shape) for batch in shares] == [(2, 1, 28, 28)]


def test_cifar10_fit_validate_test_predict(job):
    cifar = job / "cifar"
    assert sorted(metrics(cifar / "version_0", "train/bits_per_dim")) == [0, 1, 2, 3]  # 16 images, 2 x 2 a step
    single = job / "cifar_single"
    last = str(checkpoint_dir(cifar) / "last.ckpt")
    for command in ("validate", "test"):
        one_process(command, cifar_args(single, job / "cifar_data", "--data.batch_size=4"), "--ckpt_path", last)
    for key, ddp_version, single_version in (("val/bits_per_dim", 1, 0), ("test/bits_per_dim", 2, 1)):
        assert only(metrics(cifar / f"version_{ddp_version}", key)) == pytest.approx(
            only(metrics(single / f"version_{single_version}", key)), rel=1e-5), key
    for rank in (0, 1):
        assert len(list((cifar / "version_3" / "predictions" / f"rank{rank}" / "completions").glob("*.png"))) == 2


def test_speech_two_processes_train_resume_and_evaluate_as_one_at_twice_the_batch(job):
    corpus, single = job / "corpus", job / "speech_single"
    one_process("fit", speech_args(single, corpus, 6, f"--trainer.max_steps={SPEECH_STEPS}",
                                   save_weights(single / "weights_")))
    straight, stopped = job / "speech", job / "speech_stopped"
    rank0 = weights(straight / "weights_rank0.pt")
    assert_same_weights(weights(straight / "weights_rank1.pt"), rank0)
    assert_same_weights(rank0, weights(single / "weights_rank0.pt"), atol=1e-6)
    for key, count in (("train/loss", SPEECH_STEPS), ("val/loss", 2), ("val/per", 2)):
        assert_steps_equal(metrics(straight / "version_0", key), metrics(single / "version_0", key), count)

    assert max(metrics(stopped / "version_0", "train/loss")) == SPEECH_STOP - 1
    assert_resumed_like_straight(straight, stopped / "version_1", range(SPEECH_STOP, SPEECH_STEPS))

    last = str(checkpoint_dir(stopped) / "last.ckpt")
    for command in ("validate", "test", "predict"):
        one_process(command, speech_args(single, corpus, 6), "--ckpt_path", last)
    for key, ddp_version, single_version in (("val/loss", 2, 1), ("val/per", 2, 1), ("test/loss", 3, 2),
                                             ("test/per", 3, 2)):
        assert only(metrics(stopped / f"version_{ddp_version}", key)) == pytest.approx(
            only(metrics(single / f"version_{single_version}", key)), rel=1e-5), key

    # each process decoded its own utterances; together they are what one process decodes
    def decoded(files):
        return sorted((json.dumps(r), json.dumps(p)) for f in files for batch in torch.load(f, weights_only=False)
                      for r, p in zip(batch["references"], batch["predictions"]))
    shares = [stopped / "version_4" / f"predictions_rank{rank}.pt" for rank in (0, 1)]
    assert len(decoded(shares[:1])) == len(decoded(shares[1:])) == 1
    assert decoded(shares) == decoded([single / "version_3" / "predictions.pt"])
