"""Runs you can trust, through the real CLI: a killed fit resumes from its last validation,
``best`` is the best on disk, a run stopped by ``max_steps`` extends without a seam, a saved config
re-runs the same run in its own root, and no run writes into another's checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import BatchCounter, checkpoint_dir, cli_subprocess, read_metrics, run_cli, tiny_copy_args, tiny_mnist_args
from test_resume import kill_once_checkpointed

from linformer_lab.cli.checkpoints import CheckpointSetupError, claim_checkpoint_dir

assert BatchCounter  # referenced by class path below ("conftest.BatchCounter")


def losses(log_dirs: list[Path], key: str = "train/loss") -> dict[int, float]:
    """The logged training loss per step, over the log directories of one run (a resume logs into a new one)."""
    return {int(r["step"]): r[key] for d in log_dirs for r in read_metrics(d) if key in r}


def assert_same_weights(a: dict, b: dict) -> None:
    for name, want in a["state_dict"].items():
        got = b["state_dict"][name]
        assert torch.allclose(got, want, atol=1e-6, rtol=0), f"{name} differs by {(got - want).abs().max():.3g}"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.ckpt"))}


# ---------------------------------------------------------------------- a crash costs one validation interval


@pytest.mark.slow
def test_killed_mnist_fit_resumes_from_its_last_validation(tmp_path):
    """kill -9 after the first validation of an MNIST-config fit (no every_n_train_steps): last.ckpt
    from that validation resumes to the same weights and losses as an uninterrupted run."""
    total, kill_at = 8, 2
    straight = tmp_path / "straight"
    code, _, err = run_cli(["fit", *tiny_mnist_args(straight, f"--trainer.max_steps={total}")])
    assert code == 0, err[-3000:]
    reference = torch.load(checkpoint_dir(straight) / "last.ckpt", map_location="cpu", weights_only=False)
    assert reference["global_step"] == total

    resumed = tmp_path / "resumed"
    pause = json.dumps([{"class_path": "test_resume.PauseAfterStep", "init_args": {"step": kill_at}}])
    proc = cli_subprocess(["fit", *tiny_mnist_args(resumed, f"--trainer.max_steps={total}", f"--trainer.callbacks+={pause}")],
                          env={"PYTHONPATH": os.pathsep.join(str(Path(__file__).resolve().parents[i]) for i in (0, 1)),
                               "OMP_NUM_THREADS": "1"})  # test_resume, conftest
    kill_once_checkpointed(proc, checkpoint_dir(resumed) / "last.ckpt", kill_at)

    code, _, err = run_cli(["fit", *tiny_mnist_args(resumed, f"--trainer.max_steps={total}"), "--ckpt_path", "last"])
    assert code == 0, err[-3000:]
    final = torch.load(checkpoint_dir(resumed) / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == total and final["epoch"] == reference["epoch"]
    assert_same_weights(reference, final)
    after_kill = losses([resumed / "version_1"], "train/bits_per_dim")
    assert sorted(after_kill) == list(range(kill_at, total))
    straight_losses = losses([straight / "version_0"], "train/bits_per_dim")
    for step, loss in after_kill.items():
        assert loss == pytest.approx(straight_losses[step], abs=1e-6), step


# ---------------------------------------------------------------------- best is the best


@pytest.mark.parametrize("save_top_k, every_n", [(1, None), (3, None), (1, 3), (3, 3)])
def test_best_is_the_best_validation_on_disk(tmp_path, save_top_k, every_n):
    """After the last validation, ``--ckpt_path best`` evaluates the checkpoint of the lowest
    val/loss of the run, also when last.ckpt is written at the step of a validation."""
    args = tiny_copy_args(tmp_path, "linear", f"--checkpoint.save_top_k={save_top_k}",
                          f"--checkpoint.every_n_train_steps={'null' if every_n is None else every_n}", "--model.lr=0.01")
    code, _, err = run_cli(["fit", *args, "--trainer.max_steps=12"])  # 4 epochs of 3: 4 validations
    assert code == 0, err
    validations = {int(r["step"]): r["val/loss"] for r in read_metrics(tmp_path / "version_0") if "val/loss" in r}
    assert len(validations) == 4
    best_step = min(validations, key=validations.get)
    # every best-*.ckpt on disk records its own score: the one "best" names has the lowest
    on_disk = {}
    for path in checkpoint_dir(tmp_path).glob("best-*.ckpt"):
        state = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if k.startswith("ModelCheckpoint"))
        on_disk[path.name] = float(state["current_score"])
    assert len(on_disk) == min(save_top_k, 4)
    assert min(on_disk.values()) == pytest.approx(validations[best_step], abs=1e-6)

    code, _, err = run_cli(["validate", *args, "--ckpt_path", "best"])
    assert code == 0, err
    evaluated = [r["val/loss"] for r in read_metrics(tmp_path / "version_1") if "val/loss" in r]
    assert evaluated == [pytest.approx(validations[best_step], abs=1e-5)]


# ---------------------------------------------------------------------- max_steps mid-epoch, then extend


def test_stop_on_max_steps_mid_epoch_then_extend_matches_one_run(tmp_path):
    """The README's sequence: a short run (max_steps ends mid-epoch), then ``--ckpt_path last`` with
    a larger max_steps: same losses at every step and the same epoch as one uninterrupted run."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    code, _, err = run_cli(["fit", *tiny_copy_args(straight), "--trainer.max_steps=8"])
    assert code == 0, err
    code, _, err = run_cli(["fit", *tiny_copy_args(split), "--trainer.max_steps=4"])  # epochs of 3: stops mid-epoch
    assert code == 0, err
    code, _, err = run_cli(["fit", *tiny_copy_args(split), "--trainer.max_steps=8", "--ckpt_path", "last"])
    assert code == 0, err
    assert losses([split / "version_0", split / "version_1"]) == pytest.approx(losses([straight / "version_0"]), abs=1e-6)
    reference = torch.load(checkpoint_dir(straight) / "last.ckpt", weights_only=False)
    final = torch.load(checkpoint_dir(split) / "last.ckpt", weights_only=False)
    assert (final["epoch"], final["global_step"]) == (reference["epoch"], reference["global_step"]) == (2, 8)
    assert_same_weights(reference, final)


# ---------------------------------------------------------------------- a saved config re-runs the same run


def test_saved_config_reruns_the_same_run_under_its_own_root(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    args = [a for a in tiny_copy_args(first, "linear", "--data.val_batches=4") if not a.startswith("--trainer.logger")]
    code, _, err = run_cli(["fit", *args, "--trainer.limit_val_batches", "1", "--trainer.max_steps=3"])
    assert code == 0, err
    saved = first / "version_0" / "config.yaml"
    assert yaml.safe_load(saved.read_text())["trainer"]["limit_val_batches"] == 1  # a count, not 1.0 = 100 %
    assert yaml.safe_load(saved.read_text())["checkpoint"]["dirpath"] is None  # follows the root
    before = snapshot(first)

    counts = tmp_path / "counts.json"
    callback = json.dumps({"class_path": "conftest.BatchCounter", "init_args": {"path": str(counts)}})
    code, _, err = run_cli(["fit", "--config", str(saved), f"--trainer.default_root_dir={second}",
                            f"--trainer.callbacks+={callback}"])
    assert code == 0, err
    assert json.loads(counts.read_text())["validate"] == 1  # one validation of 1 batch, not 4
    assert snapshot(first) == before and sorted(p.name for p in first.iterdir()) == ["version_0"]
    assert (checkpoint_dir(second) / "last.ckpt").is_file()


def test_print_config_keeps_integers_and_abbreviations_are_refused(tmp_path):
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.limit_val_batches", "1",
                              "--trainer.limit_train_batches", "0.5", "--print_config"])
    assert code == 0, err
    printed = yaml.safe_load(out)["trainer"]
    assert (printed["limit_val_batches"], printed["limit_train_batches"]) == (1, 0.5)
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.limit_val", "1"])
    assert code == 2 and "--trainer.limit_val" in err
    assert not list(tmp_path.glob("version_*"))


# ---------------------------------------------------------------------- no run overwrites another


def test_switching_backend_leaves_the_first_run_untouched(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear"), "--trainer.max_steps=3"])
    assert code == 0, err
    linear_run = snapshot(tmp_path)
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "softmax"), "--trainer.max_steps=3"])
    assert code == 0, err
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith("version_0")} == linear_run
    # "last" means the newest run of the configured model: each backend finds its own
    for backend, version in (("linear", 0), ("softmax", 1)):
        code, out, err = run_cli(["validate", *tiny_copy_args(tmp_path, backend), "--ckpt_path", "last"])
        assert code == 0, err
        assert f"--ckpt_path last: {checkpoint_dir(tmp_path, version) / 'last.ckpt'}" in out


def test_a_fixed_checkpoint_dir_is_never_overwritten_or_shared(tmp_path):
    shared = tmp_path / "shared"
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "a"), "--trainer.max_steps=1", f"--checkpoint.dirpath={shared}"])
    assert code == 0, err
    before = snapshot(shared)
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "b"), "--trainer.max_steps=1", f"--checkpoint.dirpath={shared}"])
    assert code == 2 and "already holds checkpoints of an earlier run" in err and "Traceback" not in err
    assert snapshot(shared) == before
    default_logger = [a for a in tiny_copy_args(tmp_path / "c") if not a.startswith("--trainer.logger")]
    code, _, err = run_cli(["fit", *default_logger, "--trainer.max_steps=1", f"--checkpoint.dirpath={shared}"])
    assert code == 2, err
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())  # a refused run leaves nothing
    # one process training into a directory holds it: a second claim is refused with the reason
    lock = claim_checkpoint_dir(tmp_path / "busy", resume_from=None)
    try:
        with pytest.raises(CheckpointSetupError, match="another process .* is training into"):
            claim_checkpoint_dir(tmp_path / "busy", resume_from=None)
    finally:
        lock.close()
    claim_checkpoint_dir(tmp_path / "busy", resume_from=None).close()  # free again


@pytest.mark.parametrize("own_logger", [False, True])
def test_unwritable_root_stops_before_training(tmp_path, own_logger):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = [a for a in tiny_copy_args(blocker / "run") if own_logger or not a.startswith("--trainer.logger")]
    code, _, err = run_cli(["fit", *args, "--trainer.max_steps=1"])
    assert code == 2 and str(blocker) in err and "default_root_dir" in err and "Traceback" not in err, err


def test_model_argument_contradicting_the_data_is_an_error(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--model.sequence_length=100", "--trainer.max_steps=1"])
    assert code == 2 and "sequence_length" in err and "=13" in err and "--data.max_length" in err
    assert not list(tmp_path.glob("version_*/checkpoints"))


# ---------------------------------------------------------------------- edges found in review


def test_evaluating_last_without_any_checkpoint_is_an_error(tmp_path):
    for subcommand in ("validate", "test", "predict"):
        code, _, err = run_cli([subcommand, *tiny_copy_args(tmp_path), "--ckpt_path", "last"])
        assert code == 2 and "no checkpoint found" in err and "train first" in err, (subcommand, err)
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1", "--ckpt_path", "last"])
    assert code == 0 and "training from scratch" in out, err  # a fit may always say --ckpt_path last


def test_fit_from_a_best_checkpoint_is_a_new_run(tmp_path):
    """Fine-tuning from a run's best checkpoint branches: it never writes into that run's folder."""
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=3"])
    assert code == 0, err
    original = snapshot(checkpoint_dir(tmp_path))
    (best,) = checkpoint_dir(tmp_path).glob("best-*.ckpt")
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=6", "--ckpt_path", str(best)])
    assert code == 0, err
    assert snapshot(checkpoint_dir(tmp_path)) == original
    assert (checkpoint_dir(tmp_path, 1) / "last.ckpt").is_file()


@pytest.mark.parametrize("setting", ["--model.lr=0.5", "--model.lr_decay_steps=2", "--model.weight_decay=0.1"])
def test_a_resumed_fit_refuses_optimizer_settings_it_would_ignore(tmp_path, setting):
    """A fit resumed from a checkpoint restores its optimizer and schedule, which hold the learning rate
    and decay: a configuration that differs there is refused (Lightning alone trains on with the
    checkpoint's values, without a word); --model.init_from starts a new run with the new ones, and an
    evaluation takes the checkpoint with any."""
    assert run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=3"])[0] == 0
    last = checkpoint_dir(tmp_path) / "last.ckpt"
    key, value = setting[len("--model."):].split("=")
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=6", setting, "--ckpt_path", "last"])
    assert code == 2, err
    saved = torch.load(last, map_location="cpu", weights_only=True)["hyper_parameters"][key]
    assert err.splitlines()[0] == (
        f"error: checkpoint {last}: a fit resumed from it continues its optimizer and learning-rate schedule, which "
        f"set {key}: checkpoint {saved!r}, configuration {type(saved)(value)!r}, "
        f"so the configuration's would be ignored. Resume with the checkpoint's values (its run's saved config), "
        f"or start a new run from its weights with these: --model.init_from {last}.")
    assert run_cli(["validate", *tiny_copy_args(tmp_path), setting, "--ckpt_path", "last"])[0] == 0
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "new"), "--trainer.max_steps=2", setting,
                            f"--model.init_from={last}"])
    assert code == 0, err
    if key in ("lr", "weight_decay"):
        groups = torch.load(checkpoint_dir(tmp_path / "new") / "last.ckpt", weights_only=True)["optimizer_states"][0]
        assert groups["param_groups"][0][key] == float(value)


def test_unreadable_newest_last_checkpoint_stops_instead_of_falling_back(tmp_path):
    for _ in range(2):
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1"])
        assert code == 0, err
    newest = checkpoint_dir(tmp_path, 1) / "last.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])  # e.g. caught while being written
    code, _, err = run_cli(["validate", *tiny_copy_args(tmp_path), "--ckpt_path", "last"])
    assert code == 2 and "cannot read checkpoint" in err and str(newest) in err


def test_last_is_found_under_a_user_loggers_layout(tmp_path):
    logger = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}})
    args = [a for a in tiny_copy_args(tmp_path) if not a.startswith("--trainer.logger")] + [f"--trainer.logger={logger}"]
    code, _, err = run_cli(["fit", *args, "--trainer.max_steps=1"])
    assert code == 0, err
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    code, out, err = run_cli(["fit", *args, "--trainer.max_steps=2", "--ckpt_path", "last"])
    assert code == 0 and f"--ckpt_path last: {last}" in out, err
    assert torch.load(last, weights_only=False)["global_step"] == 2


def test_fast_dev_run_leaves_no_run_directory(tmp_path):
    args = [a for a in tiny_copy_args(tmp_path) if not a.startswith("--trainer.logger")]
    code, _, err = run_cli(["fit", *args, "--trainer.fast_dev_run=1"])
    assert code == 0, err
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_time_based_validation_interval_is_still_accepted(tmp_path):
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.val_check_interval", "00:00:10:00",
                              "--print_config"])
    assert code == 0, err
    assert yaml.safe_load(out)["trainer"]["val_check_interval"] == "00:00:10:00"


def test_resolved_checkpoint_replaces_the_keyword_for_other_ranks():
    """DDP's other ranks re-run sys.argv: they get the file rank 0 resolved, not the keyword."""
    from linformer_lab.cli.args import with_ckpt_path

    argv = ["cli.py", "fit", "--config", "c.yaml", "--ckpt_path", "last", "--trainer.max_steps=3"]
    assert with_ckpt_path(argv, "/runs/v0/checkpoints/last.ckpt") == [
        "cli.py", "fit", "--config", "c.yaml", "--ckpt_path", "/runs/v0/checkpoints/last.ckpt", "--trainer.max_steps=3"]
    assert with_ckpt_path(["fit", "--ckpt_path=best"], "/b.ckpt") == ["fit", "--ckpt_path=/b.ckpt"]
    assert with_ckpt_path(argv, None) == ["cli.py", "fit", "--config", "c.yaml", "--trainer.max_steps=3"]
    assert with_ckpt_path(["fit", "--ckpt_path", "x.ckpt"], "/y") == ["fit", "--ckpt_path", "x.ckpt"]
