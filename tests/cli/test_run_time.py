"""Every fit says how long it will take (issue 43, item 10): once the rate has settled, one line
with the projected time of the whole run (its updates and validations) on this machine, and on a
CPU, for a GPU-sized config of over an hour, the command of its CPU recipe."""

from __future__ import annotations

import json
import re

import lightning as L
import pytest
from conftest import run_cli, tiny_copy_args, tiny_mnist_args

from linformer_lab.cli.checks import cpu_recipe
from linformer_lab.tasks.callbacks import format_duration, validations_within

LINE = re.compile(r"time: about (.+?) for this run on this machine.*?\(([\d,]+) updates at ([\d.e-]+) s, "
                  r"([\d,]+) validations? of (\d+) batch(?:es)? at ([\d.e-]+) s")


class StopAt(L.Callback):
    """Stops training after update ``step`` (as Ctrl-C would, without the exit)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def time_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("time: ")]


def test_a_fit_prints_once_the_projected_time_of_its_updates_and_validations(tmp_path):
    counts = tmp_path / "counts.json"
    counter = json.dumps({"class_path": "conftest.BatchCounter", "init_args": {"path": str(counts)}})
    # 3 batches an epoch, validation (2 batches) at every epoch's end: 60 updates, 20 validations
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=60",
                              f"--trainer.callbacks+={counter}"])
    assert code == 0, err
    lines = time_lines(out)
    assert len(lines) == 1, out
    found = LINE.match(lines[0])
    assert found, lines[0]
    updates, validations, batches = (int(found.group(i).replace(",", "")) for i in (2, 4, 5))
    ran = json.loads(counts.read_text())
    assert (updates, batches) == (60, 2) and ran["train"] == 60
    assert validations * batches == ran["validate"]  # the validations the run then ran
    assert "CPU recipe" not in lines[0]  # a few seconds: nothing to suggest
    # one epoch: its one validation is said in the singular
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path / "one"), "--data.train_batches_per_epoch=45",
                              "--trainer.max_steps=45"])
    assert code == 0 and ", 1 validation of 2 batches at " in time_lines(out)[0], out


@pytest.mark.slow
def test_a_gpu_sized_config_of_over_an_hour_on_a_cpu_names_its_cpu_recipe(tmp_path):
    # the README's MNIST config at toy width but its real length (250 epochs of 12,500 batches)
    stop = json.dumps({"class_path": f"{__name__}.StopAt", "init_args": {"step": 45}})
    code, out, err = run_cli(["fit", *tiny_mnist_args(tmp_path), "--trainer.limit_train_batches=null",
                              "--trainer.val_check_interval=null", f"--trainer.callbacks+={stop}"])
    assert code == 0, err
    lines = time_lines(out)
    assert len(lines) == 1, out
    assert LINE.match(lines[0]).group(2) == f"{250 * 12_500:,}"
    assert lines[0].endswith("its CPU recipe: python cli.py fit --config mnist_cpu_linear.yaml."), lines[0]


def test_cpu_recipe_names_and_durations():
    assert cpu_recipe("mnist_linear") == "mnist_cpu_linear.yaml" and cpu_recipe("speech_lsh4") == "speech_cpu_lsh4.yaml"
    assert cpu_recipe("copy_linear") == "copy_cpu_linear.yaml"
    assert cpu_recipe("mnist_cpu_linear") is None and cpu_recipe("copy_lsh4") is None and cpu_recipe("config") is None
    assert [format_duration(s) for s in (45, 720, 12_000, 1_234_567)] == ["45 s", "12 min", "3 h 20 min", "14 d 6 h"]


def test_validations_within_counts_as_lightning_validates():
    # every 2nd batch of every epoch of 5 batches: after batches 2 and 4 of each epoch
    assert validations_within(12, 0, 0, 5, 2, 1) == 2 + 2 + 1
    assert validations_within(10, 0, 0, 5, 5, 2) == 1  # at the end of every 2nd epoch only
    assert validations_within(4, 1, 3, 5, 5, 1) == 1  # resumed 3 batches into epoch 1: its end, then 2 more


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def updates_until_the_line(seconds_per_update: float, build_s: float = 20.0, **kwargs) -> tuple[int, float, float]:
    """(updates, seconds) a fake run at ``seconds_per_update`` runs before RunTimeEstimate speaks,
    and the time per update it reports; the first update also builds kernels (``build_s`` more)."""
    from types import SimpleNamespace

    from linformer_lab.tasks.callbacks import RunTimeEstimate

    clock = FakeClock()
    estimate = RunTimeEstimate(clock=clock, **kwargs)
    estimate.describe = lambda trainer, per_update: f"{per_update:.6g}"
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, progress_bar_callback=None)
    estimate.on_train_start(trainer, None)
    while estimate.line is None and trainer.global_step < 1000:
        clock.now += seconds_per_update + (build_s if trainer.global_step == 0 else 0.0)
        trainer.global_step += 1
        estimate.on_train_batch_end(trainer)
    return trainer.global_step, clock.now, float(estimate.line)


def test_slow_updates_get_the_projection_within_a_minute_by_seconds(capsys):
    # 25 s an update (the paper's MNIST model on a 2-core CPU): the warm-up ends with the first
    # update (45 s with its build), the second is measured: a line at 70 s, not after 13 updates
    updates, seconds, per_update = updates_until_the_line(25.0)
    assert (updates, seconds, per_update) == (2, 70.0, 25.0)
    assert capsys.readouterr().out == "25\n"
    # 4 s an update: warm-up until 15 s have passed (the first, at 24 s), then 15 s of measurement
    assert updates_until_the_line(4.0) == (5, 40.0, 4.0)


def test_fast_updates_are_measured_by_count():
    # 0.1 s an update: 10 updates of warm-up, then 30 measured, far within the time bounds
    assert updates_until_the_line(0.1, build_s=0.0) == (40, pytest.approx(4.0), pytest.approx(0.1))
    # a slow first update (a kernel build) ends the warm-up by itself
    assert updates_until_the_line(0.1, build_s=20.0) == (31, pytest.approx(23.1), pytest.approx(0.1))
    # the old count-only rule, for contrast: 13 updates of 25 s before a word
    assert updates_until_the_line(25.0, warmup_s=float("inf"), max_wait_s=float("inf"), measure=3)[:2] == (13, 345.0)


def test_a_slow_sanity_check_says_what_it_does(capsys):
    from types import SimpleNamespace

    from linformer_lab.tasks.callbacks import RunTimeEstimate

    trainer = SimpleNamespace(is_global_zero=True, progress_bar_callback=None, num_sanity_val_batches=[2],
                              num_sanity_val_steps=2)
    quick = RunTimeEstimate(notice_s=60.0)
    quick.on_sanity_check_start(trainer, None)
    quick.on_sanity_check_end(trainer, None)  # done within the notice's delay: no line
    slow = RunTimeEstimate(notice_s=0.0)
    slow.on_sanity_check_start(trainer, None)
    slow.notice_timer.join(timeout=10)
    slow.on_sanity_check_end(trainer, None)
    assert capsys.readouterr().out == ("sanity check: 2 validation batches before the first update, to find a fault in "
                                       "validation before hours of training (--trainer.num_sanity_val_steps 0 skips it)\n")
