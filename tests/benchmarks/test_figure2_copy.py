"""benchmarks/paper/figure2_copy.py (Fig. 2, the copy task): its commands train through the real CLI,
runs resume from their checkpoints, and invocations merge their results."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "paper"))
try:
    import figure2_copy
finally:
    sys.path.remove(str(REPO / "benchmarks" / "paper"))


class InThisThread:
    """A ThreadPoolExecutor's ``map`` in the calling thread, one item after another (the CLI sets
    signal handlers, which only the main thread may)."""

    def __init__(self, max_workers: int):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def map(self, fn, items):
        return [fn(item) for item in items]


@pytest.fixture
def runs_in_this_process(monkeypatch):
    """figure2_copy.py's runs (``python cli.py fit ...``, its train()) call cli.py's main in this
    process with the same arguments, one at a time: a process start costs more than these runs.
    The runs as child processes, with the environment train() gives them: the GPU command's dry
    run (tests/benchmarks/test_gpu_check.py runs figure2_copy.py --quick as a process)."""
    def run(command, cwd, env, capture_output, text):
        assert command[:2] == [sys.executable, "cli.py"] and env["OMP_NUM_THREADS"] == "1", command
        code, out, err = run_cli(command[2:], cwd=cwd)
        return subprocess.CompletedProcess(command, code, out, err)

    monkeypatch.setattr(figure2_copy, "subprocess", SimpleNamespace(run=run))
    for module in (figure2_copy, figure2_copy.figure2_matrix):
        monkeypatch.setattr(module, "ThreadPoolExecutor", InThisThread)


@pytest.mark.slow
def test_figure2_merge_keeps_the_runs_of_earlier_invocations(tmp_path):
    """figure2_copy.py --merge: a second invocation (other methods) rewrites the results with the first
    invocation's runs read back from its CSVs, curves and commands intact; --max-minutes reaches the
    command line as Lightning's max_time, and a run stopped by it is reported so."""
    first = figure2_copy.parse_args(["--methods", "softmax", "--steps", "30", "--max-minutes", "90"])
    assert "--trainer.max_time=00:01:30:00" in figure2_copy.run_command("softmax", first, tmp_path)
    days = figure2_copy.parse_args(["--max-minutes", "6000"])
    assert "--trainer.max_time=04:04:00:00" in figure2_copy.run_command("softmax", days, tmp_path)

    def run(method, steps, loss):  # a run of 20 minutes' limit, at one update a minute
        rows = [{"step": s - 1, "train/loss": loss / s} for s in range(10, steps + 1, 10)]
        rows.append({"step": steps - 1, "val/loss": loss, "val/accuracy": 0.5})
        command = ["python", "cli.py", "fit", "--trainer.max_time=00:00:20:00", f"--x={method} a"]
        return {"method": method, "command": command, "seconds": 60.0 * steps, "rows": rows}

    figure2_copy.write_results([run("softmax", 30, 2.0)], first, tmp_path)
    second = figure2_copy.parse_args(["--methods", "linear", "lsh1", "--steps", "30", "--merge"])
    kept = figure2_copy.earlier_runs(tmp_path, "figure2_copy", skip=["linear", "lsh1"])
    assert [k["method"] for k in kept] == ["softmax"] and kept[0]["command"][-1] == "--x=softmax a"
    figure2_copy.write_results(kept, first, tmp_path / "again")  # read back as written: the same files
    for name in ("figure2_copy.csv", "figure2_copy_runs.csv"):
        assert (tmp_path / "again" / name).read_text() == (tmp_path / name).read_text()
    figure2_copy.write_results(kept + [run("linear", 20, 3.0), run("lsh1", 10, 4.0)], second, tmp_path)
    text = (tmp_path / "figure2_copy.md").read_text()
    assert "| softmax | 30 | 30 updates | 2.0000 |" in text and "| linear | 20 | time limit (20 min) | 3.0000 |" in text
    assert "| lsh1 | 10 | not finished (continues with --resume) |" in text  # stopped before its limit: a signal
    assert "softmax (2.000) < linear (3.000) < lsh1 (4.000)" in text
    assert "with the runs of softmax kept from an earlier invocation (--merge)" in text
    figure2_copy.write_results([run("linear", 20, 3.0)], second, tmp_path / "all")  # --merge that kept nothing says nothing
    assert "kept from an earlier invocation" not in (tmp_path / "all" / "figure2_copy.md").read_text()
    (tmp_path / "figure2_copy.md").unlink()
    figure2_copy.main(["--report-only", "--steps", "30", "--out", str(tmp_path)])  # the report again, from the CSVs
    assert (tmp_path / "figure2_copy.md").read_text().count("| softmax | 30 | 30 updates | 2.0000 |") == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["softmax", "linear", "lsh1", "lsh4"])
def test_figure2_command_trains_through_the_real_cli(tmp_path, method):
    """The exact ``cli.py fit`` command figure2_copy.py runs, at a tiny scale and with --n-heads, trains
    and logs the curve the report reads (a flag that the CLI rejected or dropped would fail here)."""
    args = figure2_copy.parse_args(["--methods", method, "--steps", "4", "--val-every", "2", "--val-batches", "1",
                                    "--max-length", "8", "--d-model", "16", "--n-heads", "2", "--batch-size", "4",
                                    "--bucket-size", "4", "--n-buckets", "4", "--dropout", "0.1", "--min-length", "3"])
    command = figure2_copy.run_command(method, args, tmp_path)
    assert {"--model.n_heads=2", "--model.dropout=0.1", "--data.min_length=3"} <= set(command)
    # cli.py's main in this process (the same arguments; a process start per method costs more than its run)
    assert command[:3] == [sys.executable, "cli.py", "fit"]
    code, _, err = run_cli(command[2:], cwd=REPO)
    assert code == 0, err[-2000:]
    with open(tmp_path / method / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert max(int(r["step"]) for r in rows) + 1 == 4
    assert sum(1 for r in rows if r.get("val/loss")) == 2
    config = yaml.safe_load((tmp_path / method / "version_0" / "hparams.yaml").read_text())
    assert config["n_heads"] == 2 and config["d_model"] == 16 and config["dropout"] == 0.1


def test_figure2_device_flags_reach_the_command(tmp_path, monkeypatch):
    """--accelerator, --precision and --dropout become the trainer's and model's settings; the defaults
    keep the CPU settings of the committed results (fp32, one CPU, no dropout, lengths from 1)."""
    default = figure2_copy.run_command("linear", figure2_copy.parse_args([]), tmp_path)
    assert "--trainer.accelerator=cpu" in default and "--trainer.precision=32-true" in default
    assert {"--model.dropout=0.0", "--data.min_length=1"} <= set(default)  # always given: the configs' differ
    gpu = figure2_copy.parse_args(["--accelerator", "cuda", "--precision", "bf16-mixed", "--dropout", "0.1"])
    command = figure2_copy.run_command("lsh4", gpu, tmp_path)
    assert {"--trainer.accelerator=cuda", "--trainer.precision=bf16-mixed", "--model.dropout=0.1"} <= set(command)
    with pytest.raises(SystemExit):
        figure2_copy.parse_args(["--accelerator", "tpu"])
    cpu = figure2_copy.machine_info()["cpu"]
    assert figure2_copy.device_line(figure2_copy.parse_args([])).startswith(cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU 80GB")
    assert figure2_copy.device_line(gpu).startswith(f"Some GPU 80GB (host: {cpu}")


@pytest.mark.slow
def test_figure2_runs_resume_from_their_checkpoints(tmp_path, runs_in_this_process):
    """figure2_copy.py through the real CLI: a run writes last.ckpt every --save-every updates; --resume
    continues it (a new version, the same checkpoint) to more updates; --from-logs reports the curve of
    both versions with the seconds of Lightning's Timer from the checkpoint (over both invocations)."""
    small = ["--methods", "linear", "--max-length", "4", "--batch-size", "4", "--d-model", "16", "--val-batches", "1",
             "--val-every", "2", "--decay-at", "2", "--max-minutes", "30", "--jobs", "1",
             "--log-root", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]
    figure2_copy.main([*small, "--steps", "4", "--save-every", "3"])
    root = tmp_path / "logs" / "linear"
    assert (root / "version_0" / "checkpoints" / "last.ckpt").exists()
    first = (tmp_path / "out" / "figure2_copy_runs.csv").read_text()
    assert first.splitlines()[1].startswith("linear,4,") and "--ckpt_path" not in first
    figure2_copy.main([*small, "--steps", "6", "--resume"])
    assert not list(root.glob("version_1/checkpoints")), "a resumed run writes into the checkpoints it resumes"
    steps = [int(line.split(",")[1]) for line in (tmp_path / "out" / "figure2_copy.csv").read_text().splitlines()[1:]]
    assert max(steps) == 6 and 2 in steps and 4 in steps  # the first version's updates are kept
    assert "--ckpt_path=last" in (tmp_path / "out" / "figure2_copy_runs.csv").read_text()
    run = figure2_copy.logged_run("linear", [], tmp_path / "logs")
    assert 0 < run["seconds"] < 600 and figure2_copy.updates(run) == 6
    figure2_copy.main([*small, "--steps", "10", "--from-logs", "--name", "partial"])
    assert "| linear | 6 | not finished (continues with --resume) |" in (tmp_path / "out" / "partial.md").read_text()


def test_paper_preset_runs_the_papers_shape_with_both_recipes_in_fp32_and_bf16(tmp_path):
    """--paper: 32-62 symbols, d_model 256 in 8 heads, batch 64, dropout 0.1, 10,000 updates, lr drop at
    3,000; softmax and linear; each run with its recipe's config, its precision and the no-dropout loss."""
    args = figure2_copy.parse_args(["--paper", "--accelerator", "cuda"])
    cells = figure2_copy.figure2_matrix.variants(args)
    assert [(v.recipe, v.precision) for v, _ in cells] == [("ours", "32-true"), ("ours", "bf16-mixed"),
                                                         ("authors", "32-true"), ("authors", "bf16-mixed")]
    assert args.methods == ["softmax", "linear"] and args.name == "figure2_paper"
    for variant, root in cells:
        for method in args.methods:
            command = figure2_copy.run_command(method, variant, root)
            config = f"configs/copy_{'authors_' if variant.recipe == 'authors' else ''}{method}.yaml"
            assert command[command.index("--config") + 1] == config
            assert {"--data.min_length=32", "--data.max_length=62", "--model.d_model=256", "--model.n_heads=8",
                    "--data.batch_size=64", "--model.dropout=0.1", "--trainer.max_steps=10000",
                    "--model.lr_decay_steps=3000", f"--trainer.precision={variant.precision}",
                    "--trainer.accelerator=cuda"} <= set(command)
            assert any(a.startswith("--trainer.callbacks+=") and "figure2_matrix.LossWithoutDropout" in a for a in command)
    assert figure2_copy.parse_args(["--paper", "--steps", "50"]).steps == 50  # a flag given wins over the preset
    with pytest.raises(SystemExit):
        figure2_copy.parse_args(["--recipe", "authors", "--methods", "lsh1"])  # no authors' config for lsh
    timed = figure2_copy.parse_args(["--max-minutes", "1.5"])
    assert "--trainer.max_time=00:00:01:30" in figure2_copy.run_command("linear", timed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_the_loss_without_dropout_is_the_training_loss_when_nothing_drops(tmp_path, dropout):
    """LossWithoutDropout logs the loss of the batch about to be trained on, same weights, eval mode: with
    no dropout it is the training loss itself (the same number at every logged step); with dropout not."""
    import lightning as L
    from conftest import read_metrics
    from lightning.pytorch.loggers import CSVLogger

    from linformer_lab.data.copy import CopyDataModule
    from linformer_lab.tasks.copy_task import CopyTask

    L.seed_everything(0)
    data = CopyDataModule(min_length=2, max_length=6, batch_size=4, train_batches_per_epoch=4, val_batches=1)
    task = CopyTask(vocab_size=data.vocab_size, sequence_length=data.sequence_length, d_model=16, n_heads=2,
                    n_layers=1, dropout=dropout)
    trainer = L.Trainer(max_steps=4, log_every_n_steps=1, accelerator="cpu", logger=CSVLogger(tmp_path, name=""),
                        callbacks=[figure2_copy.figure2_matrix.LossWithoutDropout()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(task, data)
    rows = [r for r in read_metrics(tmp_path / "version_0") if "train/loss" in r]
    assert len(rows) == 4 and all("train/loss_no_dropout" in r for r in rows)
    gaps = [abs(r["train/loss"] - r["train/loss_no_dropout"]) for r in rows]
    if dropout == 0:
        assert max(gaps) < 1e-6
    else:
        assert min(gaps) > 1e-4


@pytest.mark.slow
def test_quick_matrix_trains_both_recipes_through_the_cli(tmp_path, runs_in_this_process):
    """--quick: the paper's matrix at toy size through cli.py fit (here reduced to linear in bf16), both
    recipes; the summary, each recipe's report and curve with and without dropout."""
    out = tmp_path / "out"
    figure2_copy.main(["--quick", "--methods", "linear", "--precisions", "bf16-mixed", "--jobs", "2", "--out", str(out),
                       "--log-root", str(tmp_path / "logs")])
    with open(out / "figure2_quick_summary.csv") as f:
        summary = {r["recipe"]: r for r in csv.DictReader(f)}
    assert set(summary) == {"ours", "authors"}
    for recipe, row in summary.items():
        assert row["updates"] == "4" and row["precision"] == "bf16-mixed" and not row["error"]
        assert float(row["train_loss"]) > 0 and float(row["train_loss_no_dropout"]) > 0
        curve = (out / f"figure2_quick_{recipe}_bf16.csv").read_text().splitlines()
        assert curve[0] == "method,step,train_loss,val_loss,val_accuracy,train_loss_no_dropout"
        assert sum(1 for line in curve[1:] if line.split(",")[5]) == 4  # logged at every update
        assert f"copy_{'authors_' if recipe == 'authors' else ''}linear.yaml" in \
            (out / f"figure2_quick_{recipe}_bf16_runs.csv").read_text()
    assert "| authors | bf16-mixed | linear | 4 |" in (out / "figure2_quick.md").read_text()
