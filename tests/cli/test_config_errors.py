"""A config file's faults read as the command line's (issue 54, item 5): a misspelt key is one line
with the did-you-mean and the file that holds it; YAML that does not parse names the file and the
line; ``--model.attention`` takes what the Python API takes (a bare backend name), and a mapping
with an unknown field names that field."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import checkpoint_dir, run_cli, tiny_copy_args
from test_cli_startup import assert_one_line_error


@pytest.mark.parametrize(("content", "given", "meant"), [
    ({"model": {"init_args": {"n_layer": 2}}}, "--model.n_layer", "--model.n_layers"),
    ({"model": {"init_args": {"attention": {"backend": "linear", "feature_mp": "elu"}}}},
     "--model.attention.feature_mp", "--model.attention.feature_map"),
    ({"data": {"init_args": {"batch_sze": 2}}}, "--data.batch_sze", "--data.batch_size"),
    ({"trainer": {"max_step": 2}}, "--trainer.max_step", "--trainer.max_steps"),
], ids=["model", "model.attention", "data", "trainer"])
def test_a_misspelt_key_in_a_config_file_is_one_line_with_did_you_mean_and_the_file(tmp_path, content, given, meant):
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(content))
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--config", str(typo), "--print_config"])
    assert_one_line_error(code, err, f"unknown option {given} in {typo}; did you mean {meant}?", "(cli.py fit ")


def test_a_trainer_typo_in_a_file_after_other_options_too(tmp_path):
    """After options of the subcommand, jsonargparse words it as the subcommand's option
    (``Subcommand 'fit' does not accept option 'trainer.max_step'``): the same line."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_step: 2\n")
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--config", str(typo)])
    assert_one_line_error(code, err, f"unknown option --trainer.max_step in {typo}; did you mean --trainer.max_steps?")


def test_the_same_typo_on_the_command_line_names_no_file(tmp_path):
    """The key is looked up in the config files given: one that does not hold it is not named."""
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--model.n_layer", "2", "--print_config"])
    line = assert_one_line_error(code, err, "unknown option --model.n_layer; did you mean --model.n_layers?")
    assert " in " not in line.split(";")[0]


@pytest.mark.parametrize(("content", "line"), [
    ({"trainer": {"max_steps": "many"}}, "--trainer.max_steps many in {}: expected an integer"),
    ({"model": {"init_args": {"d_model": "wide"}}}, "--model.d_model wide in {}: expected an integer"),
], ids=["trainer", "model"])
def test_a_value_of_the_wrong_type_in_a_config_file_names_its_option_and_the_file(tmp_path, content, line):
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(content))
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--config", str(wrong), "--print_config"])
    assert_one_line_error(code, err, line.format(wrong))


def test_a_yaml_syntax_error_names_the_file_and_the_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: [2\n")
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--config", str(broken)])
    line = assert_one_line_error(code, err, f"config file {broken} is not valid YAML", "line 3, column 1",
                                 "flow sequence from line 2, column 14")
    assert "<unicode string>" not in line
    # also before the help, which reads the config without the parser
    code, _, err = run_cli(["fit", "--config", str(broken), "--help"])
    assert_one_line_error(code, err, f"config file {broken} is not valid YAML")


def test_an_attention_mapping_with_an_unknown_field_names_the_field():
    code, _, err = run_cli(["fit", "--config", "copy_linear.yaml", "--model.attention", "{backend: linear, feature_mp: elu}",
                            "--print_config"])
    assert_one_line_error(code, err, "unknown option --model.attention.feature_mp; did you mean --model.attention.feature_map?")


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_a_bare_backend_name_is_the_whole_attention_as_the_api_reads_it(form):
    """``--model.attention softmax`` is ``AttentionConfig("softmax")``: every other field at its
    default, so a feature map set before it (here on the command line; a config's alike) is cleared."""
    given = ["--model.attention", "softmax"] if form == "separate" else ["--model.attention=softmax"]
    code, out, err = run_cli(["fit", "--config", "copy_linear.yaml", "--model.attention.feature_map=favor",
                              "--model.attention.kwargs={dropout: 0.1}", *given, "--print_config"])
    assert code == 0, err
    attention = yaml.safe_load(out)["model"]["init_args"]["attention"]
    assert attention == {"backend": "softmax", "feature_map": None, "feature_map_kwargs": {}, "kwargs": {}}


def test_a_bare_backend_name_in_a_config_file_is_read_as_the_api_reads_it(tmp_path):
    """``attention: softmax`` in a file; options of the attention given after it start from that
    backend's defaults."""
    named = tmp_path / "named.yaml"
    named.write_text("model:\n  init_args:\n    attention: softmax\n")
    code, out, err = run_cli(["fit", "--config", "copy_linear.yaml", "--config", str(named), "--print_config"])
    assert code == 0, err
    softmax = {"backend": "softmax", "feature_map": None, "feature_map_kwargs": {}, "kwargs": {}}
    assert yaml.safe_load(out)["model"]["init_args"]["attention"] == softmax
    code, out, err = run_cli(["fit", "--config", "copy_linear.yaml", "--config", str(named),
                              "--model.attention.kwargs={dropout: 0.1}", "--print_config"])
    assert code == 0, err
    attention = yaml.safe_load(out)["model"]["init_args"]["attention"]
    assert attention == {"backend": "softmax", "feature_map": None, "feature_map_kwargs": {}, "kwargs": {"dropout": 0.1}}


@pytest.mark.slow
def test_a_bare_backend_name_trains_that_backend(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear", "--model.attention.feature_map=favor",
                                                   "--model.attention", "softmax", "--trainer.max_steps=1")])
    assert code == 0, err
    saved = torch.load(checkpoint_dir(tmp_path) / "last.ckpt", weights_only=True)["hyper_parameters"]["attention"]
    assert saved["backend"] == "softmax" and saved["feature_map"] is None
    named = tmp_path / "named.yaml"  # the same from a config file: the task coerces the name
    named.write_text("model:\n  init_args:\n    attention: softmax\n")
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "file", "linear", "--config", str(named),
                                                   "--trainer.max_steps=1")])
    assert code == 0, err
    saved = torch.load(checkpoint_dir(tmp_path / "file") / "last.ckpt", weights_only=True)["hyper_parameters"]["attention"]
    assert saved["backend"] == "softmax" and saved["feature_map"] is None
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "typo", "linear", "--model.attention", "softmx")])
    assert_one_line_error(code, err, "Unknown attention backend 'softmx'. Did you mean 'softmax'?")


def test_a_null_feature_map_on_the_command_line_is_none_as_in_yaml(tmp_path):
    """jsonargparse reads ``--model.attention.feature_map=null`` as the string "None"; the CLI makes
    it None as a YAML null is, so softmax (which takes no feature map) trains."""
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "softmax"), "--model.attention.feature_map=null",
                            "--trainer.fast_dev_run=1"])
    assert code == 0, err
