"""The private Lightning and jsonargparse members linformer_lab relies on (``linformer_lab.compat``):
all present in the pinned releases, each missing one named exactly (also through the CLI, before
any work), none used outside the compat module; the forms of jsonargparse's error messages it
reads, each produced by the installed jsonargparse; the upstream warning filter matching its message."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from conftest import run_cli, tiny_copy_args
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.fit_loop import _FitLoop

import linformer_lab.compat as compat
from linformer_lab.tasks.checkpointing import LastCheckpoint

PACKAGE = Path(__file__).resolve().parents[2] / "linformer_lab"


def test_every_member_exists_in_the_installed_lightning_and_jsonargparse():
    assert compat._missing() == []
    compat.check()


@pytest.mark.parametrize("owner, member, shown", [
    (ModelCheckpoint, "_should_save_on_train_epoch_end", "ModelCheckpoint._should_save_on_train_epoch_end"),
    (_FitLoop, "_can_stop_early", "_FitLoop._can_stop_early"),
])
def test_a_removed_member_is_named_and_only_it(monkeypatch, owner, member, shown):
    monkeypatch.delattr(owner, member)
    missing = compat._missing()
    assert len(missing) == 1 and missing[0][0] == "lightning" and missing[0][1].startswith(f"{shown} ("), missing
    with pytest.raises(compat.CompatError, match=re.escape(shown)) as caught:
        compat.check()
    message = str(caught.value)
    assert "\n" not in message and "linformer_lab/compat.py" in message
    others = [f"{path.partition(':')[2]}.{name}" for path, name, _ in compat.MEMBERS if name != member]
    assert not any(other in message for other in others), message


def test_a_wrapper_names_the_member_it_cannot_find(monkeypatch):
    callback = LastCheckpoint(dirpath=None, every_n_train_steps=None)
    monkeypatch.delattr(ModelCheckpoint, "_should_save_on_train_epoch_end")
    with pytest.raises(compat.CompatError, match=re.escape("LastCheckpoint._should_save_on_train_epoch_end")):
        compat.saves_at_train_epoch_end(callback, trainer=None)


def test_the_cli_stops_before_any_work_naming_the_member(monkeypatch, tmp_path):
    monkeypatch.delattr(ModelCheckpoint, "_should_save_on_train_epoch_end")
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: lightning ") and "ModelCheckpoint._should_save_on_train_epoch_end" in lines[0]
    assert not list(tmp_path.glob("version_*")), "a refused run created its run directory"


def test_no_module_but_the_compat_module_reads_a_listed_member():
    """The CLI may override the two LightningCLI hooks (``def name``, ``super().name``); every
    other use of a listed member goes through compat.py."""
    names = {member for _, member, _ in compat.MEMBERS}
    overridable = {"_parse_ckpt_path", "_run_subcommand"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in names:
                if re.search(rf"\.{name}\b|\b{name}\b\s*=", line) and not (
                        name in overridable and re.search(rf"def {name}\(|super\(\)\.{name}\(", line)):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_jsonargparse_member_removed_from_init_is_named_as_jsonargparse_s(monkeypatch):
    import jsonargparse

    original = jsonargparse.ArgumentParser.__init__

    def init_without(self, *args, **kwargs):
        original(self, *args, **kwargs)
        del self._option_string_actions

    monkeypatch.setattr(jsonargparse.ArgumentParser, "__init__", init_without)
    assert [(distribution, shown.split(" ")[0]) for distribution, shown in compat._missing()] == [
        ("jsonargparse", "ArgumentParser._option_string_actions")]
    with pytest.raises(compat.CompatError) as caught:
        compat.check()
    assert str(caught.value).startswith("jsonargparse ") and "lightning " not in str(caught.value)


#: command-line arguments -> the facts each message form of JSONARGPARSE_MESSAGES must find in
#: jsonargparse's report of them
MESSAGE_CASES = [
    (["--trainer.max_step", "3"], {"unrecognized": "--trainer.max_step 3"}),
    (["--model.n_layer", "3"], {"parser_key": "model", "not_accepted": "n_layer",
                                "class_path": "linformer_lab.tasks.copy_task.CopyTask"}),
    (["--config", "trainer: {max_step: 3}"], {"group_option": "Subcommand"}),
    (["--trainer.precision", "17"], {"parser_key": "trainer.precision", "given_value": "17",
                                     "expected": "typing.Literal[64, 32, 16]"}),
    (["--data.batch_size", "abc"], {"parser_key": "batch_size", "nested_value": "'abc'", "expected": "<class 'int'>"}),
]


def test_every_jsonargparse_message_form_read_is_the_one_jsonargparse_writes(monkeypatch, tmp_path):
    from linformer_lab.cli.lightning_cli import LinformerArgumentParser

    messages = []
    original = LinformerArgumentParser.error

    def recording(self, message, ex=None):
        if self.exit_on_error:  # the report the user would see, not jsonargparse's lenient inner checks
            messages.append(message)
        return original(self, message, ex)

    monkeypatch.setattr(LinformerArgumentParser, "error", recording)
    found = {}
    for extra, facts in MESSAGE_CASES:
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), *extra])
        assert code == 2 and messages, err
        message = messages[-1]
        for name, fact in facts.items():
            pattern = compat.JSONARGPARSE_MESSAGES[name]
            captured = [m if isinstance(m, str) else m[0] for m in re.findall(pattern, message, re.MULTILINE)]
            found[name] = captured
            assert fact in captured or (not re.compile(pattern).groups and captured), (name, pattern, message)
    assert set(found) == set(compat.JSONARGPARSE_MESSAGES), "a listed message form is not exercised here"
    lines = [line.strip().lstrip("- ") for message in messages for line in message.splitlines()]
    assert all(any(line.startswith(frame) for line in lines) for frame in compat.UNION_REPORT_FRAME), messages


def test_the_upstream_warning_filter_matches_the_message_torch_gives():
    from torch.utils._pytree import LeafSpec

    with warnings.catch_warnings(record=True) as unfiltered:
        warnings.simplefilter("always")
        LeafSpec()
    assert any(re.match(compat.UPSTREAM_WARNINGS[0][0], str(w.message)) for w in unfiltered), \
        "torch no longer warns this way: drop the filter from UPSTREAM_WARNINGS"
    with warnings.catch_warnings(record=True) as filtered:
        warnings.simplefilter("always")
        compat.ignore_upstream_warnings()
        LeafSpec()
    assert not filtered, [str(w.message) for w in filtered]
