"""What a run says while it runs and when it is stopped (issue 43, item 3): the progress bar of a
resumed run counts only this process's batches in its rate; Ctrl-C or SIGTERM stop a fit at the end
of the update under way, where last.ckpt is written, with one line and exit code 130 / 143; a second
Ctrl-C (or a KeyboardInterrupt raised in the code) stops at once, naming the updates lost."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import checkpoint_dir, cli_subprocess, run_cli, tiny_copy_args
from test_cli_startup import error_lines
from tqdm import tqdm

from linformer_lab.tasks.checkpointing import StopOnSignal


class InterruptAt(L.Callback):
    """Raises KeyboardInterrupt (what Ctrl-C raises) at the end of update ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class RecordBar(L.Callback):
    """Writes the training bar's tqdm state at the end of training to the JSON file ``path``."""

    def __init__(self, path: str, sleep: float = 0.0):
        self.path, self.sleep = path, sleep

    def on_train_batch_end(self, *args):
        time.sleep(self.sleep)  # a known least time per batch

    def on_train_end(self, trainer, pl_module):
        state = trainer.progress_bar_callback.train_progress_bar.format_dict
        Path(self.path).write_text(json.dumps({k: state[k] for k in ("n", "total", "initial", "elapsed")}
                                              | {"line": tqdm.format_meter(**state)}))


class SignalAt(L.Callback):
    """Sends this process ``signals`` (their names) at the start of update ``step`` (1-based), while
    the fit's own handlers hold (a test failure, not a killed test process, where they do not)."""

    def __init__(self, step: int, signals: list[str], handler: str = "StopOnSignal"):
        self.step, self.signals, self.handler = step, signals, handler

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step - 1:
            for name in self.signals:
                handler = signal.getsignal(getattr(signal, name))
                owner = getattr(handler, "__self__", handler)
                assert type(owner).__name__ == self.handler, f"{name} handler: {handler}"
                os.kill(os.getpid(), getattr(signal, name))


class SignalAtEvaluation(L.Callback):
    """Sends this process ``signal`` (its name) at the first batch of validate, test or predict."""

    def __init__(self, signal: str):
        self.signal, self.sent = signal, False

    def _send(self, *args) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), getattr(signal, self.signal))

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _send


def callback(cls: type, **init_args) -> str:
    return f"--trainer.callbacks+={json.dumps({'class_path': f'{__name__}.{cls.__name__}', 'init_args': init_args})}"


def test_ctrl_c_is_one_line_with_the_saved_step_and_exit_130(tmp_path):
    notices = []
    handler = logging.Handler()
    handler.emit = notices.append
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    lightning_log.addHandler(handler)
    sigint = signal.getsignal(signal.SIGINT)
    try:  # last.ckpt every 2 updates, Ctrl-C during update 5: step 4 saved, 1 update lost
        code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=20",
                                  "--checkpoint.every_n_train_steps=2", callback(InterruptAt, step=5)])
    finally:
        lightning_log.removeHandler(handler)
    assert code == 130, err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    last = checkpoint_dir(tmp_path) / "last.ckpt"
    assert lines[0] == (f"interrupted (Ctrl-C) at step 5: {last} holds step 4, so the 1 update since is lost; "
                        f"--ckpt_path last with the same config resumes from step 4.")
    assert torch.load(last, weights_only=True)["global_step"] == 4
    assert not any("KeyboardInterrupt" in str(record.msg) for record in notices)
    assert signal.getsignal(signal.SIGINT) == sigint  # Lightning's SIG_IGN does not outlive the run


@pytest.mark.parametrize("name, cause, code", [("SIGINT", "Ctrl-C", 130), ("SIGTERM", "SIGTERM", 143)])
def test_a_signal_stops_at_the_end_of_the_update_with_last_ckpt_written_there(tmp_path, name, cause, code):
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    code_, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=20",
                               callback(SignalAt, step=5, signals=[name])])
    assert code_ == code, err
    last = checkpoint_dir(tmp_path) / "last.ckpt"
    assert error_lines(err) == [f"stopped by {cause} at step 5: {last} holds step 5, so nothing is lost; "
                                f"--ckpt_path last with the same config resumes from step 5."]
    assert torch.load(last, weights_only=True)["global_step"] == 5
    assert "fit finished" not in out
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=20", "--checkpoint.every_n_train_steps=2",
                            callback(SignalAt, step=6, signals=["SIGINT", "SIGINT"])])
    assert code == 130, err
    last = checkpoint_dir(tmp_path) / "last.ckpt"  # update 6 never ran: step 5 reached, step 4 saved
    assert error_lines(err) == [f"interrupted (Ctrl-C) at step 5: {last} holds step 4, so the 1 update since is lost; "
                                f"--ckpt_path last with the same config resumes from step 4."]


def test_a_signal_stops_at_once_where_min_steps_overrule_a_stop(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=20", "--trainer.min_steps=10",
                            callback(SignalAt, step=2, signals=["SIGTERM"])])
    assert code == 143, err
    assert error_lines(err) == ["stopped by SIGTERM at step 2: no checkpoint was saved, so all 2 updates are lost "
                                "(last.ckpt is written at every validation, and every --checkpoint.every_n_train_steps)."]


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
@pytest.mark.parametrize("name, said, code", [("SIGINT", "interrupted (Ctrl-C)", 130), ("SIGTERM", "stopped by SIGTERM", 143)])
def test_a_signal_ends_an_evaluation_at_once_with_one_line(tmp_path, command, name, said, code):
    # Lightning's prediction loop alone ignores SIGTERM, and runs to its end
    code_, out, err = run_cli([command, *tiny_copy_args(tmp_path, "linear", "--data.val_batches=5", "--data.test_batches=5"),
                               callback(SignalAtEvaluation, signal=name)])
    assert code_ == code, err
    assert error_lines(err) == [f"{said} during {command}; it writes no checkpoint, and nothing of it was saved."]
    assert "saved" not in out


def test_a_forked_process_leaves_the_signal_to_the_one_that_set_the_handler():
    """A DataLoader worker forked during the fit inherits StopOnSignal's handler (a terminal's Ctrl-C
    reaches it too): there the handler does nothing, where the default would end the worker."""
    stop = StopOnSignal()
    stop._owner, stop._training = os.getpid() + 1, True
    stop._on_signal(signal.SIGINT, None)
    stop._on_signal(signal.SIGTERM, None)
    assert stop.received is None
    stop._owner = os.getpid()
    stop._on_signal(signal.SIGTERM, None)
    assert stop.received == "SIGTERM"


def test_without_checkpoints_sigterm_stops_through_lightning_and_says_so(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=20", "--checkpoint.enabled=false",
                            callback(SignalAt, step=3, signals=["SIGTERM"], handler="_HandlersCompose")])
    assert code == 143, err
    assert error_lines(err) == ["stopped by SIGTERM at step 3: no checkpoint was saved, so all 3 updates are lost "
                                "(last.ckpt is written at every validation, and every --checkpoint.every_n_train_steps)."]


def _default_ctrl_c() -> None:
    """In the child before it runs: SIGINT's default action, as a terminal's foreground job has it
    (an ignored SIGINT is inherited across exec, and Python then keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("name, cause, code", [("SIGINT", "Ctrl-C", 130), ("SIGTERM", "SIGTERM", 143)])
def test_a_real_signal_stops_the_process_at_an_update_end_with_nothing_lost(tmp_path, name, cause, code):
    """The signal goes to the whole process group, as a terminal's Ctrl-C or a scheduler's SIGTERM
    does: the DataLoader workers (the validation's, started before training, and the training's)
    get it too, and must not take the run down with them."""
    # faulthandler: a run that outlives its signal is aborted below and shows where it stood
    proc = cli_subprocess(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=100000",
                           "--checkpoint.every_n_train_steps=1", "--data.train_batches_per_epoch=100000",
                           "--data.num_workers=1", "--trainer.num_sanity_val_steps=1"],
                          env={"PYTHONFAULTHANDLER": "1"}, preexec_fn=_default_ctrl_c, start_new_session=True)
    last = checkpoint_dir(tmp_path) / "last.ckpt"
    deadline = time.monotonic() + 120
    while not last.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(proc.pid, getattr(signal, name))
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate()
        pytest.fail(f"still running 60 s after its {cause}; its threads when aborted:\n{err[-6000:]}")
    assert proc.returncode == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    notice = f"{cause}: stopping at the end of this update, where last.ckpt is written"
    assert lines[-2] == notice + ("; Ctrl-C again stops at once" if name == "SIGINT" else ""), err
    stopped = re.fullmatch(rf"stopped by {cause} at step (\d+): (.*) holds step (\d+), so nothing is lost; "
                           r"--ckpt_path last with the same config resumes from step \d+\.", lines[-1])
    assert stopped and stopped[1] == stopped[3] and stopped[2] == str(last), err
    assert torch.load(last, weights_only=True)["global_step"] == int(stopped[1])
    assert "Traceback" not in err and "graceful shutdown" not in err


def test_the_bar_of_a_resumed_run_rates_only_this_process_batches(tmp_path):
    args = [*tiny_copy_args(tmp_path), "--data.train_batches_per_epoch=20", "--trainer.val_check_interval=null"]
    code, _, err = run_cli(["fit", *args, "--trainer.max_steps=16"])  # stops 16 batches into epoch 0
    assert code == 0, err
    record = tmp_path / "bar.json"
    code, _, err = run_cli(["fit", *args, "--trainer.max_steps=20", "--ckpt_path", "last",
                            "--trainer.enable_progress_bar=true", callback(RecordBar, path=str(record), sleep=0.05)])
    assert code == 0, err
    bar = json.loads(record.read_text())
    assert (bar["n"], bar["total"], bar["initial"]) == (20, 20, 16)  # the count includes the restored batches
    shown = float(re.search(r"([\d.]+)it/s", bar["line"]).group(1))
    # the rate shown is the 4 batches this process ran over its time (16 more would be 5x it)
    assert shown == pytest.approx(4 / bar["elapsed"], rel=0.05), bar["line"]
