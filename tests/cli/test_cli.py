"""The command line (linformer_lab/cli/): configs, plugins, checkpoints, log dirs, precision."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from conftest import REPO, checkpoint_dir, read_metrics, run_cli, tiny_copy_args

import linformer_lab as ll
from linformer_lab.cli.args import resolve_config_args
from linformer_lab.cli.checkpoints import resolve_checkpoint_path
from linformer_lab.cli.checks import CHECKPOINT_ERROR_EXIT_CODE, resolve_precision
from linformer_lab.cli.lightning_cli import LinformerCLI
from linformer_lab.data.copy import CopyDataModule
from linformer_lab.registry import ATTENTION, FEATURE_MAPS
from linformer_lab.tasks.checkpoint_files import CheckpointMismatchError

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


# ---------------------------------------------------------------------- configs


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses(config):
    code, out, err = run_cli(["fit", "--config", str(config), "--print_config"])
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["model"]["class_path"] and printed["trainer"] is not None


def test_config_name_is_found_under_configs(tmp_path, monkeypatch):
    # From the repo root "configs/NAME" is used, from anywhere else this checkout's configs/.
    monkeypatch.chdir(REPO)
    assert resolve_config_args(["fit", "--config", "copy_lsh4.yaml"]) == ["fit", "--config", "configs/copy_lsh4.yaml"]
    assert resolve_config_args(["fit", "-c", "copy_lsh4"])[-1] == "configs/copy_lsh4.yaml"
    monkeypatch.chdir(tmp_path)
    resolved = resolve_config_args(["fit", "--config=copy_softmax.yaml"])
    assert resolved == ["fit", f"--config={REPO / 'configs' / 'copy_softmax.yaml'}"]
    # A file in the working directory wins; inline YAML is left alone.
    (tmp_path / "copy_softmax.yaml").write_text("seed_everything: 1\n")
    assert resolve_config_args(["--config", "copy_softmax.yaml"]) == ["--config", "copy_softmax.yaml"]
    assert resolve_config_args(["--config", "{trainer: {max_steps: 3}}"])[-1] == "{trainer: {max_steps: 3}}"


def test_print_config_from_outside_the_repo(tmp_path):
    code, out, err = run_cli(["fit", "--config", "copy_linear.yaml", "--model.attention.backend", "softmax", "--print_config"],
                             cwd=tmp_path)
    assert code == 0, err
    assert yaml.safe_load(out)["model"]["init_args"]["attention"]["backend"] == "softmax"


def test_missing_config_is_a_clear_error(tmp_path):
    code, _, err = run_cli(["fit", "--config", "copy_nothing.yaml"], cwd=tmp_path)
    assert code == 2 and "copy_nothing.yaml" in err and "copy_linear.yaml" in err and "Traceback" not in err


def test_unknown_backend_is_a_one_line_error(tmp_path):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, "softmx"), "--trainer.fast_dev_run=1"])
    assert code == 2 and "Did you mean 'softmax'" in err and "Traceback" not in err


# ---------------------------------------------------------------------- plugins


def test_plugins_lists_every_name_with_its_distribution():
    code, out, err = run_cli(["plugins"])
    assert code == 0, err
    for registry in (ATTENTION, FEATURE_MAPS):
        assert registry.group in out
        for name, dists in registry.distributions().items():
            line = next(line for line in out.splitlines() if line.split()[:1] == [name])
            assert all(d in line for d in dists)
    code, out, _ = run_cli(["plugins", "--json", "--check"])
    report = json.loads(out)
    assert {p["name"] for p in report["attention"]["plugins"]} == set(ll.list_attention())
    assert {p["name"] for p in report["feature_maps"]["plugins"]} == set(ll.list_feature_maps())
    assert all(p["status"] == "ok" for p in report["feature_maps"]["plugins"])


def _install_fake_feature_map(site: Path) -> None:
    """A third-party distribution the way pip leaves it: a module plus a .dist-info with entry points."""
    (site / "cube_features.py").write_text(textwrap.dedent("""
        import torch
        from linformer_lab.feature_maps import FeatureMap

        class CubeFeatureMap(FeatureMap):
            # phi(x) = 1 + relu(x)^3: positive, so a valid linear-attention kernel
            @property
            def output_dim(self):
                return self.query_dim

            def forward(self, x):
                self._check_input(x)
                return 1 + torch.relu(x) ** 3
    """))
    info = site / "cube_features-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cube-features\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text("[linformer_lab.feature_maps]\ncube = cube_features:CubeFeatureMap\n")


@pytest.fixture
def third_party_feature_map(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _install_fake_feature_map(site)
    monkeypatch.syspath_prepend(str(site))
    FEATURE_MAPS.refresh()
    yield "cube"
    monkeypatch.undo()
    FEATURE_MAPS.refresh()


def test_third_party_feature_map_by_name_in_yaml(tmp_path, third_party_feature_map):
    # The YAML names the plugin only by its registered name: no import line, no class_path.
    config = tmp_path / "cube.yaml"
    config.write_text("model:\n  init_args:\n    attention:\n      backend: linear\n"
                      f"      feature_map: {third_party_feature_map}\n")
    code, out, err = run_cli(["plugins"])
    assert "cube" in out and "cube-features==1.2" in out
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "run"), "--config", str(config), "--trainer.fast_dev_run=1"])
    assert code == 0, err
    assert "cube_features" in sys.modules  # imported by the registry while building the model


def test_broken_third_party_backend_is_named_with_its_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "broken_backend.py").write_text("import a_module_that_is_not_installed\n")
    info = site / "broken_backend-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-backend\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[linformer_lab.attention]\nbroken = broken_backend:BrokenAttention\n")
    monkeypatch.syspath_prepend(str(site))
    ATTENTION.refresh()
    try:
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path / "run", "broken"), "--trainer.fast_dev_run=1"])
        assert code == 2 and "Traceback" not in err
        assert "'broken'" in err and "broken-backend==0.3" in err and "a_module_that_is_not_installed" in err, err
        code, out, _ = run_cli(["plugins", "--check"])
        assert code == 1 and "broken-backend==0.3" in out
    finally:
        monkeypatch.undo()
        ATTENTION.refresh()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report on a machine without a GPU")
def test_plugins_check_says_linear_cuda_cannot_run_without_a_gpu():
    code, out, _ = run_cli(["plugins", "--json", "--check"])
    status = {p["name"]: p["status"] for p in json.loads(out)["attention"]["plugins"]}
    assert status["linear_cuda"].startswith("unavailable here: no CUDA GPU") and status["linear"] == "ok"
    assert code == 0  # unavailable is not broken


# ---------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny linear-attention copy run of 3 steps: its root dir (checkpoints/last.ckpt, best-*.ckpt)."""
    root = tmp_path_factory.mktemp("trained")
    code, _, err = run_cli(["fit", *tiny_copy_args(root), "--trainer.max_steps=3"])
    assert code == 0, err
    return root


def test_last_checkpoint_holds_the_final_step(tmp_path):
    # 4 steps = one epoch of 3 batches and one more: no epoch end or step trigger at step 4
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=4", "--trainer.limit_val_batches=0"])
    assert code == 0, err
    assert torch.load(checkpoint_dir(tmp_path) / "last.ckpt", weights_only=False)["global_step"] == 4


def test_default_checkpoints_and_best_resolution(trained):
    from linformer_lab.tasks.copy_task import CopyTask

    files = sorted(p.name for p in checkpoint_dir(trained).iterdir())
    assert "last.ckpt" in files and any(f.startswith("best-") for f in files)
    model = CopyTask(vocab_size=12, sequence_length=13, d_model=16, n_heads=2, n_layers=1)
    assert resolve_checkpoint_path("last", model, trained) == str(checkpoint_dir(trained) / "last.ckpt")
    assert Path(resolve_checkpoint_path("best", model, trained)).name.startswith("best-")


def test_best_of_a_moved_run_folder(trained, tmp_path, monkeypatch):
    """last.ckpt names the best checkpoint by the path it had when written. In a run folder that was
    renamed or copied elsewhere, ``best`` is the file of that name beside last.ckpt (not the
    original's); when neither exists, the error names the missing file (not "recorded none")."""
    import shutil

    from linformer_lab.cli import checkpoints
    from linformer_lab.tasks.copy_task import CopyTask

    moved = tmp_path / "moved"
    shutil.copytree(trained, moved)
    model = CopyTask(vocab_size=12, sequence_length=13, d_model=16, n_heads=2, n_layers=1)
    original = Path(resolve_checkpoint_path("best", model, trained))
    found = Path(resolve_checkpoint_path("best", model, moved))
    assert found.parent == checkpoint_dir(moved) and found.name == original.name
    gone = tmp_path / "gone" / "best-epoch=9-step=99.ckpt"  # not beside last.ckpt either
    monkeypatch.setattr(checkpoints, "_best_from_last", lambda last: str(gone))
    with pytest.raises(CheckpointMismatchError, match="records .*gone.* as the best checkpoint, but that file is gone"):
        resolve_checkpoint_path("best", model, moved)


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_evaluate_a_checkpoint(trained, tmp_path, subcommand):
    code, _, err = run_cli([subcommand, *tiny_copy_args(trained), "--ckpt_path", str(checkpoint_dir(trained) / "last.ckpt")])
    assert code == 0, err
    stage = "val" if subcommand == "validate" else "test"
    newest = max((trained).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    assert any(f"{stage}/loss" in row for row in read_metrics(newest))


def test_best_keyword_in_a_new_process(trained):
    code, _, err = run_cli(["validate", *tiny_copy_args(trained), "--ckpt_path", "best"])
    assert code == 0, err


def test_predict_writes_predictions(trained):
    code, out, err = run_cli(["predict", *tiny_copy_args(trained), "--ckpt_path", "last"])
    assert code == 0, err
    path = Path(out.split("predictions to ")[-1].strip())
    predictions = torch.load(path, weights_only=False)
    assert len(predictions) == 2  # test_batches=2, used as the predict split
    first = predictions[0]
    assert first["predicted"].shape == first["tokens"].shape and first["exact"].dtype == torch.bool
    # Outside the copy positions the prediction is the input itself.
    assert torch.equal(first["predicted"][~first["target_mask"]], first["tokens"][~first["target_mask"]])


class CopyDataWithoutPredictSplit(CopyDataModule):
    """A data module of another project: no predict split of its own."""

    predict_dataloader = L.LightningDataModule.predict_dataloader


def test_predict_without_any_predict_split_is_refused_in_one_line(tmp_path):
    """The data module says what predict runs on (a hook, not a method the CLI replaces): where
    neither it nor the model has one, the run stops naming the data module."""
    code, _, err = run_cli(["predict", *tiny_copy_args(tmp_path), f"--data={__name__}.CopyDataWithoutPredictSplit"])
    assert code == 2 and "error: CopyDataWithoutPredictSplit has no predict split" in err, err
    assert not list(tmp_path.glob("version_*")), "a refused run left its run directory"


def _expect_checkpoint_error(args, *fragments):
    code, _, err = run_cli(args)
    assert code == CHECKPOINT_ERROR_EXIT_CODE, err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]  # the whole explanation is this one line
    assert message.startswith("error: ")
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_checkpoint_of_another_task(trained, tmp_path):
    ckpt = torch.load(checkpoint_dir(trained) / "last.ckpt", weights_only=False)
    ckpt["hyper_parameters"]["_class_path"] = "linformer_lab.tasks.image_generation.ImageGenerationTask"
    torch.save(ckpt, tmp_path / "other_task.ckpt")
    _expect_checkpoint_error(
        ["validate", *tiny_copy_args(tmp_path), "--ckpt_path", str(tmp_path / "other_task.ckpt")],
        "another task", "ImageGenerationTask", "CopyTask",
    )


def test_checkpoint_of_another_shape(trained, tmp_path):
    _expect_checkpoint_error(
        ["test", *tiny_copy_args(tmp_path), "--model.d_model=32", "--ckpt_path", str(checkpoint_dir(trained) / "last.ckpt")],
        "d_model: checkpoint 16, configuration 32", "another shape",
    )


def test_checkpoint_of_another_attention_with_the_same_shapes(trained, tmp_path):
    # softmax and linear have identical weights: only the hyper-parameters tell them apart.
    _expect_checkpoint_error(
        ["validate", *tiny_copy_args(tmp_path, "softmax"), "--ckpt_path", str(checkpoint_dir(trained) / "last.ckpt")],
        "attention.backend: checkpoint 'linear', configuration 'softmax'",
    )


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "not_lightning", "empty"])
def test_unreadable_checkpoint(trained, tmp_path, damage):
    path = tmp_path / f"{damage}.ckpt"
    data = (checkpoint_dir(trained) / "last.ckpt").read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 100)
    elif damage == "not_lightning":
        torch.save({"weights": torch.zeros(3)}, path)
    elif damage == "empty":  # torch's own message for it is "EOFError" and nothing more
        path.write_bytes(b"")
    fragment = {"truncated": "cannot read", "garbage": "cannot read", "missing": "does not exist",
                "not_lightning": "not a Lightning checkpoint", "empty": "is empty (0 bytes)"}[damage]
    _expect_checkpoint_error(["validate", *tiny_copy_args(tmp_path), "--ckpt_path", str(path)], fragment)


def test_hparams_free_to_change_may_differ_from_the_checkpoint(trained, tmp_path):
    # Fine-tuning from a checkpoint with another learning rate is allowed.
    code, _, err = run_cli(["validate", *tiny_copy_args(tmp_path), "--model.lr=0.5",
                            "--ckpt_path", str(checkpoint_dir(trained) / "last.ckpt")])
    assert code == 0, err


# ---------------------------------------------------------------------- log dirs


def test_rerun_into_the_same_log_dir(tmp_path):
    for _ in range(2):
        code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1"])
        assert code == 0, err
    assert (tmp_path / "version_0" / "config.yaml").is_file() and (tmp_path / "version_1" / "config.yaml").is_file()
    assert (checkpoint_dir(tmp_path, 0) / "last.ckpt").is_file() and (checkpoint_dir(tmp_path, 1) / "last.ckpt").is_file()
    # A pinned logger version reuses one directory: the second fresh fit would overwrite the
    # first's checkpoints, so it is refused before training; resuming it is allowed.
    pinned = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                         "init_args": {"save_dir": str(tmp_path), "name": "", "version": "pinned"}})
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1", f"--trainer.logger={pinned}"])
    assert code == 0, err
    first = (tmp_path / "pinned" / "checkpoints" / "last.ckpt").read_bytes()
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=1", f"--trainer.logger={pinned}"])
    assert code == 2 and "already holds checkpoints of an earlier run" in err and "--ckpt_path last" in err
    assert (tmp_path / "pinned" / "checkpoints" / "last.ckpt").read_bytes() == first
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=2", f"--trainer.logger={pinned}",
                            "--ckpt_path", str(tmp_path / "pinned" / "checkpoints" / "last.ckpt")])
    assert code == 0, err
    assert torch.load(tmp_path / "pinned" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2


def test_default_root_dir_follows_the_config_name(tmp_path):
    args = [a for a in tiny_copy_args(tmp_path) if not a.startswith(("--trainer.default_root_dir", "--trainer.logger"))]
    code, _, err = run_cli(["fit", *args, "--trainer.max_steps=1", "--config", "{trainer: {default_root_dir: null}}"],
                           cwd=tmp_path)
    assert code == 0, err
    assert (checkpoint_dir(tmp_path / "logs" / "copy_linear") / "last.ckpt").is_file()
    assert (tmp_path / "logs" / "copy_linear" / "version_0" / "config.yaml").is_file()


# ---------------------------------------------------------------------- precision


def test_resolve_precision():
    assert resolve_precision("16-mixed", "cpu") == "bf16-mixed"
    assert resolve_precision(16, "cpu") == "bf16-mixed"
    assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"
    assert resolve_precision("32-true", "auto") == "32-true"
    assert resolve_precision(None, "cpu") is None
    if not torch.cuda.is_available():
        assert resolve_precision("16-mixed", "auto") == "bf16-mixed"


@pytest.mark.parametrize("precision, backend", [("bf16-mixed", "softmax"), ("16-mixed", "lsh"), ("bf16-mixed", "linear")])
def test_mixed_precision_on_cpu_trains_without_nan(tmp_path, precision, backend):
    code, _, err = run_cli(["fit", *tiny_copy_args(tmp_path, backend), "--trainer.max_steps=4",
                            f"--trainer.precision={precision}"])
    assert code == 0, err
    if precision == "16-mixed":
        assert "using 'bf16-mixed' instead" in err
    saved = yaml.safe_load((tmp_path / "version_0" / "config.yaml").read_text())
    assert saved["trainer"]["precision"] == "bf16-mixed"  # the config records what really ran
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "version_0") if "train/loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    weights = torch.load(checkpoint_dir(tmp_path) / "last.ckpt", weights_only=False)["state_dict"]
    assert all(torch.isfinite(w).all() for w in weights.values())


# ---------------------------------------------------------------------- integer or fraction


@pytest.mark.parametrize("written,batches", [
    (["--trainer.limit_val_batches", "1"], 1),       # one batch, not 100 %
    (["--trainer.limit_val_batches=1"], 1),
    (["--trainer.limit_val_batches", "0.5"], 2),     # half of the 4
    (["--trainer.limit_val_batches", "1.0"], 4),     # all of them
    (["--config", "{trainer: {limit_val_batches: 1}}"], 1),
    (["--config", "{trainer: {limit_val_batches: 1.0}}"], 4),
    (["--config", "{trainer: {limit_val_batches: 1}}", "--trainer.limit_val_batches", "0.25"], 1),  # later wins: 4 * 0.25
])
def test_limit_val_batches_integer_or_fraction_through_the_cli(tmp_path, written, batches):
    """An integer on the command line or in YAML stays an int (a count of batches); a float is a
    fraction. Lightning's float-first type hint turned every one into a float (Lightning issue 21259)."""
    counts = tmp_path / "counts.json"
    callback = json.dumps({"class_path": "conftest.BatchCounter", "init_args": {"path": str(counts)}})
    code, _, err = run_cli([
        "validate", *tiny_copy_args(tmp_path, "linear", "--data.val_batches=4"),
        f"--trainer.callbacks+={callback}", *written,
    ])
    assert code == 0, err
    assert json.loads(counts.read_text())["validate"] == batches


def test_every_count_or_fraction_argument_keeps_its_integer(tmp_path):
    """All five ``int | float`` trainer arguments, as the Trainer receives them."""
    args = [*tiny_copy_args(tmp_path), "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches=1",
            "--trainer.limit_test_batches", "3", "--trainer.limit_predict_batches", "0.5",
            "--config", "{trainer: {val_check_interval: 2}}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        built = LinformerCLI(args=resolve_config_args(args), run=False)
    trainer = built.trainer
    assert (trainer.limit_train_batches, type(trainer.limit_train_batches)) == (2, int)
    assert (trainer.limit_val_batches, type(trainer.limit_val_batches)) == (1, int)
    assert (trainer.limit_test_batches, type(trainer.limit_test_batches)) == (3, int)
    assert (trainer.limit_predict_batches, type(trainer.limit_predict_batches)) == (0.5, float)
    assert (trainer.val_check_interval, type(trainer.val_check_interval)) == (2, int)


def test_task_settings_come_from_the_declared_base():
    """The CLI reads monitor / mode / hparams_free_to_change from :class:`Task`; any other
    LightningModule gets the documented defaults."""
    from linformer_lab.tasks.base import Task, task_settings
    from linformer_lab.tasks.copy_task import CopyTask

    task = CopyTask(d_model=8, n_heads=2, n_layers=1)
    settings = task_settings(task)
    assert (settings.monitor, settings.monitor_mode) == ("val/loss", "min")
    assert settings.hparams_free_to_change == tuple(CopyTask.hparams_free_to_change) and "lr" in settings.hparams_free_to_change
    assert set(settings.hparams_of_the_optimizer) <= set(settings.hparams_free_to_change)
    assert task_settings(L.LightningModule()) == (Task.monitor, Task.monitor_mode, (), ())
    assert task.hparams["attention"] == {"backend": "linear", "feature_map": None, "feature_map_kwargs": {}, "kwargs": {}}


def test_the_process_group_a_ddp_run_leaves_is_closed_before_exit(tmp_path):
    """cli.py closes the process group Lightning keeps after a DDP run (gloo's threads at
    interpreter shutdown could otherwise abort a process whose run succeeded)."""
    import torch.distributed as dist

    from linformer_lab.cli.entry import close_process_group

    close_process_group()  # none open: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    close_process_group()
    assert not dist.is_initialized()
