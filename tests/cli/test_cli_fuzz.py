"""Property-based tests of the CLI's argument layer (issue 43): random flags and values each end in
a result or one line naming the problem, exit code 2 for refused input, never a traceback, a
hang, or a run folder written for a refused run. The trainer's range check is held against
Lightning itself: what it lets through the Trainer accepts, what it refuses the Trainer refuses."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
from conftest import run_cli, tiny_copy_args
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.exceptions import MisconfigurationException
from test_cli_startup import error_lines

from linformer_lab.cli.checks import TRAINER_RANGES, trainer_value_error

NUMBERS = st.one_of(st.integers(-3, 3), st.sampled_from([-1, 0, 1, 2, 1000, -0.5, 0.0, 0.25, 1.0, 1.5, 2.0, 3.7]))


#: the ranges Lightning itself checks when it builds the Trainer (the others it finds later, or
#: never: accumulate_grad_batches 0 or a negative gradient_clip_val pass its constructor)
CHECKED_BY_THE_TRAINER = ("max_steps", "max_epochs", "val_check_interval", "overfit_batches", "limit_train_batches",
                          "limit_val_batches", "limit_test_batches", "limit_predict_batches")
WHOLE_NUMBERS = ("max_epochs", "min_epochs", "max_steps", "min_steps", "log_every_n_steps", "num_sanity_val_steps",
                 "accumulate_grad_batches", "check_val_every_n_epoch")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TRAINER_RANGES)), value=NUMBERS)
def test_trainer_ranges_agree_with_lightning(name, value):
    message = trainer_value_error({name: value})
    if message is not None:
        assert message.startswith(f"--trainer.{name} {value}: expected ") and "\n" not in message
    if name not in CHECKED_BY_THE_TRAINER or (name in WHOLE_NUMBERS and value != int(value)):
        return  # no reference here (a float count: the parser's type check refuses it first)
    try:
        L.Trainer(**{name: value}, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu", devices=1)
        accepted = True
    except (MisconfigurationException, ValueError):
        accepted = False
    assert (message is None) == accepted, (name, value, message)


def test_out_of_range_values_are_nan_and_inf_too():
    for value in (math.nan, math.inf, -math.inf):
        assert trainer_value_error({"gradient_clip_val": value}).startswith(f"--trainer.gradient_clip_val {value}")
    assert trainer_value_error({"max_steps": True}) is None  # a bool is not a count: the parser's to refuse


# ---------------------------------------------------------------------- whole commands

#: flag -> values to draw: valid ones, out-of-range ones, wrong types, empty and special strings
FLAGS = {
    "--trainer.max_steps": ["1", "-5", "0", "abc", "1.5", ""],
    "--trainer.max_epochs": ["1", "-2", "x", "null"],
    "--trainer.val_check_interval": ["1", "-3", "0.5", "2.5", "null", "nan"],
    "--trainer.limit_val_batches": ["1", "0", "2.5", "-1", "inf", "abc"],
    "--trainer.precision": ["32-true", "17", "bf16-mixed", "16", "half", ""],
    "--trainer.accumulate_grad_batches": ["1", "0", "-2", "x"],
    "--trainer.check_val_every_n_epoch": ["1", "0", "null"],
    "--trainer.gradient_clip_val": ["0.5", "-1", "nan", "x"],
    "--trainer.num_sanity_val_steps": ["0", "-2", "1"],
    "--trainer.accelerator": ["cpu", "gpux", "3"],
    "--trainer.max_stepz": ["1"],
    "--model.d_model": ["16", "0", "-8", "7", "x"],
    "--model.n_heads": ["2", "0", "3", "-1"],
    "--model.n_layers": ["1", "0", "-1", "1.5"],
    "--model.dropout": ["0.0", "-0.5", "1.5", "nan"],
    "--model.lr": ["0.001", "-1", "0", "inf", "x"],
    "--model.attention.backend": ["linear", "softmax", "softmx", "", "3"],
    "--model.attention.feature_map": ["elu", "null", "nope"],
    "--data.batch_size": ["4", "0", "-1", "x"],
    "--data.max_length": ["6", "0", "-3", "x"],
    "--data.min_length": ["1", "0", "9"],
    "--checkpoint.save_top_k": ["1", "0", "-1", "x"],
    "--checkpoint.every_n_train_steps": ["1", "0", "-1", "null"],
    "--ckpt_path": ["last", "best", "nowhere.ckpt", "."],
}
CHOICES = st.sampled_from(sorted(FLAGS)).flatmap(lambda flag: st.tuples(st.just(flag), st.sampled_from(FLAGS[flag])))


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(chosen=st.lists(CHOICES, min_size=1, max_size=4, unique_by=lambda pair: pair[0]),
       subcommand=st.sampled_from(["fit", "validate"]))
def test_random_flags_end_in_a_run_or_one_line_and_a_refused_run_writes_nothing(tmp_path_factory, chosen, subcommand):
    root = tmp_path_factory.mktemp("fuzz")
    base = [a for a in tiny_copy_args(root) if not a.startswith("--trainer.logger=")]  # the CLI's own run folders
    base.append("--trainer.max_steps=2")  # a valid run is short unless a drawn flag says otherwise
    flags = [f"{flag}={value}" for flag, value in chosen]
    # and stays short whatever was drawn: two batches an epoch, at most 5 s of training
    bounds = ["--data.train_batches_per_epoch=2", "--data.val_batches=1", "--trainer.max_time=00:00:00:05"]
    code, _, err = run_cli([subcommand, *base, *flags, *bounds])
    assert "Traceback" not in err, (flags, err)
    assert code in (0, 2), (flags, code, err)
    event(f"exit code {code}")  # --hypothesis-show-statistics: how many ran, how many were refused
    if code == 2:
        lines = error_lines(err)
        assert len(lines) == 1 and lines[0].startswith("error: "), (flags, err)
        written = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))
        assert written == [], (flags, written)
