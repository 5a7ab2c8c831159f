"""Multi-process training (DDP, gloo on CPU) of the copy task through ``cli.py``: two processes
train as one job, equal to one process at twice the batch; they resume exactly, after a
``max_steps`` stop and after ``kill -9`` of both; ``best`` picks the best; a checkpoint of another
process count continues from an epoch's end and is refused mid-epoch; bf16-mixed runs.

Context parallelism through ``cli.py`` (``--model.context_parallel 2``): the two processes split
every copy sequence (and every MNIST image's sub-pixels) in two and train, validate, test and
predict as one process given the same batches (docs/CONTEXT_PARALLEL.md).

One ``torchrun`` job (``copy_job``, module-scoped) holds most runs: two "nodes" of one process
each (``torchrun --nnodes 2 --node_rank 0/1``, rendezvous on 127.0.0.1, ``--trainer.num_nodes
2``), every process running the commands of a plan in order (tests/tasks/ddp_driver.py), the
context-parallel runs after the data-parallel ones. The run killed with ``kill -9`` uses the
documented line instead (``--trainer.devices 2 --trainer.strategy ddp``: Lightning starts the
second process); the job resumes it. The one-process references run in this process.

Why data parallelism equals one process: ``p`` processes at batch size ``b`` see, at every step, the sequences one
process sees at ``p * b`` (linformer_lab/data/sampling.py); the loss is the mean over the copied
tokens of the whole global batch (``Task.global_mean``) and DDP averages the gradients; the
validation loss is weighted by copied tokens and summed over the processes. What differs is the
order of floating-point sums, hence the tolerances.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, checkpoint_dir, run_cli, tiny_copy_args, tiny_mnist_args
from ddp_driver import assert_same_weights, free_port, job_env, metrics, only, run_job, save_weights, torchrun, weights
from test_resume import assert_resumed_like_straight

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

STEPS_PER_EPOCH, TOTAL_STEPS, STOP_AT = 3, 8, 4  # step 4 is in the middle of the second epoch
#: the copy data of one process at batch 4 and of two at batch 2: the same global batches
ONE_PROCESS = ("--data.batch_size=4", "--data.train_batches_per_epoch=3", "--data.val_batches=2",
               "--data.test_batches=2")
TWO_PROCESSES = ("--data.batch_size=2", "--data.train_batches_per_epoch=6", "--data.val_batches=4",
                 "--data.test_batches=4")
#: the killed run: a checkpoint every 4 updates, the last of which the kill follows
KILLED = (f"--trainer.max_steps={TOTAL_STEPS}", f"--checkpoint.every_n_train_steps={STOP_AT}")
#: SIGTERM to the second process alone, during update STOP_AT
PREEMPT_RANK_1 = "--trainer.callbacks+=" + json.dumps({"class_path": "ddp_driver.SignalRank",
                                                       "init_args": {"rank": 1, "step": STOP_AT}})
TWO_NODES = ("--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=2")


def copy_args(root: Path, *extra: str, processes: tuple[str, ...] = TWO_PROCESSES) -> list[str]:
    return tiny_copy_args(root, "linear", *processes, "--trainer.max_epochs=null", "--checkpoint.save_top_k=-1", *extra)


@pytest.fixture(scope="module")
def copy_job(tmp_path_factory) -> Path:
    """Every DDP copy run of this file: ``killed`` (the documented line, killed with SIGKILL after
    4 updates), then one job on two "nodes" of one process each: ``killed`` resumed with
    ``--ckpt_path last`` to 8 updates, ``straight`` (8 updates), ``stopped`` (stopped by
    max_steps at 4, resumed to 8, then validate ``best``, test and predict ``last``), ``bf16``
    (4 updates, bf16-mixed) and ``preempted`` (SIGTERM to the second process during update 4, resumed
    to 8); then the context-parallel runs (:func:`context_parallel_plan`)."""
    out = tmp_path_factory.mktemp("copy_ddp")
    straight, stopped, bf16, killed, preempted = (out / name for name in ("straight", "stopped", "bf16", "killed", "preempted"))
    start_and_kill_9(killed, out / "killed.log")
    total = f"--trainer.max_steps={TOTAL_STEPS}"
    plan = [
        ["fit", *copy_args(killed, *KILLED, save_weights(killed / "weights_"), *TWO_NODES), "--ckpt_path", "last"],
        ["fit", *copy_args(straight, total, save_weights(straight / "weights_"), *TWO_NODES)],
        ["fit", *copy_args(stopped, f"--trainer.max_steps={STOP_AT}", *TWO_NODES)],
        ["fit", *copy_args(stopped, total, save_weights(stopped / "weights_"), *TWO_NODES), "--ckpt_path", "last"],
        ["validate", *copy_args(stopped, *TWO_NODES), "--ckpt_path", "best"],
        ["test", *copy_args(stopped, *TWO_NODES), "--ckpt_path", "last"],
        ["predict", *copy_args(stopped, *TWO_NODES), "--ckpt_path", "last"],
        ["fit", *copy_args(bf16, f"--trainer.max_steps={STOP_AT}", "--trainer.precision=bf16-mixed",
                           save_weights(bf16 / "weights_"), *TWO_NODES)],
        {"args": ["fit", *copy_args(preempted, total, PREEMPT_RANK_1, *TWO_NODES)], "exit_code": 143},
        ["fit", *copy_args(preempted, total, save_weights(preempted / "weights_"), *TWO_NODES), "--ckpt_path", "last"],
        *context_parallel_plan(out),
    ]
    port = free_port()
    nodes = [(torchrun("--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}", "--master_addr=127.0.0.1",
                       f"--master_port={port}"), {}) for rank in (0, 1)]
    run_job(plan, out, nodes)
    return out


@pytest.fixture(scope="module")
def one_process(copy_job) -> Path:
    """The straight run in one process at twice the batch: the same global batches."""
    root = copy_job / "one_process"
    code, _, err = run_cli(["fit", *copy_args(root, f"--trainer.max_steps={TOTAL_STEPS}", save_weights(root / "weights_"),
                                              processes=ONE_PROCESS)])
    assert code == 0, err[-3000:]
    return root


def test_two_nodes_train_as_one_job_equal_to_one_process(copy_job, one_process):
    straight = copy_job / "straight"
    node0, node1 = weights(straight / "weights_rank0.pt"), weights(straight / "weights_rank1.pt")
    assert_same_weights(node1, node0)  # one model: the gradients were averaged over the nodes
    assert_same_weights(node0, weights(one_process / "weights_rank0.pt"), atol=1e-6)
    for key in ("train/loss", "val/loss", "val/accuracy"):
        got, want = metrics(straight / "version_0", key), metrics(one_process / "version_0", key)
        assert sorted(got) == sorted(want) and len(got) == (TOTAL_STEPS if key == "train/loss" else 2), key
        assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5), key
    log = (copy_job / "process0.log").read_text()
    assert "Starting with 2 processes" in log and "GLOBAL_RANK: 0" in log


def test_resume_after_max_steps_stop_continues_the_uninterrupted_run(copy_job):
    stopped, straight = copy_job / "stopped", copy_job / "straight"
    assert max(metrics(stopped / "version_0", "train/loss")) == STOP_AT - 1
    assert_resumed_like_straight(straight, stopped / "version_1", range(STOP_AT, TOTAL_STEPS))
    assert_same_weights(weights(stopped / "weights_rank0.pt"), weights(straight / "weights_rank0.pt"))


def test_sigterm_to_one_process_stops_both_at_that_update_and_resumes_the_uninterrupted_run(copy_job):
    preempted, straight = copy_job / "preempted", copy_job / "straight"
    assert max(metrics(preempted / "version_0", "train/loss")) == STOP_AT - 1
    assert_resumed_like_straight(straight, preempted / "version_1", range(STOP_AT, TOTAL_STEPS))
    assert_same_weights(weights(preempted / "weights_rank0.pt"), weights(straight / "weights_rank0.pt"))
    last = preempted / "version_0" / "checkpoints" / "last.ckpt"
    said = f"stopped by SIGTERM at step {STOP_AT}: {last} holds step {STOP_AT}, so nothing is lost;"
    assert said in (copy_job / "process0.log").read_text()  # rank 0, which had no signal, says it


def test_evaluation_best_and_predictions_equal_one_process(copy_job):
    stopped = copy_job / "stopped"
    validated = {**metrics(stopped / "version_0", "val/loss"), **metrics(stopped / "version_1", "val/loss")}
    assert len(validated) == 2  # at both epoch ends; save_top_k=-1 kept both checkpoints
    ddp_val = only(metrics(stopped / "version_2", "val/loss"))
    assert ddp_val == pytest.approx(min(validated.values()), rel=1e-6)  # `best` is the best of them

    best_step = min(validated, key=validated.get) + 1  # metrics count steps from 0, checkpoints from 1
    best = next(checkpoint_dir(stopped).glob(f"best-*-step={best_step}.ckpt"))
    single = copy_job / "single_eval"
    for command, ckpt in (("validate", best), ("test", checkpoint_dir(stopped) / "last.ckpt"),
                          ("predict", checkpoint_dir(stopped) / "last.ckpt")):
        code, _, err = run_cli([command, *copy_args(single, processes=ONE_PROCESS), "--ckpt_path", str(ckpt)])
        assert code == 0, err[-3000:]
    for key, version in (("val/loss", 0), ("val/accuracy", 0), ("test/loss", 1), ("test/accuracy", 1)):
        got = only(metrics(stopped / f"version_{version + 2}", key))
        assert got == pytest.approx(only(metrics(single / f"version_{version}", key)), rel=1e-5), key

    # each process predicted its own share; together they are the one process's predictions
    def rows(files):
        batches = [b for f in files for b in torch.load(f, map_location="cpu", weights_only=False)]
        return sorted(zip(map(tuple, torch.cat([b["tokens"] for b in batches]).tolist()),
                          map(tuple, torch.cat([b["predicted"] for b in batches]).tolist())))
    shares = [stopped / "version_4" / f"predictions_rank{r}.pt" for r in (0, 1)]
    assert len(rows(shares[:1])) == len(rows(shares[1:])) == 4
    assert rows(shares) == rows([single / "version_2" / "predictions.pt"])


def test_other_process_count_continues_from_an_epoch_end_and_is_refused_mid_epoch(copy_job):
    stopped, straight = copy_job / "stopped", copy_job / "straight"
    # last.ckpt is at step 8, the middle of the third epoch: the shares of that epoch differ
    code, _, err = run_cli(["fit", *copy_args(stopped, "--trainer.max_steps=10", processes=ONE_PROCESS),
                            "--ckpt_path", "last"])
    assert code == 2
    refusal = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and "2 process(es)" in refusal[0] and "this run has 1" in refusal[0], err[-3000:]

    # the checkpoint of the second epoch's end: one process at twice the batch goes on like the two
    epoch_end = checkpoint_dir(stopped) / f"best-epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    continued = copy_job / "continued"
    code, _, err = run_cli(["fit", *copy_args(continued, f"--trainer.max_steps={TOTAL_STEPS}", processes=ONE_PROCESS),
                            "--ckpt_path", str(epoch_end)])
    assert code == 0, err[-3000:]
    got, want = metrics(continued / "version_0", "train/loss"), metrics(straight / "version_0", "train/loss")
    # the last two updates, in order (Lightning logs the updates of a run restarted at an epoch's
    # end one step later than an uninterrupted run does: their step labels are not compared)
    assert len(got) == 2
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in (6, 7)], rel=1e-5)


def test_bf16_mixed_two_processes(copy_job):
    bf16, straight = copy_job / "bf16", copy_job / "straight"
    assert_same_weights(weights(bf16 / "weights_rank1.pt"), weights(bf16 / "weights_rank0.pt"))
    got, fp32 = metrics(bf16 / "version_0", "train/loss"), metrics(straight / "version_0", "train/loss")
    assert sorted(got) == list(range(STOP_AT))
    # bf16 rounds activations to 8 bits of mantissa: near the fp32 run, not equal to it
    assert [got[s] for s in range(STOP_AT)] == pytest.approx([fp32[s] for s in range(STOP_AT)], rel=3e-2)
    assert [got[s] for s in range(STOP_AT)] != [fp32[s] for s in range(STOP_AT)]


def test_resume_after_kill_9_of_both_processes_continues_the_uninterrupted_run(copy_job):
    killed, straight = copy_job / "killed", copy_job / "straight"
    assert_resumed_like_straight(straight, killed / "version_1", range(STOP_AT, TOTAL_STEPS))
    assert_same_weights(weights(killed / "weights_rank0.pt"), weights(straight / "weights_rank0.pt"))


# ---------------------------------------------------------------- context parallelism through the CLI
#
# Why equal: the two processes form one context group, so the data module gives both the whole
# batch (data.sampling.process_share) and each its half of the positions; the loss is summed over
# each half's copied tokens and divided by the count of the whole batch (Task.global_mean), and DDP
# averages the two processes' gradients. What differs is the order of float32 sums, hence the
# tolerances.

CONTEXT_STEPS = "--trainer.max_steps=4"  # an epoch of 3 batches, its validation, and one update more


def context_args(root: Path) -> list[str]:
    return tiny_copy_args(root, "linear", "--model.context_parallel=2", *TWO_NODES)


def context_parallel_plan(out: Path) -> list[list[str]]:
    """The copy run stopped after 2 updates, mid-epoch, resumed from its checkpoint to 4 (version_0,
    version_1), then test and predict; MNIST (784 sub-pixels, 392 on each process) fit and validate."""
    split, mnist = out / "context_split", tiny_mnist_args(out / "context_mnist", "--model.context_parallel=2", *TWO_NODES)
    return [["fit", *context_args(split), "--trainer.max_steps=2"],
            ["fit", *context_args(split), CONTEXT_STEPS, "--ckpt_path", "last", save_weights(split / "weights_")],
            ["test", *context_args(split), CONTEXT_STEPS, "--ckpt_path", "last"],
            ["predict", *context_args(split), CONTEXT_STEPS, "--ckpt_path", "last"],
            ["fit", *mnist, "--trainer.max_steps=2"], ["validate", *mnist, "--ckpt_path", "last"]]


def printed_by(log: str, command: str, root: str) -> list[str]:
    """The lines one command of a job's plan printed: those before ddp_driver's line after it."""
    lines, start = log.splitlines(), 0
    for i, line in enumerate(lines):
        if line.startswith("ddp_driver: "):
            if line.endswith(f": {command} {root}"):
                return lines[start:i]
            start = i + 1
    raise AssertionError(f"no {command} of {root} in the log")


def test_two_context_processes_fit_test_and_predict_as_one_process(copy_job):
    """The same training losses at every step as the uninterrupted one process, the same validation
    loss, the same weights after, the same test loss from the checkpoint written, and the same copy
    accuracy of ``predict``; MNIST's training and validation bits/dim."""
    split, one = copy_job / "context_split", copy_job / "context_one"
    mnist_split, mnist_one = copy_job / "context_mnist", copy_job / "context_mnist_one"
    printed = []
    for command in (["fit", *tiny_copy_args(one, "linear", CONTEXT_STEPS), save_weights(one / "weights_")],
                    ["test", *tiny_copy_args(one, "linear", CONTEXT_STEPS), "--ckpt_path", "last"],
                    ["predict", *tiny_copy_args(one, "linear", CONTEXT_STEPS), "--ckpt_path", "last"]):
        code, out, err = run_cli(command)
        assert code == 0, err[-3000:]
        printed.append(out)
    for command in (["fit", *tiny_mnist_args(mnist_one), "--trainer.max_steps=2"],
                    ["validate", *tiny_mnist_args(mnist_one), "--ckpt_path", "last"]):
        code, out, err = run_cli(command)
        assert code == 0, err[-3000:]
    for stage, key in ((0, "train/bits_per_dim"), (0, "val/bits_per_dim"), (1, "val/bits_per_dim")):
        got, want = (metrics(root / f"version_{stage}", key) for root in (mnist_split, mnist_one))
        assert sorted(got) == sorted(want) and want, (key, got, want)
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step)
    # the stopped and resumed run's losses are the uninterrupted one process's
    losses = {**metrics(split / "version_0", "train/loss"), **metrics(split / "version_1", "train/loss")}
    want = metrics(one / "version_0", "train/loss")
    assert sorted(losses) == sorted(want) and len(want) == 4, (losses, want)
    for step, loss in want.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
    assert only(metrics(split / "version_1", "val/loss")) == pytest.approx(only(metrics(one / "version_0", "val/loss")),
                                                                          rel=1e-5)
    # the checkpoint written under context parallelism tests as the one process's
    assert only(metrics(split / "version_2", "test/loss")) == pytest.approx(
        only(metrics(one / "version_1", "test/loss")), rel=1e-5)
    # predict runs whole sequences on both processes (the RNN step); one of them counts each batch
    accuracy = [line for line in printed_by((copy_job / "process0.log").read_text(), "predict", "context_split")
                if line.startswith("copy accuracy")]
    assert accuracy and accuracy == [line for line in printed[2].splitlines() if line.startswith("copy accuracy")]
    rank0, rank1 = weights(split / "weights_rank0.pt"), weights(split / "weights_rank1.pt")
    assert_same_weights(rank1, rank0)  # one model: DDP summed the halves' gradients
    assert_same_weights(rank0, weights(one / "weights_rank0.pt"), atol=1e-5)


def start_and_kill_9(root: Path, log_path: Path) -> None:
    """``python cli.py fit ... --trainer.devices 2 --trainer.strategy ddp`` (the documented line:
    Lightning starts the second process) into ``root``, killed with SIGKILL, both processes at
    once, right after the checkpoint of step ``STOP_AT``."""
    devices = ("--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=2")
    pause = json.dumps({"class_path": "test_resume.PauseAfterStep", "init_args": {"step": STOP_AT}})
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "cli.py"), "fit", *copy_args(root, *KILLED, *devices),
                                 f"--trainer.callbacks+={pause}"], cwd=REPO, env=job_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_checkpoint(checkpoint_dir(root) / "last.ckpt", STOP_AT, proc, timeout=300)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # every process of the job: Lightning's second is in the group
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log_path.read_text()[-3000:]


def wait_for_checkpoint(path: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    """Returns once ``path`` loads and holds global step ``step``; fails if ``proc`` ends or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if torch.load(path, map_location="cpu", weights_only=False)["global_step"] == step:
                return
        except Exception:
            pass  # not there yet, or being written
        assert proc.poll() is None, f"training ended with {proc.returncode} before the step-{step} checkpoint"
        time.sleep(0.05)
    pytest.fail(f"no step-{step} checkpoint in {path} within {timeout} s")
