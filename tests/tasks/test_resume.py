"""Exact resume through the CLI: a run killed with SIGKILL right after a mid-epoch checkpoint and
resumed with ``fit --ckpt_path last`` ends with the same weights as an uninterrupted run.

Why the weights can be identical (not just close):
* the copy data is a pure function of (seed, split, epoch, batch index), and the data module's
  train loader is stateful: the checkpoint records how many batches of the current epoch are
  done, and the resumed loader starts exactly there (a plain loader would replay the epoch);
* the checkpoint holds the optimizer (RAdam moments and step) and the LR scheduler state, and
  the fit loop's progress counters (epoch, batch, global step), so validation and the lr drop
  happen at the same steps;
* nothing else draws random numbers (dropout 0; the hash rotations and random features are
  fixed buffers), and CPU kernels with the same thread count are deterministic.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, checkpoint_dir, cli_subprocess, read_metrics, run_cli, tiny_copy_args, tiny_mnist_args
from lightning.pytorch.callbacks import Callback

TOTAL_STEPS = 8
KILL_AT = 4  # a checkpoint every 4 steps; epochs are 3 batches long, so step 4 is mid-epoch


class PauseAfterStep(Callback):
    """Child-process helper: blocks at the start of the step after ``step``, i.e. once the
    checkpoint written at ``step`` is on disk, so the parent can SIGKILL it exactly there."""

    def __init__(self, step: int, seconds: float = 600.0):
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            time.sleep(self.seconds)


def _load_when_complete(path: Path, timeout: float, proc, step: int) -> dict:
    """Poll until ``path`` loads (it may be mid-write) and holds global step ``step`` (earlier
    checkpoints pass through it), or fail on timeout / child exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            try:
                ckpt = torch.load(path, map_location="cpu", weights_only=False)
                if ckpt["global_step"] == step:
                    return ckpt
            except Exception:
                pass  # still being written
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training process exited early with {proc.returncode}:\n{err[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no loadable {path} within {timeout} s")


def kill_once_checkpointed(proc, path: Path, step: int) -> None:
    """SIGKILL the training child ``proc`` as soon as ``path`` holds the checkpoint of ``step``."""
    try:
        _load_when_complete(path, timeout=300, proc=proc, step=step)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def assert_resumed_like_straight(straight: Path, resumed: Path, steps: range) -> None:
    """The resumed version's log (``resumed``, a ``version_N`` folder) holds a training loss at
    exactly ``steps``, each the loss the uninterrupted run (``straight``'s version_0) logged there."""
    straight_rows = {r["step"]: r["train/loss"] for r in read_metrics(straight / "version_0") if "train/loss" in r}
    resumed_rows = {r["step"]: r["train/loss"] for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(resumed_rows) == list(steps)
    for step, loss in resumed_rows.items():
        assert loss == pytest.approx(straight_rows[step], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["linear"])
def test_sigkill_and_resume_gives_identical_weights(tmp_path, backend):
    common = ["--trainer.max_steps", str(TOTAL_STEPS), "--checkpoint.every_n_train_steps", str(KILL_AT)]

    # 1. uninterrupted reference run
    straight = tmp_path / "straight"
    code, _, err = run_cli(["fit", *tiny_copy_args(straight, backend, *common)])
    assert code == 0, err
    reference = torch.load(checkpoint_dir(straight) / "last.ckpt", map_location="cpu", weights_only=False)
    assert reference["global_step"] == TOTAL_STEPS

    # 2. the same run in a child process, killed with SIGKILL right after the step-4 checkpoint
    resumed = tmp_path / "resumed"
    pause = f'[{{"class_path": "test_resume.PauseAfterStep", "init_args": {{"step": {KILL_AT}}}}}]'
    proc = cli_subprocess(
        ["fit", *tiny_copy_args(resumed, backend, *common, f"--trainer.callbacks={pause}")],
        env={"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests")])},  # this file, conftest
    )
    kill_once_checkpointed(proc, checkpoint_dir(resumed) / "last.ckpt", KILL_AT)

    # 3. resume from last.ckpt (found under the root; the resumed run keeps writing its checkpoints)
    code, _, err = run_cli(["fit", *tiny_copy_args(resumed, backend, *common, "--ckpt_path", "last")])
    assert code == 0, err
    final = torch.load(checkpoint_dir(resumed) / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == TOTAL_STEPS

    for name, want in reference["state_dict"].items():
        got = final["state_dict"][name]
        assert torch.allclose(got, want, atol=1e-6, rtol=0), f"{name} differs by {(got - want).abs().max():.3g}"
    # The losses of the steps after the kill agree too (same batches, same optimizer state).
    assert_resumed_like_straight(straight, resumed / "version_1", range(KILL_AT, TOTAL_STEPS))


class StopAtStep(Callback):
    """Stops training after update ``step`` the way Lightning's Timer (max_time) does: by setting
    ``should_stop`` at the end of the batch, which also runs a validation there; or by sending this
    process ``signal`` (its name) during the update, for the CLI's StopOnSignal to stop there."""

    def __init__(self, step: int, signal: str | None = None):
        self.step, self.signal = step, signal

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.signal and trainer.global_step == self.step - 1:
            os.kill(os.getpid(), getattr(signal, self.signal))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.signal and trainer.global_step == self.step:
            trainer.should_stop = True


@pytest.mark.parametrize("how, exit_code", [(None, 0), ("SIGTERM", 143), ("SIGINT", 130)])
def test_run_stopped_off_the_validation_grid_resumes_at_its_own_step(tmp_path, how, exit_code):
    """A run stopped between validations (max_time, a callback setting should_stop, Ctrl-C or SIGTERM)
    writes last.ckpt at the stop's batch and again after the validation the stop runs, which it records.
    Resumed, every update logs under its own step with the uninterrupted run's loss there; with
    Lightning 2.6 alone the rest of the epoch was skipped (validation at epoch ends here)."""
    stop_at = 5  # epochs of 3 batches, validation at each epoch end: step 5 is mid-epoch
    common = ["--trainer.max_steps", str(TOTAL_STEPS)]
    straight = tmp_path / "straight"
    assert run_cli(["fit", *tiny_copy_args(straight, "linear", *common)])[0] == 0
    stopped = tmp_path / "stopped"
    stop = json.dumps([{"class_path": "test_resume.StopAtStep", "init_args": {"step": stop_at, "signal": how}}])
    code, _, err = run_cli(["fit", *tiny_copy_args(stopped, "linear", *common, f"--trainer.callbacks={stop}")])
    assert code == exit_code, err
    ckpt = torch.load(checkpoint_dir(stopped) / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == stop_at
    assert any(r["step"] == stop_at - 1 and "val/loss" in r for r in read_metrics(stopped / "version_0"))
    best = [state["best_model_path"] for key, state in ckpt["callbacks"].items() if "best_model_path" in state]
    assert any(path.endswith(f"step={stop_at}.ckpt") for path in best), best  # the stop's validation is recorded

    code, _, err = run_cli(["fit", *tiny_copy_args(stopped, "linear", *common, "--ckpt_path", "last")])
    assert code == 0, err
    assert_resumed_like_straight(straight, stopped / "version_1", range(stop_at, TOTAL_STEPS))


def test_a_signal_during_gradient_accumulation_stops_at_the_optimizer_step(tmp_path):
    """With two batches an update, SIGTERM during batch 3 (the first half of update 2; StopAtStep sends
    it again in batch 4, which changes nothing) stops after batch 4, at update 2: a checkpoint holds no
    accumulated gradients. Resumed, the run ends with the uninterrupted run's weights."""
    common = ["--trainer.max_steps=4", "--trainer.accumulate_grad_batches=2", "--data.train_batches_per_epoch=4"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(["fit", *tiny_copy_args(straight, "linear", *common)])[0] == 0
    stop = json.dumps([{"class_path": "test_resume.StopAtStep", "init_args": {"step": 2, "signal": "SIGTERM"}}])
    code, _, err = run_cli(["fit", *tiny_copy_args(stopped, "linear", *common, f"--trainer.callbacks={stop}")])
    assert code == 143, err
    assert torch.load(checkpoint_dir(stopped) / "last.ckpt", weights_only=True)["global_step"] == 2
    assert run_cli(["fit", *tiny_copy_args(stopped, "linear", *common, "--ckpt_path", "last")])[0] == 0
    final, want = (torch.load(checkpoint_dir(root) / "last.ckpt", weights_only=True)["state_dict"]
                   for root in (stopped, straight))
    for name in want:
        assert torch.allclose(final[name], want[name], atol=1e-6, rtol=0), name


class PoisonAtStep(Callback):
    """Sets one weight to NaN at the end of update ``step``: a run that diverged there."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


@pytest.mark.parametrize("diverged_at, found_at, kept", [(4, 4, 3), (1, 2, None)])
def test_a_diverged_run_ends_with_one_line_and_keeps_its_last_finite_checkpoint(tmp_path, diverged_at, found_at, kept):
    """last.ckpt is written every 2 updates and after each validation (every 3): the first of those after
    the divergence finds it, and keeps the one before."""
    poison = json.dumps([{"class_path": "test_resume.PoisonAtStep", "init_args": {"step": diverged_at}}])
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear", "--trainer.max_steps=8",
                                                   "--checkpoint.every_n_train_steps=2", f"--trainer.callbacks={poison}")])
    assert code == 1, err
    last = checkpoint_dir(tmp_path) / "last.ckpt"
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    said = f"error: training diverged: the weights hold NaN or inf at step {found_at}, so last.ckpt was not written"
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith(said), err
    assert (tmp_path / "version_0" / "config.yaml").is_file()  # the run's folder stays
    if kept is None:
        assert not last.exists() and "start again with a smaller learning rate" in lines[0]
        return
    assert f"{last} keeps step {kept}, the last finite weights: start a new run from them with --model.init_from {last}" \
        in lines[0]
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == kept and all(t.isfinite().all() for t in saved["state_dict"].values())


@pytest.mark.slow
def test_max_time_stop_resumes_like_an_uninterrupted_run(tmp_path):
    """`--trainer.max_time` (docs/cli.md): the run stops wherever its clock runs out; resumed to a few
    more updates it has the uninterrupted run's losses at every step and its final weights."""
    timed = tmp_path / "timed"
    code, _, err = run_cli(["fit", *tiny_copy_args(timed, "linear", "--trainer.max_steps", "100000",
                                                   "--trainer.max_time", "00:00:00:02")])
    assert code == 0, err
    stopped_at = torch.load(checkpoint_dir(timed) / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 0 < stopped_at < 100000
    total = str(stopped_at + 4)
    assert run_cli(["fit", *tiny_copy_args(timed, "linear", "--trainer.max_steps", total, "--ckpt_path", "last")])[0] == 0
    straight = tmp_path / "straight"
    assert run_cli(["fit", *tiny_copy_args(straight, "linear", "--trainer.max_steps", total)])[0] == 0

    assert_resumed_like_straight(straight, timed / "version_1", range(stopped_at, stopped_at + 4))
    final, want = (torch.load(checkpoint_dir(root) / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
                   for root in (timed, straight))
    for name in want:
        assert torch.allclose(final[name], want[name], atol=1e-6, rtol=0), name


@pytest.mark.slow
def test_another_batch_size_resumes_from_an_epoch_end_and_is_refused_mid_epoch(tmp_path):
    """``--data.batch_size`` changed on resume: the saved position (batches done in the epoch)
    named other images, and the resumed epoch skipped or repeated some without a word. Mid-epoch
    the CLI refuses it in one line, leaving no run folder; from an epoch's end (4 updates an
    epoch here) the next epoch starts whole at the new size."""
    code, _, err = run_cli(["fit", *tiny_mnist_args(tmp_path, "--trainer.max_steps=2")])
    assert code == 0, err
    code, _, err = run_cli(["fit", *tiny_mnist_args(tmp_path, "--trainer.max_steps=6", "--data.batch_size=2"),
                            "--ckpt_path", "last"])
    refusal = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(refusal) == 1, err[-3000:]
    assert ("written by batch_size 4 in the middle of an epoch and this run has batch_size 2" in refusal[0]
            and "until the epoch ends (2 more batches)" in refusal[0]), refusal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0"]
    code, _, err = run_cli(["fit", *tiny_mnist_args(tmp_path, "--trainer.max_steps=4"), "--ckpt_path", "last"])
    assert code == 0, err
    code, _, err = run_cli(["fit", *tiny_mnist_args(tmp_path, "--trainer.max_steps=6", "--data.batch_size=2"),
                            "--ckpt_path", "last"])
    assert code == 0, err
    steps = [(row["epoch"], row["step"]) for row in read_metrics(tmp_path / "version_2") if "train/bits_per_dim" in row]
    assert steps == [(1, 4), (1, 5)]
