"""Curves without extra steps (issue 54, items 2 and 4): every fit writes TensorBoard events beside
its ``metrics.csv``, ``cli.py plot`` draws the curves of several runs into one PNG, and a fit
prints no "has no predict split" line (it predicts nothing)."""

from __future__ import annotations

import logging
import logging.handlers
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, run_cli, tiny_mnist_args

from linformer_lab.tasks.curves import fits, metrics_files, plot_runs, run_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def info_lines(during) -> list[str]:
    """What ``rank_zero_info`` logged while ``during()`` ran (Lightning's handler holds the stderr
    of its import, which a test cannot redirect: read the logger instead)."""
    records, log = logging.handlers.BufferingHandler(capacity=10_000), logging.getLogger("lightning.pytorch.utilities.rank_zero")
    log.addHandler(records)
    try:
        during()
    finally:
        log.removeHandler(records)
    return [record.getMessage() for record in records.buffer]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> dict:
    """Two tiny fits on real MNIST, linear and softmax attention, with the default loggers, 4 updates
    each (validation after 2 and 4), in ``logs/mnist_cpu_{linear,softmax}`` of a folder, where the
    docs' plot commands find them: their run roots and what each printed."""
    out = tmp_path_factory.mktemp("runs") / "logs"
    runs = {}
    for method in ("linear", "softmax"):
        args = [f"mnist_{method}.yaml" if a == "mnist_linear.yaml" else a
                for a in tiny_mnist_args(out / f"mnist_cpu_{method}", "--trainer.max_steps=4")]
        found = {}

        def fit():
            found["result"] = run_cli(["fit", *args])
        logged = info_lines(fit)
        code, _, err = found["result"]
        assert code == 0, err
        runs[method] = SimpleNamespace(root=out / f"mnist_cpu_{method}", logged=logged, err=err)
    return runs


@pytest.mark.slow
def test_a_fit_writes_tensorboard_events_beside_its_metrics(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    version = two_runs["linear"].root / "version_0"
    events = list(version.glob("events.out.tfevents.*"))
    assert (version / "metrics.csv").is_file() and len(events) == 1, sorted(p.name for p in version.iterdir())
    reader = EventAccumulator(str(version))
    reader.Reload()
    assert {"train/bits_per_dim", "val/bits_per_dim"} <= set(reader.Tags()["scalars"])
    assert [e.step for e in reader.Scalars("val/bits_per_dim")] == [1, 3]  # the steps metrics.csv logs


@pytest.mark.slow
def test_a_fit_says_nothing_of_a_predict_split(two_runs):
    for run in two_runs.values():
        assert not [line for line in run.logged + run.err.splitlines() if "predict split" in line], run.logged


def test_the_predict_split_is_named_when_predicting():
    """The line the test above looks for is still said where it is true."""
    import lightning as L
    from torch.utils.data import DataLoader

    from linformer_lab.data.sampling import PredictsOnTestSplit

    class Tiny(PredictsOnTestSplit, L.LightningDataModule):
        def test_dataloader(self):
            return DataLoader(range(4))

    data = Tiny()
    assert info_lines(lambda: str(data)) == []  # str() calls every loader method; jsonargparse formats it
    data.trainer = SimpleNamespace(predicting=False)
    assert info_lines(data.predict_dataloader) == []
    data.trainer = SimpleNamespace(predicting=True)
    assert info_lines(data.predict_dataloader) == ["Tiny has no predict split: predicting on its test split"]


@pytest.mark.slow
def test_plot_draws_two_runs_into_a_png(two_runs, tmp_path):
    roots = [two_runs["linear"].root, two_runs["softmax"].root]
    output = tmp_path / "pictures" / "curves.png"
    code, out, err = run_cli(["plot", *map(str, roots), "--output", str(output)])
    assert code == 0, err
    assert out == f"wrote {output}: bits_per_dim of 2 runs (mnist_cpu_linear, mnist_cpu_softmax)\n"
    assert output.read_bytes()[:8] == PNG_SIGNATURE and output.stat().st_size > 10_000
    curves = run_curves(roots[0])
    assert list(curves["val/bits_per_dim"]) == [2, 4] and list(curves["train/bits_per_dim"]) == [1, 2, 3, 4]


def fake_run(root: Path, rows: str) -> Path:
    """A run root with one version whose metrics.csv holds ``rows`` (epoch,step,train/loss,val/loss)."""
    (root / "version_0").mkdir(parents=True)
    (root / "version_0" / "metrics.csv").write_text("epoch,step,train/loss,val/loss\n" + rows)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["README.md", "docs/cli.md"])
def test_the_docs_plot_commands_run_as_shown(two_runs, doc):
    from test_readme import cli_commands

    folder = two_runs["linear"].root.parent.parent  # holds logs/
    commands = [c for c in cli_commands((REPO / doc).read_text()) if c[0] == "plot"]
    assert commands, f"{doc} shows no plot command"
    for command in commands:
        code, out, err = run_cli(command, cwd=folder)
        assert code == 0, f"{doc}: {' '.join(command)}: {err}"
        output = folder / command[command.index("--output") + 1]
        assert out.startswith(f"wrote {command[command.index('--output') + 1]}: bits_per_dim of 2 runs")
        assert output.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_of_runs_as_fit_lays_them_out(tmp_path):
    a = fake_run(tmp_path / "logs" / "copy_linear", "0,0,2.0,\n0,1,1.5,\n0,1,,1.6\n")
    b = fake_run(tmp_path / "logs" / "copy_softmax", "0,0,2.1,\n0,1,1.2,\n0,1,,1.3\n")
    output = tmp_path / "c.png"
    code, out, err = run_cli(["plot", str(a), str(b / "version_0"), "-o", str(output)])
    assert (code, err) == (0, "")
    assert out == f"wrote {output}: loss of 2 runs (copy_linear, copy_softmax/version_0)\n"
    assert output.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_refuses_a_folder_without_metrics_in_one_line(tmp_path):
    run = fake_run(tmp_path / "run", "0,0,2.0,\n")
    code, _, err = run_cli(["plot", str(run), str(tmp_path / "run" / "version_0" / "checkpoints"), "-o", str(tmp_path / "c.png")])
    assert (code, err) == (2, f"error: {tmp_path}/run/version_0/checkpoints: no such run folder (a run root such as "
                              f"logs/NAME, or one of its version_N)\n")
    code, _, err = run_cli(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")])
    assert (code, err) == (2, f"error: {tmp_path}: no metrics.csv in it or in its version_N folders (fit writes them)\n")
    code, _, err = run_cli(["plot", str(run), "--output", str(tmp_path / "c.svg")])
    assert code == 2 and err.startswith("error: --output") and "ending in .png" in err
    assert not list(tmp_path.glob("c.*"))


def test_a_run_root_reads_its_versions_in_numeric_order(tmp_path):
    for version, rows in ((10, "0,9,1.0,\n"), (9, "0,9,2.0,\n0,19,1.5,\n")):
        folder = tmp_path / f"version_{version}"
        folder.mkdir()
        (folder / "metrics.csv").write_text("epoch,step,train/loss,val/loss\n" + rows)
    assert [p.parent.name for p in metrics_files(tmp_path)] == ["version_9", "version_10"]
    assert run_curves(tmp_path) == {"train/loss": {10: 1.0, 20: 1.5}}  # the resumed version wins at step 9
    assert metrics_files(Path(tmp_path / "version_9")) == [tmp_path / "version_9" / "metrics.csv"]


@pytest.mark.slow
def test_plot_imports_neither_torch_nor_lightning(tmp_path):
    import subprocess
    import sys

    run = fake_run(tmp_path / "run", "0,0,2.0,\n0,0,,1.9\n")
    script = ("import sys; from linformer_lab.cli.entry import main; "
              f"code = main(['plot', {str(run)!r}, '-o', {str(tmp_path / 'c.png')!r}]); "
              "print(code, [m for m in ('torch', 'lightning') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr


def test_a_misspelt_plot_is_suggested():
    """``cli.py plto`` names ``plot`` with the other subcommands, in one line, before Lightning loads."""
    code, _, err = run_cli(["plto", "logs"])
    assert code == 2 and "unknown subcommand 'plto'; did you mean plot?" in err and "\n" not in err.strip()


def test_plot_runs_from_python_draws_what_the_cli_draws(tmp_path):
    """``linformer_lab.plot_runs`` (the public name) writes the PNG ``cli.py plot`` writes and
    returns its metrics and legend names."""
    import linformer_lab as ll

    run = fake_run(tmp_path / "run", "0,0,2.0,\n0,0,,1.9\n0,1,1.5,\n0,1,,1.4\n")
    metrics, names = ll.plot_runs([run], tmp_path / "py.png", title="one run")
    code, out, _ = run_cli(["plot", str(run), "-o", str(tmp_path / "cli.png"), "--title", "one run"])
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'cli.png'}: {', '.join(metrics)} of 1 run ({names[0]})")
    assert (tmp_path / "py.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (tmp_path / "py.png").stat().st_size == (tmp_path / "cli.png").stat().st_size


def fake_version(root: Path, version: int, rows: str, config: str) -> None:
    """``root/version_N`` with ``metrics.csv`` rows (epoch,step,train/loss,val/loss) and a saved
    config holding the top-level lines ``config`` (what LightningCLI writes for each subcommand)."""
    folder = root / f"version_{version}"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text("epoch,step,train/loss,val/loss\n" + rows)
    (folder / "config.yaml").write_text("seed_everything: 0\ntrainer:\n  max_steps: 4\n" + config)


def test_a_run_root_draws_its_newest_fit_and_no_evaluation(tmp_path):
    """A run root gathers every command run with its config. An evaluation's ``val/`` value (logged
    at step 0) was drawn as the fit's first update, and two separate fits were drawn as one curve,
    the later's values overwriting the earlier's where both logged."""
    root = tmp_path / "logs" / "copy_linear"
    fake_version(root, 0, "0,1,2.0,\n0,1,,1.9\n0,3,1.5,\n0,3,,1.4\n", "ckpt_path: null\n")
    fake_version(root, 1, "0,0,,1.4\n", "ckpt_path: best\nverbose: true\n")  # validate
    fake_version(root, 2, "0,0,,1.41\n", "ckpt_path: best\nverbose: true\n")  # test's columns are test/
    fake_version(root, 3, "0,5,1.2,\n0,5,,1.1\n", "ckpt_path: last\n")  # the fit resumed
    fake_version(root, 4, "", "ckpt_path: best\nreturn_predictions: null\n")  # predict
    assert [[p.parent.name for p in fit] for fit in fits(root)] == [["version_0", "version_3"]]
    assert run_curves(root) == {"train/loss": {2: 2.0, 4: 1.5, 6: 1.2}, "val/loss": {2: 1.9, 4: 1.4, 6: 1.1}}
    fake_version(root, 5, "0,1,3.0,\n", "ckpt_path: null\n")  # a new fit, not a continuation
    assert [[p.parent.name for p in fit] for fit in fits(root)] == [["version_0", "version_3"], ["version_5"]]
    assert run_curves(root) == {"train/loss": {2: 3.0}}
    (root / "version_6").mkdir()  # a new fit that has logged nothing yet: the one before is not the newest
    (root / "version_6" / "config.yaml").write_text("ckpt_path: null\n")
    fake_version(root, 7, "0,9,0.5,\n", "ckpt_path: last\n")  # ... and its resume
    assert [[p.parent.name for p in fit] for fit in fits(root)][1:] == [["version_5"], ["version_7"]]
    shutil.rmtree(root / "version_6")
    shutil.rmtree(root / "version_7")
    output = tmp_path / "c.png"
    code, out, err = run_cli(["plot", str(root), "-o", str(output)])
    assert (code, err) == (0, "")
    assert out == f"wrote {output}: loss of 1 run (copy_linear/version_5)\n"  # which fit was drawn
    code, _, err = run_cli(["plot", str(root / "version_4"), "-o", str(output)])
    assert (code, err) == (2, f"error: {root / 'version_4'}: holds evaluations only (validate, test, predict), "
                              f"no fit: no curves to draw\n")


def test_a_lone_point_is_drawn_with_a_marker(tmp_path, monkeypatch):
    """A fit shorter than its logging interval logs one training value: a line without a marker
    through one point draws nothing."""
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    run = fake_run(tmp_path / "run", "0,49,2.0,\n0,29,,1.9\n0,59,,1.5\n")
    plot_runs([run], tmp_path / "c.png")
    lines = {line.get_label(): line for line in drawn[0].axes[0].get_lines()}
    assert lines["run (train)"].get_marker() == "o" and len(lines["run (train)"].get_xdata()) == 1
    assert lines["run (val)"].get_marker() == "o"


@pytest.mark.slow
def test_the_cli_leaves_what_a_run_root_is_read_by(two_runs, tmp_path):
    """The saved configs through the real CLI: validate and predict are told from fits, a resume
    continues its fit, a new fit starts another (the configs above are modelled on these)."""
    root = tmp_path / "mnist_cpu_linear"
    shutil.copytree(two_runs["linear"].root, root)
    args = tiny_mnist_args(root)
    for command in (["validate", *args, "--ckpt_path", "best"],
                    ["predict", *args, "--ckpt_path", "best", "--trainer.limit_predict_batches=1", "--data.batch_size=1"],
                    ["fit", *args, "--ckpt_path", "last", "--trainer.max_steps=6"],
                    ["fit", *args, "--trainer.max_steps=2"]):
        code, _, err = run_cli(command)
        assert code == 0, f"{command[0]}: {err}"
    assert [[p.parent.name for p in fit] for fit in fits(root)] == [["version_0", "version_3"], ["version_4"]]
    assert list(run_curves(root)["val/bits_per_dim"]) == [2]
    assert list(run_curves(root / "version_0")["val/bits_per_dim"]) == [2, 4]
