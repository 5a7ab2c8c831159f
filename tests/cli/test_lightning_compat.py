"""The private Lightning members the package relies on (``linformer_lab.lightning_compat``): all
present in the pinned release, each missing one named exactly (also through the CLI, before any
work), none used outside the compat module, and the upstream warning filter matching its message."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from conftest import run_cli, tiny_copy_args
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.fit_loop import _FitLoop

import linformer_lab.lightning_compat as compat
from linformer_lab.checkpoint_callbacks import LastCheckpoint

PACKAGE = Path(__file__).resolve().parents[2] / "linformer_lab"


def test_every_member_exists_in_the_installed_lightning():
    assert compat.missing_members() == []
    compat.check()


@pytest.mark.parametrize("owner, member, shown", [
    (ModelCheckpoint, "_save_last_checkpoint", "ModelCheckpoint._save_last_checkpoint"),
    (ModelCheckpoint, "_should_save_on_train_epoch_end", "ModelCheckpoint._should_save_on_train_epoch_end"),
    (_FitLoop, "_can_stop_early", "_FitLoop._can_stop_early"),
])
def test_a_removed_member_is_named_and_only_it(monkeypatch, owner, member, shown):
    monkeypatch.delattr(owner, member)
    missing = compat.missing_members()
    assert len(missing) == 1 and missing[0].startswith(f"{shown} ("), missing
    with pytest.raises(compat.LightningCompatError, match=re.escape(shown)) as caught:
        compat.check()
    message = str(caught.value)
    assert "\n" not in message and "lightning_compat.py" in message
    others = [f"{path.partition(':')[2]}.{name}" for path, name, _ in compat.MEMBERS if name != member]
    assert not any(other in message for other in others), message


def test_an_instance_member_removed_from_init_is_named(monkeypatch):
    # _last_global_step_saved is set in ModelCheckpoint.__init__, not on the class
    original = ModelCheckpoint.__init__

    def init_without(self, *args, **kwargs):
        original(self, *args, **kwargs)
        del self._last_global_step_saved

    monkeypatch.setattr(ModelCheckpoint, "__init__", init_without)
    assert [m.split(" ")[0] for m in compat.missing_members()] == ["ModelCheckpoint._last_global_step_saved"]
    with pytest.raises(compat.LightningCompatError, match=re.escape("LastCheckpoint._last_global_step_saved")):
        compat.last_saved_step(LastCheckpoint(dirpath=None, every_n_train_steps=None))


def test_a_wrapper_names_the_member_it_cannot_find(monkeypatch):
    callback = LastCheckpoint(dirpath=None, every_n_train_steps=None)
    monkeypatch.delattr(ModelCheckpoint, "_monitor_candidates")
    with pytest.raises(compat.LightningCompatError, match=re.escape("LastCheckpoint._monitor_candidates")):
        compat.save_last_checkpoint(callback, trainer=None)


def test_the_cli_stops_before_any_work_naming_the_member(monkeypatch, tmp_path):
    monkeypatch.delattr(ModelCheckpoint, "_save_last_checkpoint")
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: lightning ") and "ModelCheckpoint._save_last_checkpoint" in lines[0]
    assert not list(tmp_path.glob("version_*")), "a refused run created its run directory"


def test_no_module_but_the_compat_module_reads_a_listed_member():
    """The CLI may override the two LightningCLI hooks (``def name``, ``super().name``); every
    other use of a listed member goes through lightning_compat."""
    names = {member for _, member, _ in compat.MEMBERS}
    overridable = {"_parse_ckpt_path", "_run_subcommand"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "lightning_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in names:
                if re.search(rf"\.{name}\b|\b{name}\b\s*=", line) and not (
                        name in overridable and re.search(rf"def {name}\(|super\(\)\.{name}\(", line)):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


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
