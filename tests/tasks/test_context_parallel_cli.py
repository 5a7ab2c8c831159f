"""``--model.context_parallel 2`` through ``cli.py``: two gloo processes (two torchrun "nodes" of
one process each, on 127.0.0.1) split every copy sequence (and every MNIST image's sub-pixels) in
two and train, validate and test as one process given the same batches. The copy run stops after
2 updates, mid-epoch, and resumes from its checkpoint to 4: the same training losses at every step
as the uninterrupted one process, the same validation loss, the same weights after, the same test
loss from the checkpoint written, and the same copy accuracy of ``predict``.

Why equal: the two processes form one context group, so the data module gives both the whole
batch (data.sampling.process_share) and each its half of the positions; the loss is summed over
each half's copied tokens and divided by the count of the whole batch (Task.global_mean), and DDP
averages the two processes' gradients. What differs is the order of float32 sums, hence the
tolerances. The one-process runs are in this process.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import run_cli, tiny_copy_args, tiny_mnist_args
from ddp_driver import assert_same_weights, free_port, metrics, only, run_job, save_weights, torchrun, weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

TWO_NODES = ("--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=2")
STEPS = "--trainer.max_steps=4"  # an epoch of 3 batches, its validation, and one update more


def test_two_context_processes_fit_test_and_predict_as_one_process(tmp_path):
    split, one = tmp_path / "split", tmp_path / "one"
    args = tiny_copy_args(split, "linear", "--model.context_parallel=2", *TWO_NODES)
    # MNIST in the same job (one start of the two processes): 784 sub-pixels, 392 on each
    mnist_split, mnist_one = tmp_path / "mnist_split", tmp_path / "mnist_one"
    mnist = tiny_mnist_args(mnist_split, "--model.context_parallel=2", *TWO_NODES)
    # stopped after 2 updates, mid-epoch, and resumed to 4 (version_0, version_1), then test and predict
    plan = [["fit", *args, "--trainer.max_steps=2"],
            ["fit", *args, STEPS, "--ckpt_path", "last", save_weights(split / "weights_")],
            ["test", *args, STEPS, "--ckpt_path", "last"], ["predict", *args, STEPS, "--ckpt_path", "last"],
            ["fit", *mnist, "--trainer.max_steps=2"], ["validate", *mnist, "--ckpt_path", "last"]]
    port = free_port()
    nodes = [(torchrun("--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}", "--master_addr=127.0.0.1",
                       f"--master_port={port}"), {}) for rank in (0, 1)]
    run_job(plan, tmp_path / "job", nodes)
    printed = []
    for command in (["fit", *tiny_copy_args(one, "linear", STEPS), save_weights(one / "weights_")],
                    ["test", *tiny_copy_args(one, "linear", STEPS), "--ckpt_path", "last"],
                    ["predict", *tiny_copy_args(one, "linear", STEPS), "--ckpt_path", "last"]):
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
    accuracy = [line for line in (tmp_path / "job" / "process0.log").read_text().splitlines()
                if line.startswith("copy accuracy")]
    assert accuracy and accuracy == [line for line in printed[2].splitlines() if line.startswith("copy accuracy")]
    rank0, rank1 = weights(split / "weights_rank0.pt"), weights(split / "weights_rank1.pt")
    assert_same_weights(rank1, rank0)  # one model: DDP summed the halves' gradients
    assert_same_weights(rank0, weights(one / "weights_rank0.pt"), atol=1e-5)
