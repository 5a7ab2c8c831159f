"""What a finished fit says (issue 54, item 5): its run folder, the best checkpoint with its metric,
the resume point, and the next commands, which run as printed; after a resume, the commands name
the config of the run whose checkpoints it continued."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import checkpoint_dir, run_cli, tiny_copy_args

pytestmark = pytest.mark.slow


def printed_commands(out: str) -> list[list[str]]:
    """The ``python cli.py ...`` commands of the fit's last lines, as argument lists after ``cli.py``."""
    found = re.findall(r"^(?:next:)?\s+python cli\.py (.*)$", out, flags=re.M)
    return [shlex.split(command) for command in found]


def test_a_finished_fit_names_its_run_its_best_checkpoint_and_the_next_commands(tmp_path):
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear", "--trainer.max_steps=3")])
    assert code == 0, err
    summary = out[out.index("fit finished"):].splitlines()
    assert summary[0] == f"fit finished at step 3: run folder {tmp_path / 'version_0'}"
    best = next(checkpoint_dir(tmp_path).glob("best-*.ckpt"))
    assert re.fullmatch(rf"  best checkpoint {re.escape(str(best))} \(val/loss \d+\.\d{{4}}\)", summary[1]), summary
    assert summary[2] == f"  resume point    {checkpoint_dir(tmp_path) / 'last.ckpt'}"
    commands = printed_commands(out)
    assert [c[0] for c in commands] == ["test", "predict"], out
    assert commands[0] == ["test", "--config", str(tmp_path / "version_0" / "config.yaml"), "--ckpt_path", "best"]
    code, out, err = run_cli(commands[0])  # as printed, from the same directory
    assert code == 0 and "fit finished" not in out, err
    assert re.search(rf"--ckpt_path best: {re.escape(str(best))}", out), out


def test_a_resumed_fit_names_the_config_of_the_run_it_continued(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear", "--trainer.max_steps=3")])
    assert code == 0, err
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path, "linear", "--trainer.max_steps=6", "--ckpt_path=last")])
    assert code == 0, err
    # the run folder is the one export and --config take (a user exported version_1 and was refused)
    assert f"fit finished at step 6: run folder {tmp_path / 'version_0'} (this fit's logs: {tmp_path / 'version_1'})" in out
    config = str(tmp_path / "version_0" / "config.yaml")  # version_1 logged the resume; the checkpoints are version_0's
    assert [c[:3] for c in printed_commands(out)] == [["test", "--config", config], ["predict", "--config", config]]


def test_the_projection_says_what_is_left_only_while_something_is(tmp_path):
    """The run-time line comes after 10 warm-up and 30 measured updates (tiny updates: counted, not
    timed). In a run of 60 it says what is left; in a run of 40 it comes at the last update, where
    "0 s of it left" would be said of a run that has finished. One epoch each: an epoch's end (a
    validation, a checkpoint) costs ten updates' time and changes nothing here."""
    for steps, left in ((60, True), (40, False)):
        code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path / str(steps), "linear", f"--trainer.max_steps={steps}",
                                                         f"--data.train_batches_per_epoch={steps}")])
        assert code == 0, err
        lines = [line for line in out.splitlines() if line.startswith("time: about")]
        assert len(lines) == 1 and ("of it left" in lines[0]) == left, lines
