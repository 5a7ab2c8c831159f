"""Checkpoints load without running code: a ``.ckpt`` holding a pickle payload is refused with one
line and exit code 2 through the real CLI (given as a file or found by ``--ckpt_path last``), and
the payload never runs; what the tasks' own runs write loads with ``weights_only=True``. Each
kind of mismatch has its own error class, and each is still one line and exit code 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_dir, run_cli, tiny_copy_args

from linformer_lab.tasks.checkpoint_files import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    OptimizerStateMismatchError,
    OtherAttentionCheckpointError,
    OtherShapeCheckpointError,
    OtherTaskCheckpointError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
    check_checkpoint,
    load_checkpoint_header,
)


class Payload:
    """Unpickling this creates ``marker``: the stand-in for any code a crafted file could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted_checkpoint(path: Path, marker: Path, real: Path | None = None) -> Path:
    """A checkpoint with the payload among its hyper-parameters: a real one's contents when
    ``real`` is given (so only the payload can make it fail), else a bare Lightning-like dict."""
    ckpt = torch.load(real, map_location="cpu", weights_only=True) if real else {"state_dict": {}, "hyper_parameters": {}}
    ckpt["hyper_parameters"]["note"] = Payload(marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    assert not marker.exists()
    return path


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny copy-task fit (linear attention): its root, with version_0/checkpoints/last.ckpt."""
    root = tmp_path_factory.mktemp("trained")
    code, _, err = run_cli(["fit", *tiny_copy_args(root), "--trainer.max_steps=3"])
    assert code == 0, err[-3000:]
    return root


def test_a_payload_given_as_a_file_is_refused_and_never_runs(trained, tmp_path):
    marker = tmp_path / "payload-ran"
    bad = crafted_checkpoint(tmp_path / "shared.ckpt", marker, real=checkpoint_dir(trained) / "last.ckpt")
    code, out, err = run_cli(["validate", *tiny_copy_args(tmp_path / "runs"), "--ckpt_path", str(bad)])
    line = one_error_line(err)
    assert code == 2 and "refused checkpoint" in line and str(bad) in line and "open" in line
    assert not marker.exists(), "the checkpoint's payload ran"


def test_a_payload_found_by_ckpt_path_last_is_refused_and_never_runs(trained, tmp_path):
    """The newest last.ckpt under the root is the crafted one: refused, not skipped for an older run."""
    root = tmp_path / "runs"
    shutil.copytree(trained / "version_0", root / "version_0")
    marker = tmp_path / "payload-ran"
    crafted_checkpoint(root / "version_1" / "checkpoints" / "last.ckpt", marker, real=checkpoint_dir(trained) / "last.ckpt")
    for command in ("validate", "fit"):
        code, _, err = run_cli([command, *tiny_copy_args(root), "--ckpt_path", "last", "--trainer.max_steps=4"])
        assert code == 2 and "refused checkpoint" in one_error_line(err), err
    assert not marker.exists(), "the checkpoint's payload ran"


def test_the_header_loader_refuses_a_payload(tmp_path):
    marker = tmp_path / "payload-ran"
    bad = crafted_checkpoint(tmp_path / "bare.ckpt", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"\(io\.open\)") as caught:
        load_checkpoint_header(str(bad))
    assert isinstance(caught.value, UnreadableCheckpointError) and "\n" not in str(caught.value)
    assert not marker.exists()


def test_a_copy_task_checkpoint_loads_with_weights_only(trained):
    """Everything Lightning and our callbacks write (loops, optimizer, LastCheckpoint's and the
    best-model callback's state, hparams as plain data) is tensors and plain data."""
    ckpt = torch.load(checkpoint_dir(trained) / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["optimizer_states"] and ckpt["loops"]["fit_loop"]
    keys = list(ckpt["callbacks"])
    assert any(k.startswith("LastCheckpoint") for k in keys) and any(k.startswith("ModelCheckpoint") for k in keys), keys
    assert isinstance(ckpt["hyper_parameters"]["attention"], dict)


@pytest.mark.slow
def test_image_and_speech_checkpoints_load_with_weights_only(tmp_path):
    """The other two tasks at toy size through the real CLI (MNIST with the image callback, the
    synthetic speech corpus), each resumable from what weights_only=True reads."""
    image = ["fit", "--config", "mnist_linear.yaml", "--model.n_layers=1", "--model.d_model=16", "--model.n_heads=2",
             "--model.d_ff=32", "--model.num_mixtures=2", "--data.batch_size=2", "--data.limit_train=4",
             "--data.limit_val=2", "--data.limit_test=2", "--trainer.max_steps=2", "--trainer.precision=32-true",
             "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--trainer.num_sanity_val_steps=0",
             f"--trainer.default_root_dir={tmp_path / 'image'}"]
    speech = ["fit", "--config", "speech_cpu_linear.yaml", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
              f"--trainer.default_root_dir={tmp_path / 'speech'}", f"--data.root={tmp_path / 'corpus'}",
              "--data.hours=0.01", "--data.batch_size=2", "--data.progress=false", "--model.d_model=12",
              "--model.n_heads=2", "--model.n_layers=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=1"]
    for name, args in (("image", image), ("speech", speech)):
        code, _, err = run_cli(args)
        assert code == 0, err[-3000:]
        ckpt = torch.load(checkpoint_dir(tmp_path / name) / "last.ckpt", map_location="cpu", weights_only=True)
        assert ckpt["global_step"] == 2 and ckpt["optimizer_states"], name


# ---------------------------------------------------------------------- one error class per cause


def test_each_mismatch_has_its_own_class(trained, tmp_path):
    from linformer_lab.tasks.copy_task import CopyTask
    from linformer_lab.tasks.image_generation import ImageGenerationTask

    last = str(checkpoint_dir(trained) / "last.ckpt")
    shape = dict(vocab_size=12, sequence_length=13, n_layers=1, n_heads=2, dropout=0.0)
    check_checkpoint(last, CopyTask(attention="linear", d_model=16, **shape))  # the same model: no error
    cases = [
        (CopyTask(attention="softmax", d_model=16, **shape), OtherAttentionCheckpointError, "attention.backend"),
        (CopyTask(attention="linear", d_model=32, **shape), OtherShapeCheckpointError, "d_model"),
        (ImageGenerationTask(n_layers=1, d_model=16, n_heads=2, d_ff=32, num_mixtures=2), OtherTaskCheckpointError,
         "another task"),
    ]
    for model, error, said in cases:
        with pytest.raises(error, match=said) as caught:
            check_checkpoint(last, model)
        assert isinstance(caught.value, CheckpointMismatchError) and "\n" not in str(caught.value)
        assert "Evaluate with the configuration it was trained with" in str(caught.value)
    # a fit resuming from it is told to resume, not to evaluate, with the run's saved config
    with pytest.raises(OtherShapeCheckpointError, match="Resume with the configuration it was trained with"):
        check_checkpoint(last, cases[1][0], resuming=True)
    corrupt = tmp_path / "half.ckpt"
    corrupt.write_bytes(Path(last).read_bytes()[:2000])
    with pytest.raises(UnreadableCheckpointError, match="truncated, corrupt"):
        load_checkpoint_header(str(corrupt))


@pytest.mark.parametrize("extra, error", [
    (["--model.attention.backend=softmax"], "attention.backend: checkpoint 'linear', configuration 'softmax'"),
    (["--model.d_model=32"], "d_model: checkpoint 16, configuration 32"),
])
def test_each_mismatch_is_one_line_and_exit_2_through_the_cli(trained, tmp_path, extra, error):
    last = checkpoint_dir(trained) / "last.ckpt"
    code, _, err = run_cli(["validate", *tiny_copy_args(tmp_path), *extra, "--ckpt_path", str(last)])
    assert code == 2 and error in one_error_line(err)


def test_nothing_to_resume_is_its_own_class(tmp_path):
    from linformer_lab.cli.checkpoints import resolve_checkpoint_path
    from linformer_lab.tasks.copy_task import CopyTask

    with pytest.raises(CheckpointNotFoundError, match="no checkpoint found"):
        resolve_checkpoint_path("best", CopyTask(), tmp_path)


def test_a_checkpoint_file_that_is_not_there_is_not_found_on_every_road(tmp_path):
    """A missing file is a CheckpointNotFoundError (not an unreadable one) whether the header is read,
    the file checked against a model or named with --ckpt_path / --model.init_from."""
    from linformer_lab.cli.checkpoints import resolve_checkpoint_path
    from linformer_lab.tasks.copy_task import CopyTask

    missing = str(tmp_path / "gone.ckpt")
    model = CopyTask(attention="linear", d_model=16, vocab_size=12, sequence_length=13, n_layers=1, n_heads=2)
    for read in (lambda: load_checkpoint_header(missing), lambda: check_checkpoint(missing, model),
                 lambda: resolve_checkpoint_path(missing, model, tmp_path)):
        with pytest.raises(CheckpointNotFoundError, match=f"checkpoint {missing} does not exist") as caught:
            read()
        assert not isinstance(caught.value, UnreadableCheckpointError)
    for flag, error in (("--ckpt_path", f"checkpoint {missing} does not exist."),
                        ("--model.init_from", f"--model.init_from {missing}: no such file; init_from names")):
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "run"), "--trainer.max_steps=1", flag, missing])
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {error}"), err


def test_an_optimizer_state_saved_in_another_parameter_order_is_refused_with_the_way_out(trained, tmp_path):
    """The optimizer's saved moments are keyed by parameter position: a checkpoint whose order no
    longer matches the model's (modules registered in another order by an older version) would
    apply each moment to another weight. Refused before the run starts, naming --model.init_from."""
    from linformer_lab.tasks.copy_task import CopyTask

    ckpt = torch.load(checkpoint_dir(trained) / "last.ckpt", map_location="cpu", weights_only=True)
    state = ckpt["optimizer_states"][0]["state"]
    model = CopyTask(attention="linear", d_model=16, vocab_size=12, sequence_length=13, n_layers=1, n_heads=2, dropout=0.0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    i, j = next((i, j) for i in range(len(shapes)) for j in range(i) if shapes[i] != shapes[j])
    state[i], state[j] = state[j], state[i]
    swapped = tmp_path / "swapped.ckpt"
    torch.save(ckpt, swapped)
    with pytest.raises(OptimizerStateMismatchError, match=f"position {j}"):
        check_checkpoint(str(swapped), model)
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "run"), "--trainer.max_steps=4", "--ckpt_path", str(swapped)])
    assert code == 2 and f"--model.init_from {swapped}" in one_error_line(err)


def test_a_checkpoint_read_rebuilt_and_checked_from_python(tmp_path):
    """The three calls of ``tasks/checkpoint_files.py``'s docstring: read (weights only), rebuild the
    task from its hyper-parameters, check and load: the weights come back bit for bit."""
    from linformer_lab.tasks.checkpoint_files import checkpoint_task, read_checkpoint
    from linformer_lab.tasks.copy_task import CopyTask

    torch.manual_seed(0)
    task = CopyTask(attention="linear", d_model=16, n_heads=2, n_layers=1)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": task.state_dict(),
                "hyper_parameters": {**task.hparams, "_class_path": "linformer_lab.tasks.copy_task.CopyTask"}}, path)
    ckpt = read_checkpoint(str(path))
    rebuilt = checkpoint_task(ckpt, path)
    rebuilt.load_state_dict(check_checkpoint(str(path), rebuilt, ckpt)["state_dict"])
    assert type(rebuilt) is CopyTask and rebuilt.state_dict().keys() == task.state_dict().keys()
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in task.state_dict().items())
    rebuilt.hparams["d_model"] = 32  # another model: refused with its reason
    with pytest.raises(CheckpointMismatchError, match="d_model: checkpoint 16, configuration 32"):
        check_checkpoint(str(path), rebuilt, ckpt)
