"""``--model.init_from`` and ``--model.distill_steps`` through the real CLI: a tiny softmax copy run
converted to linear attention with elu, t2r and hedgehog (distilled first), then evaluated from its
own checkpoint; the refusals, each one line and exit code 2."""

from __future__ import annotations

import pytest
import torch
from conftest import checkpoint_dir, read_metrics, run_cli, tiny_copy_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def softmax_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("softmax")
    code, _, err = run_cli(["fit", *tiny_copy_args(root, "softmax", "--trainer.max_steps=3")])
    assert code == 0, err
    return checkpoint_dir(root) / "last.ckpt"


@pytest.mark.parametrize("feature_map, distill", [("elu", 0), ("t2r", 0), ("hedgehog", 4)])
def test_a_softmax_run_converts_to_linear_attention(softmax_checkpoint, tmp_path, feature_map, distill):
    args = tiny_copy_args(tmp_path, "linear", f"--model.attention.feature_map={feature_map}",
                          f"--model.init_from={softmax_checkpoint}", f"--model.distill_steps={distill}",
                          "--trainer.max_steps=2")
    code, out, err = run_cli(["fit", *args])
    assert code == 0, err
    assert f"init_from {softmax_checkpoint}: attention softmax -> linear/{feature_map}" in out
    assert "loaded   transformer.layers.*.attention.qkv.weight" in out
    assert ("new      transformer.layers.*.attention.attention.feature_map." in out) == (feature_map != "elu")
    assert "dropped  (none)" in out
    rows = read_metrics(tmp_path / "version_0")
    distilled = [r["distill/attention_loss"] for r in rows if "distill/attention_loss" in r]
    assert len(distilled) == distill and all(v > 0 for v in distilled)
    assert (f"attention distillation: update {distill} of {distill}" in out) == bool(distill)
    # the converted model trained on: its checkpoint holds the softmax model's embedding after two updates
    converted = torch.load(checkpoint_dir(tmp_path) / "last.ckpt", weights_only=True)
    original = torch.load(softmax_checkpoint, weights_only=True)
    assert converted["global_step"] == 2
    assert converted["hyper_parameters"]["attention"]["feature_map"] == feature_map
    assert converted["state_dict"]["head.weight"].shape == original["state_dict"]["head.weight"].shape
    # evaluated from its own checkpoint, with no init_from in the configuration
    code, out, err = run_cli(["test", *tiny_copy_args(tmp_path / "test", "linear", f"--model.attention.feature_map={feature_map}",
                                                      f"--ckpt_path={checkpoint_dir(tmp_path) / 'last.ckpt'}")])
    assert code == 0, err


def test_init_from_refusals_are_one_line(softmax_checkpoint, tmp_path):
    cases = {
        "--model.d_model=32": "differs from the configured one beyond its attention (d_model: checkpoint 16, configuration 32)",
        "--model.distill_steps=2": "'elu' has no weights to train",
    }
    for extra, message in cases.items():
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / extra[8:16], "linear",
                                                       f"--model.init_from={softmax_checkpoint}", extra)])
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], err
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "garbage", "linear", f"--model.init_from={garbage}")])
    assert code == 2 and f"error: --model.init_from {garbage}: cannot read checkpoint {garbage}" in err, err
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "nofile", "linear", "--model.distill_steps=2")])
    assert code == 2 and "distill_steps=2 needs init_from" in err, err


def _copy_config_at_toy_size(config: str, root, *extra: str) -> list[str]:
    """``--config CONFIG`` (the conversion comparison's copy configs) shrunk to seconds: the docs'
    commands as they run, with the model, data and budget overridden."""
    return ["--config", config, "--model.d_model=16", "--model.n_heads=2", "--model.n_layers=1",
            "--data.min_length=1", "--data.max_length=6", "--data.batch_size=4", "--data.train_batches_per_epoch=4",
            "--data.val_batches=1", "--data.test_batches=1", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
            "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.num_sanity_val_steps=0",
            f"--trainer.default_root_dir={root}", *extra]


@pytest.fixture(scope="module")
def copy_teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy_cpu_softmax")
    code, _, err = run_cli(["fit", *_copy_config_at_toy_size("copy_cpu_softmax.yaml", root)])
    assert code == 0, err
    return checkpoint_dir(root) / "last.ckpt"


@pytest.mark.parametrize("feature_map", ["elu", "t2r", "hedgehog"])
def test_the_copy_conversion_configs_fit_and_test_as_the_report_runs_them(copy_teacher, tmp_path, feature_map):
    """``cli.py fit --config copy_convert_M.yaml`` from a softmax run of ``copy_cpu_softmax.yaml``,
    then ``cli.py test --ckpt_path best`` with the same config and root (benchmarks/paper/conversion.py's
    commands): the config's map is swapped in, the shared weights load, hedgehog distils first."""
    config = f"copy_convert_{feature_map}.yaml"
    distill = 2 if feature_map == "hedgehog" else 0
    args = _copy_config_at_toy_size(config, tmp_path, f"--model.init_from={copy_teacher}",
                                    *([f"--model.distill_steps={distill}"] if distill else []))
    code, out, err = run_cli(["fit", *args])
    assert code == 0, err
    assert f"init_from {copy_teacher}: attention softmax -> linear/{feature_map}" in out
    assert (f"attention distillation: update {distill} of {distill}" in out) == bool(distill)
    code, _, err = run_cli(["test", *_copy_config_at_toy_size(config, tmp_path, "--ckpt_path=best")])
    assert code == 0, err
    tested = [row for version in sorted(tmp_path.glob("version_*")) for row in read_metrics(version) if "test/loss" in row]
    assert len(tested) == 1 and tested[0]["test/loss"] > 0


def test_a_converted_run_resumes_without_its_init_from_checkpoint(softmax_checkpoint, tmp_path):
    """``fit --config <run>/config.yaml --ckpt_path last`` of a converted run: the saved config still
    names init_from, whose file has since gone; the run continues from its own last.ckpt without
    reading it. A fresh fit naming the gone file is one line that says init_from and the way on."""
    teacher = tmp_path / "teacher.ckpt"
    teacher.write_bytes(softmax_checkpoint.read_bytes())
    args = tiny_copy_args(tmp_path / "run", "linear", "--model.attention.feature_map=hedgehog",
                          f"--model.init_from={teacher}", "--model.distill_steps=2", "--trainer.max_steps=2")
    code, out, err = run_cli(["fit", *args])
    assert code == 0 and "attention distillation: update 2 of 2" in out, err
    teacher.unlink()
    saved = tmp_path / "run" / "version_0" / "config.yaml"
    code, out, err = run_cli(["fit", "--config", str(saved), "--ckpt_path", "last", "--trainer.max_steps=4"])
    assert code == 0, err
    assert "init_from" not in out and "attention distillation" not in out, out
    resumed = torch.load(checkpoint_dir(tmp_path / "run") / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 4
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "fresh", "linear", f"--model.init_from={teacher}")])
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: --model.init_from {teacher}: no such file") and "--ckpt_path last" in lines[0], err
