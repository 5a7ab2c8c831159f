"""``cli.py export`` on tiny trained runs through the real CLI: the README's and docs/cli.md's export
commands as shown, the exported model generating the checkpoint's images, an exported folder as
``--ckpt_path`` and ``--model.init_from``, a converted model, and the refusals (one line, exit 2)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import REPO, read_metrics, run_cli, tiny_copy_args, tiny_mnist_args
from test_readme import cli_commands

import linformer_lab as ll
from linformer_lab.tasks.copy_task import CopyTask
from linformer_lab.tasks.image_generation import ImageGenerationTask

pytestmark = pytest.mark.slow

#: Appended to the docs' commands: one image to predict, a few to test, one update to fit.
SMALL = {
    "predict": ["--model.predict_num_samples", "1", "--data.batch_size", "1"],
    "test": ["--data.limit_test", "8"],
    "fit": ["--trainer.max_steps", "1"],
    "export": [],
}


def section(path, heading: str) -> str:
    text = (REPO / path).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def checkpoint_task(path, cls=ImageGenerationTask):
    """The model a checkpoint holds, built from its hyper-parameters (as the CLI's own runs are)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    task = cls(**{k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")})
    task.load_state_dict(ckpt["state_dict"])
    return task.eval()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding ``logs/mnist_linear/version_0``: a tiny MNIST fit of 4 updates, validated at 2 and 4."""
    cwd = tmp_path_factory.mktemp("export")
    code, _, err = run_cli(["fit", *tiny_mnist_args(cwd / "logs" / "mnist_linear", "--trainer.max_steps=4")], cwd=cwd)
    assert code == 0, err[-3000:]
    return cwd


def test_the_docs_export_commands_run_as_shown(workdir):
    run = workdir / "logs" / "mnist_linear" / "version_0"
    readme = section("README.md", "## Export and load a trained model")
    commands = cli_commands(readme) + cli_commands(section("docs/cli.md", "## Export and load a trained model"))
    assert [c[0] for c in commands] == ["export", "predict", "export", "export", "test", "fit"], commands
    outputs = []
    for command in commands:
        code, out, err = run_cli([*command, *SMALL[command[0]]], cwd=workdir)
        assert code == 0, f"{' '.join(command)}: {err[-3000:]}"
        outputs.append(out)

    # README: the run's best checkpoint in version_0/export, predicted from; then its Python lines
    best = next((run / "checkpoints").glob("best-*.ckpt"))
    assert f"exported logs/mnist_linear/version_0/checkpoints/{best.name}" in outputs[0]
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["class_path"] == "linformer_lab.tasks.image_generation.ImageGenerationTask"
    assert config["init_args"]["d_model"] == 16 and config["init_args"]["attention"]["feature_map"] == "elu"
    assert "--ckpt_path logs/mnist_linear/version_0/export: an exported model; its weights are loaded" in outputs[1]
    assert list((run.parent / "version_1" / "predictions" / "completions").glob("*.png"))
    code_block = next(block for block in readme.split("```python\n")[1:]).split("```")[0]
    namespace: dict = {}
    os.chdir(workdir)
    try:
        exec(compile(code_block, "README.md (Export and load)", "exec"), namespace)
    finally:
        os.chdir(REPO)
    assert namespace["images"].shape == (4, 1, 28, 28) and namespace["images"].dtype == torch.uint8
    assert not namespace["task"].training

    # docs/cli.md: the run's best again, the newest run's last.ckpt, tested, then a fit from its weights
    assert f"exported logs/mnist_linear/version_0/checkpoints/{best.name}" in outputs[2]
    exported = ll.from_pretrained(workdir / "mnist_last")
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(value, last[name]) for name, value in exported.state_dict().items())
    tested = [row for version in sorted(run.parent.glob("version_*")) for row in read_metrics(version)
              if "test/bits_per_dim" in row]
    assert len(tested) == 1 and 0 < tested[0]["test/bits_per_dim"] < 9
    assert "init_from mnist_last: attention linear/elu -> linear/elu" in outputs[5]
    assert "dropped  (none)" in outputs[5]


def test_the_exported_model_generates_the_checkpoints_images(workdir, tmp_path):
    run = workdir / "logs" / "mnist_linear" / "version_0"
    for which, pattern in (("best", "best-*.ckpt"), ("last", "last.ckpt")):
        code, out, err = run_cli(["export", str(run), "--ckpt_path", which, "--output", str(tmp_path / which)])
        assert code == 0, err
        from_checkpoint = checkpoint_task(next((run / "checkpoints").glob(pattern)))
        loaded = ImageGenerationTask.from_pretrained(tmp_path / which)
        prompt = torch.randint(0, 256, (2, 1, 14, 28), dtype=torch.uint8)
        images = []
        for task in (from_checkpoint, loaded):
            torch.manual_seed(3)
            images.append(torch.cat([task.model.generate(2), task.model.generate(2, prefix=prompt)]))
        assert torch.equal(images[0], images[1]), which
    # a checkpoint file exports as it is, into its run's export/ when no --output is given
    code, out, err = run_cli(["export", str(run / "checkpoints" / "last.ckpt")])
    assert code == 0 and (run / "export" / "model.safetensors").is_file(), err


def test_the_help_names_export():
    code, out, _ = run_cli(["--help"])
    assert code == 0 and "cli.py export RUN_FOLDER|CHECKPOINT [--ckpt_path best|last] [--output DIR]" in out
    code, out, _ = run_cli(["export", "--help"])
    assert code == 0 and "--ckpt_path {best,last}" in out and "--output OUTPUT" in out


def test_refusals_are_one_line(workdir, tmp_path):
    run = workdir / "logs" / "mnist_linear" / "version_0"
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}}, bare)
    (tmp_path / "empty").mkdir()
    (tmp_path / "resumed").mkdir()  # a resumed fit's version_N: its config and logs, the checkpoints elsewhere
    (tmp_path / "resumed" / "config.yaml").write_text("ckpt_path: last\n")
    cases = {
        ("export", str(tmp_path / "resumed")): "holds no checkpoints/last.ckpt of a run (a resumed fit writes into "
                                               "the checkpoints/ of the run it resumes, an evaluation writes none)",
        ("export", str(tmp_path / "nowhere")): "nowhere does not exist; pass a run folder",
        ("export", str(tmp_path / "empty")): "holds no checkpoints/last.ckpt of a run",
        ("export", str(run), "--output", str(run)): "holds other files (checkpoints, ",
        ("export", str(bare)): "does not name its task class (_class_path, which cli.py fit saves)",
        ("export", str(run), "--ckpt_path", "first"): "invalid choice: 'first' (choose from 'best', 'last')",
        ("exprot", str(run)): "unknown subcommand 'exprot'; did you mean export? (choices: fit, validate, test, predict, "
                              "export, plot, plugins)",
    }
    for command, message in cases.items():
        code, _, err = run_cli(list(command))
        assert code == 2 and message in one_error_line(err), (command, err)

    code, _, err = run_cli(["export", str(run), "--output", str(tmp_path / "export")])
    assert code == 0, err
    saved = str(run / "config.yaml")
    crafted = tmp_path / "crafted"
    shutil.copytree(tmp_path / "export", crafted)
    config = json.loads((crafted / "config.json").read_text())
    (crafted / "config.json").write_text(json.dumps({**config, "class_path": "os.system"}))
    cases = {
        ("fit", "--config", saved, "--ckpt_path", str(tmp_path / "export")):
            "is an exported model: weights only, no optimizer state or step to resume; start a new run from its "
            f"weights with --model.init_from {tmp_path / 'export'}",
        ("test", "--config", "mnist_linear.yaml", "--ckpt_path", str(tmp_path / "export")):
            "does not fit the configured ImageGenerationTask: d_ff: checkpoint 32, configuration 1024",
        ("test", "--config", saved, "--ckpt_path", str(crafted)):
            "names the class 'os.system', which is not a registered task (valid: linformer_lab.tasks.copy_task.CopyTask",
    }
    for command, message in cases.items():
        code, _, err = run_cli(list(command), cwd=workdir)
        assert code == 2 and message in one_error_line(err), (command, err)


def test_a_converted_model_exports_and_is_evaluated_without_its_source(tmp_path):
    """A softmax copy run converted to linear/t2r (``--model.init_from``) exports its best checkpoint
    as the result; with the softmax run deleted, the folder loads and ``test`` evaluates it."""
    teacher_root, root = tmp_path / "softmax", tmp_path / "t2r"
    code, _, err = run_cli(["fit", *tiny_copy_args(teacher_root, "softmax", "--trainer.max_steps=3")])
    assert code == 0, err
    teacher = teacher_root / "version_0" / "checkpoints" / "last.ckpt"
    converted = ["--model.attention.feature_map=t2r", f"--model.init_from={teacher}"]
    code, _, err = run_cli(["fit", *tiny_copy_args(root, "linear", *converted, "--trainer.max_steps=3")])
    assert code == 0, err
    shutil.rmtree(teacher_root)

    code, out, err = run_cli(["export", str(root)])
    assert code == 0 and "(CopyTask, attention linear/t2r, " in out, err
    folder = root / "version_0" / "export"
    init_args = json.loads((folder / "config.json").read_text())["init_args"]
    assert init_args["init_from"] is None and init_args["attention"]["feature_map"] == "t2r"
    loaded = CopyTask.from_pretrained(folder)
    from_checkpoint = checkpoint_task(next((root / "version_0" / "checkpoints").glob("best-*.ckpt")), CopyTask)
    tokens = torch.randint(1, 11, (2, 13))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), from_checkpoint(tokens))
    assert any(".feature_map." in name for name in loaded.state_dict())

    code, out, err = run_cli(["test", *tiny_copy_args(tmp_path / "test", "linear", *converted, f"--ckpt_path={folder}")])
    assert code == 0, err
    tested = [row for row in read_metrics(tmp_path / "test" / "version_0") if "test/loss" in row]
    assert len(tested) == 1 and tested[0]["test/loss"] > 0
