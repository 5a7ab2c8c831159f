"""The CLI answers at once and errs in one line (issue 39, item 4): ``--help``, ``plugins`` and
config lookup load neither Lightning nor torch; a misspelt flag, nested option, config or
subcommand is one line with a did-you-mean and exit code 2; ``--config X --help`` and
``--model.help NAME`` show a config's or task's options; a top-level ``-c X`` means ``fit --config X``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, checkpoint_dir, run_cli, tiny_copy_args

HEAVY = ("torch", "lightning", "jsonargparse")


def error_lines(err: str) -> list[str]:
    """stderr without the warnings ``run_cli`` appends after it (``SomeWarning: ...``)."""
    return [line for line in re.split(r"^\w*Warning: ", err, maxsplit=1, flags=re.M)[0].splitlines() if line.strip()]


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and "usage:" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------- start-up


@pytest.mark.slow
def test_help_plugins_and_config_lookup_import_neither_lightning_nor_torch(tmp_path):
    """In a fresh interpreter, as ``python cli.py`` starts: the answers (also ``fit --config X
    --help``) come without a heavy import (the measured start-up is in docs/cli.md, "Start-up")."""
    script = f"""
import contextlib, io, json, sys
sys.path.insert(0, {str(REPO)!r})
from linformer_lab.cli.entry import main
codes = []
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
    codes.append(main(["--help"]))
    codes.append(main(["-h"]))
    codes.append(main(["plugins"]))
    codes.append(main(["plugins", "--json"]))
    codes.append(main(["fit", "--config", "mnist_linaer.yaml"]))
    codes.append(main(["-c", "copy_linear.yaml"]))
    codes.append(main(["fit", "--config", "copy_linear.yaml", "--help"]))
    codes.append(main(["fit", "--help"]))
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r})
print(json.dumps({{"codes": codes, "loaded": loaded, "out": out.getvalue(), "err": err.getvalue()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["codes"] == [0, 0, 0, 0, 2, 2, 0, 0], result
    assert result["loaded"] == [], f"imported {result['loaded']}"
    assert "subcommands:" in result["out"] and "linear" in result["out"] and "did you mean mnist_linear.yaml?" in result["err"]
    assert "--model.attention.backend BACKEND" in result["out"]  # the config's help, from the sources
    assert "--trainer.max_steps MAX_STEPS" in result["out"]  # fit --help: the Trainer's, from its source


@pytest.mark.slow
def test_cli_py_plugins_as_a_process():
    done = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "cli.py"), "plugins"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "softmax" in done.stdout, done.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "linformer_lab" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_top_level_help_lists_subcommands_configs_and_task_names():
    code, out, _ = run_cli(["--help"])
    assert code == 0
    for word in ("fit", "validate", "test", "predict", "plugins", "plot RUN", "copy_linear.yaml", "mnist_cpu_lsh4.yaml",
                 "--model.help copy", "--config copy_linear.yaml --help"):
        assert word in out, word
    code, _, err = run_cli([])
    assert_one_line_error(code, err, "name a subcommand")


# ---------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(("args", "given", "meant"), [
    (["--trainer.max_step", "3"], "--trainer.max_step", "--trainer.max_steps"),
    (["--trainer.max_step=3"], "--trainer.max_step", "--trainer.max_steps"),
    (["--checkpoint.every_n_train_step", "5"], "--checkpoint.every_n_train_step", "--checkpoint.every_n_train_steps"),
    (["--model.attention.backnd", "softmax"], "--model.attention.backnd", "--model.attention.backend"),
    (["--model.n_layer", "2"], "--model.n_layer", "--model.n_layers"),
    (["--data.batch_sze", "2"], "--data.batch_sze", "--data.batch_size"),
], ids=["trainer", "trainer=", "checkpoint", "model.attention", "model", "data"])
def test_misspelt_option_is_one_line_with_did_you_mean(args, given, meant):
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", *args, "--print_config"])
    assert_one_line_error(code, err, f"unknown option {given}; did you mean {meant}?", "(cli.py fit ")


def test_unknown_option_without_a_close_name_is_still_one_line():
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--trainer.zzzz_qqq", "1", "--print_config"])
    line = assert_one_line_error(code, err, "unknown option --trainer.zzzz_qqq")
    assert "did you mean" not in line


def test_bad_value_is_one_line_naming_the_value():
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--trainer.max_steps", "many", "--print_config"])
    assert_one_line_error(code, err, "max_steps", "many")


@pytest.mark.parametrize(("config", "meant"), [
    ("mnist_linaer.yaml", "mnist_linear.yaml"), ("copy_sofmax", "copy_softmax.yaml"), ("speech_cpu_lsh", "speech_cpu_lsh4.yaml"),
])
def test_misspelt_config_name_is_one_line_with_did_you_mean(tmp_path, config, meant):
    code, _, err = run_cli(["fit", "--config", config], cwd=tmp_path)
    assert_one_line_error(code, err, f"config file {config!r} not found", f"did you mean {meant}?")


def test_config_name_like_none_lists_the_configs(tmp_path):
    code, _, err = run_cli(["validate", "--config=zzzzzzzz.yaml"], cwd=tmp_path)
    assert_one_line_error(code, err, "'zzzzzzzz.yaml' not found", "copy_linear.yaml", "mnist_linear.yaml")


def test_misspelt_subcommand_and_flag_before_it():
    code, _, err = run_cli(["fitt", "--config", "copy_linear.yaml"])
    assert_one_line_error(code, err, "unknown subcommand 'fitt'; did you mean fit?")
    code, _, err = run_cli(["--print_config", "fit", "--config", "copy_linear.yaml"])
    assert_one_line_error(code, err, "--print_config goes after the subcommand")


def test_softmax_switch_error_names_the_flag_that_clears_the_feature_map(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear"), "--model.attention.feature_map=favor",
                            "--model.attention.backend=softmax", "--trainer.fast_dev_run=1"])
    assert code == 2 and "Traceback" not in err, err
    assert "--model.attention.feature_map null" in err, err


# ---------------------------------------------------------------------- help for a config and a task


def test_help_with_a_config_lists_its_model_and_data_options():
    code, out, err = run_cli(["fit", "--config", "copy_linear.yaml", "--help"])
    assert code == 0, err
    assert "  --trainer.max_steps 10000\n" in out  # what the config sets comes first
    model = out.index("--model.* (linformer_lab.tasks.copy_task.CopyTask)")
    attention = out.index("--model.attention.* (linformer_lab.attention.config.AttentionConfig)")
    data = out.index("--data.* (linformer_lab.data.copy.CopyDataModule)")
    assert model < attention < data
    for option in ("--model.n_layers", "--model.d_model", "--model.segment_length"):
        assert option in out[model:attention], option
    for option in ("--model.attention.backend", "--model.attention.feature_map"):
        assert option in out[attention:data], option
    # the defaults shown are the config's (max_length 62, dropout 0.1), not the classes' (128, 0.0)
    max_length = out[data:][out[data:].index("--data.max_length"):]
    assert "default: 62)" in " ".join(max_length[:max_length.index("--data.num_symbols")].split())
    dropout = out[model:attention][out[model:attention].index("--model.dropout"):]
    assert "default: 0.1)" in " ".join(dropout[:dropout.index("--model.lr ")].split())
    code, out, _ = run_cli(["validate", "--config", "mnist_cpu_linear.yaml", "-h"])
    assert code == 0 and "--model.* (linformer_lab.tasks.image_generation.ImageGenerationTask)" in out
    assert "--data.* (linformer_lab.data.images.MNISTDataModule)" in out


def test_the_conversion_options_are_described_for_each_task_in_plain_text():
    """``init_from`` / ``distill_steps`` as each task's own docstring says them, without Sphinx markup
    (a role such as :class:`~...` or ``literal`` quotes is shown as the name it stands for)."""
    texts = {}
    for config, task in (("copy_linear.yaml", "copy"), ("mnist_linear.yaml", "image")):
        code, out, err = run_cli(["fit", "--config", config, "--help"])
        assert code == 0, err
        options = out[out.index("--model.init_from"):out.index("--model.distill_lr")]
        assert ":class:" not in options and ":meth:" not in options and "``" not in options, options
        texts[task] = options
    assert "copy" in texts["copy"] and "ImageGenerationTask" not in texts["copy"]
    assert texts["copy"] != texts["image"]
    assert "(Task.initialise_from, a table" in " ".join(texts["image"].split())


def test_help_without_a_config_lists_every_option_and_says_how_to_see_the_model_options():
    """Read from the sources (no Lightning): every argument of the Trainer and of the subcommand's
    Trainer method, the checkpoint settings, each with its description, type and default."""
    import inspect

    from lightning.pytorch import Trainer

    code, out, _ = run_cli(["fit", "--help"])
    assert code == 0 and "add --config NAME" in out.splitlines()[-1]
    for name in inspect.signature(Trainer).parameters:
        assert f"  --trainer.{name} {name.upper()}\n" in out, name
    for option in ("--checkpoint.every_n_train_steps", "--ckpt_path CKPT_PATH", "--config CONFIG", "--print_config"):
        assert option in out, option
    assert "Stop training after this number of steps." in " ".join(out[out.index("--trainer.max_steps"):].split())
    code, out, _ = run_cli(["test", "--help"])
    assert code == 0 and "--verbose VERBOSE" in out and "--trainer.max_steps" in out


@pytest.mark.parametrize("name", ["copy", "CopyTask", "copytask", "linformer_lab.tasks.copy_task.CopyTask"])
def test_model_help_takes_a_task_short_name(name):
    code, out, err = run_cli(["fit", "--model.help", name])
    assert code == 0, err
    assert "CopyTask" in out and "--model.n_layers" in out and "--model.segment_length" in out, out


def test_data_help_takes_a_short_name_and_a_wrong_one_is_one_line():
    code, out, err = run_cli(["fit", "--data.help=mnist"])
    assert code == 0 and "MNISTDataModule" in out and "batch_size" in out, err
    code, _, err = run_cli(["fit", "--model.help", "cpy"])
    assert_one_line_error(code, err, "no such task; did you mean copy?", "speech")


# ---------------------------------------------------------------------- top-level -c


def test_top_level_config_means_the_subcommands_config(tmp_path):
    code, out, err = run_cli(["-c", "copy_softmax.yaml", "fit", "--print_config"], cwd=tmp_path)
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["model"]["init_args"]["attention"]["backend"] == "softmax"  # not silently the defaults
    code, same, _ = run_cli(["fit", "--config", "copy_softmax.yaml", "--print_config"], cwd=tmp_path)
    assert yaml.safe_load(same) == printed
    # later flags still win over it
    code, out, _ = run_cli(["--config=copy_softmax.yaml", "fit", "--model.n_layers", "2", "--print_config"], cwd=tmp_path)
    assert code == 0 and yaml.safe_load(out)["model"]["init_args"]["n_layers"] == 2


# ---------------------------------------------------------------------- checkpoint hint


@pytest.mark.slow
def test_wrong_model_error_names_the_saved_config_it_found(tmp_path):
    run = tmp_path / "run"
    code, _, err = run_cli(["fit", *tiny_copy_args(run), "--trainer.max_steps=1"])
    assert code == 0, err
    last = checkpoint_dir(run) / "last.ckpt"
    saved = run / "version_0" / "config.yaml"
    assert last.is_file() and saved.is_file()
    code, _, err = run_cli(["validate", *tiny_copy_args(tmp_path / "eval"), "--model.d_model=32", "--ckpt_path", str(last)])
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]  # after Lightning's start-up lines, the one-line explanation
    assert "does not fit" in line and f"--config {saved.resolve()}" in line and "<trainer" not in line, line
