"""Paper Table 3 (CTC phoneme recognition, §4.3) at CPU scale: PER to convergence and time per epoch.

    uv run python benchmarks/paper/speech_table3.py                        # the documented run
    uv run python benchmarks/paper/speech_table3.py --models linear --skip-long   # one model

1. **Training** through the README's command: ``cli.py fit --config configs/speech_cpu_<model>.yaml``
   for linear, softmax, lsh4 and bilstm (``--parallel`` at a time, ``--threads`` torch threads
   each; same corpus, same number of updates), then ``cli.py test --ckpt_path best``. The
   runs log into ``--state-dir``/<model>/ (CSV); a model whose test result is there is not
   trained again (``--fresh`` retrains). Read back: validation PER per epoch with the update
   count, training epoch time, test PER; "converged" = the best validation PER of the last
   fifth of the epochs is no better than the best before.
2. **Long utterances**: the paper's WSJ has 800 frames on average and up to 2,400; our
   synthetic sentences average ~420. To show where softmax's O(N^2) cost bites, training
   utterances are concatenated into sequences of 1,500-2,400 frames (``--long-sequences`` of
   them, batches of 4) and one epoch of training steps over them is timed; the same
   utterances in their natural lengths (batches of 4 of similar length) are timed too, so
   ``long / natural`` isolates the effect of sequence length at equal frames. The models are
   the configs' (fresh weights), timed interleaved batch by batch, process CPU time on one
   thread beside wall time.

Results: ``benchmarks/paper/results/speech_table3.{csv,md,png}`` (the PNG: validation PER against
updates, all models), written by ``speech_table3_report.py``. About 50 min on 2 cores (lsh-4 is the
slowest to train).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import load_line, results_dir  # noqa: E402
from speech_table3_report import LONG_SETS, ORDER, write_report  # noqa: E402


def config_path(name: str) -> Path:
    return REPO / "configs" / f"speech_cpu_{name}.yaml"


def model_kwargs(name: str, args=None) -> dict:
    """SpeechRecognitionTask arguments of each model: the ``model.init_args`` of its
    ``configs/speech_cpu_<name>.yaml``, so the timing runs use exactly the trained models."""
    import yaml

    from linformer_lab.attention.config import AttentionConfig

    kwargs = dict(yaml.safe_load(config_path(name).read_text())["model"]["init_args"])
    if "attention" in kwargs:
        kwargs["attention"] = AttentionConfig(**kwargs["attention"])
    return kwargs


def build_model(name: str, args=None):
    import lightning as L

    from linformer_lab.tasks.speech import SpeechRecognitionTask

    L.seed_everything(0, verbose=False)
    return SpeechRecognitionTask(**model_kwargs(name, args))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ 1. training (through the CLI)


def run_dir(name: str, args) -> Path:
    return Path(args.state_dir) / name


def cli_commands(name: str, args) -> list[list[str]]:
    """The README's command for this model (``cli.py fit --config speech_cpu_<name>.yaml``) with
    its logs under ``run_dir``, then ``cli.py test`` of the best checkpoint."""
    root = str(run_dir(name, args))
    common = ["--config", str(config_path(name)), f"--trainer.default_root_dir={root}",
              f"--trainer.logger.init_args.save_dir={root}", "--trainer.enable_progress_bar=false"]
    return [[sys.executable, str(REPO / "cli.py"), "fit", *common],
            [sys.executable, str(REPO / "cli.py"), "test", *common, "--ckpt_path=best"]]


def max_epochs(name: str) -> int:
    import yaml

    return int(yaml.safe_load(config_path(name).read_text())["trainer"]["max_epochs"])


def train_all(names: list[str], args) -> None:
    """Fit + test every model, ``--parallel`` at a time, each with ``--threads`` torch threads.
    A model whose test result is there and whose epochs reach the config's ``max_epochs`` is
    skipped; one with fewer epochs (the config was raised) resumes from its ``last.ckpt``
    (``--ckpt_path last``: optimizer, schedule and data order continue as if never stopped)."""
    import shutil
    import subprocess

    def needs_training(name):
        done = collect(name, args)
        return args.fresh or done.get("test_per") is None or done.get("epochs_done", 0) < max_epochs(name)

    todo = [n for n in names if needs_training(n)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    running: list[tuple[str, subprocess.Popen, list, float, object]] = []
    while todo or running:
        while todo and len(running) < args.parallel:
            name = todo.pop(0)
            if args.fresh and run_dir(name, args).exists():
                shutil.rmtree(run_dir(name, args))
            run_dir(name, args).mkdir(parents=True, exist_ok=True)
            commands = cli_commands(name, args)
            if (run_dir(name, args) / "checkpoints" / "last.ckpt").exists():
                commands[0].append("--ckpt_path=last")
            log = open(run_dir(name, args) / "cli.log", "a")  # noqa: SIM115 (open while the run lives; closed when it ends)
            print(f"{name}: {' '.join(commands[0][1:])}  ({load_line()})", flush=True)
            running.append((name, subprocess.Popen(commands[0], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO),
                            commands[1:], time.perf_counter(), log))
        time.sleep(5)
        for entry in list(running):
            name, proc, rest, start, log = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            if proc.returncode != 0:
                print(f"{name}: failed with exit code {proc.returncode}, see {run_dir(name, args) / 'cli.log'}", flush=True)
                log.close()
                continue
            if rest:
                with open(run_dir(name, args) / "fit_wall_s.txt", "a") as f:  # one line per invocation
                    f.write(f"{time.perf_counter() - start:.1f}\n")
                running.append((name, subprocess.Popen(rest[0], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO),
                                rest[1:], time.perf_counter(), log))
            else:
                log.close()
                print(f"{name}: done, {collect(name, args)}", flush=True)


def collect(name: str, args) -> dict:
    """What the CLI runs of ``name`` logged: per-epoch validation PER with the update count,
    training epoch times, test PER; {} if nothing yet."""
    import csv

    root = run_dir(name, args)
    out: dict = {}
    by_epoch: dict[int, tuple[int, int, float]] = {}  # a resumed fit logs into a new version: merged
    times: list[float] = []
    for metrics in sorted(root.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        rows = list(csv.DictReader(metrics.open()))
        for r in rows:
            if r.get("val/per"):
                by_epoch[int(r["epoch"])] = (int(r["step"]) + 1, int(r["epoch"]), float(r["val/per"]))
        times += [float(r["train/epoch_time_s"]) for r in rows if r.get("train/epoch_time_s")]
        test = [r for r in rows if r.get("test/per")]
        if test:
            out["test_per"], out["test_loss"] = float(test[-1]["test/per"]), float(test[-1]["test/loss"])
    if by_epoch:
        val = [by_epoch[e] for e in sorted(by_epoch)]
        out.update({"val_curve": val, "val_per_history": [v for _, _, v in val], "val_per": val[-1][2],
                    "epochs_done": len(val), "updates": val[-1][0], "epoch_wall_s": sum(times) / max(len(times), 1)})
    wall = root / "fit_wall_s.txt"
    if wall.exists():
        out["fit_wall_s"] = sum(float(x) for x in wall.read_text().split())
    return out


# ------------------------------------------------------------------ 2. long utterances


def long_and_natural_batches(dataset, n_sequences: int, batch: int = 4, low: int = 1500, high: int = 2400):
    """Concatenate consecutive utterances into ``n_sequences`` sequences of ``low..high`` frames.

    Returns ``(long_batches, natural_batches, frames)``: collated batches of the long sequences
    and of the same utterances at their own lengths (sorted by length, so padding is small in
    both), and the number of real frames (equal in both).
    """
    import torch

    from linformer_lab.data.speech import collate_speech

    sequences, used, current = [], [], []
    i = 0
    while len(sequences) < n_sequences and i < len(dataset):
        item = dataset[i]
        i += 1
        if sum(x["features"].shape[0] for x in current) + item["features"].shape[0] > high:
            current = []  # would overshoot: start again from this utterance
        current.append(item)
        if sum(x["features"].shape[0] for x in current) >= low:
            sequences.append({
                "features": torch.cat([x["features"] for x in current]),
                "targets": torch.cat([x["targets"] for x in current]),
            })
            used.extend(current)
            current = []
    sequences.sort(key=lambda x: -x["features"].shape[0])
    used.sort(key=lambda x: -x["features"].shape[0])
    long_batches = [collate_speech(sequences[j : j + batch]) for j in range(0, len(sequences), batch)]
    natural_batches = [collate_speech(used[j : j + batch]) for j in range(0, len(used), batch)]
    frames = sum(int(x["features"].shape[0]) for x in sequences)
    return long_batches, natural_batches, frames


def padded_fraction(batches) -> float:
    """Share of the padded (computed) frames of ``batches`` that are padding."""
    real = sum(int(b["feature_lengths"].sum()) for b in batches)
    padded = sum(int(b["features"].shape[0] * b["features"].shape[1]) for b in batches)
    return 1.0 - real / padded



def time_long_utterances(names: list[str], args, dataset, prefix: str = "", low: int = 1500, high: int = 2400) -> dict:
    """One epoch of training steps over the long set (sequences of ``low..high`` frames) and over
    the same frames at natural length, for every model, interleaved batch by batch (rotating
    which model goes first). Keys start with ``prefix``."""
    import torch

    long_batches, natural_batches, frames = long_and_natural_batches(dataset, args.long_sequences, low=low, high=high)
    lengths = [int(b["feature_lengths"].max()) for b in long_batches]
    print(f"  long set: {len(long_batches) * 4} sequences in {len(long_batches)} batches of 4, "
          f"{frames} frames, longest per batch {lengths}; natural: {len(natural_batches)} batches", flush=True)
    models = {n: build_model(n, args) for n in names}
    optimizers = {n: torch.optim.Adam(m.parameters(), lr=1e-4) for n, m in models.items()}

    def step(name: str, batch) -> tuple[float, float]:
        model, optimizer = models[name], optimizers[name]
        w, c = time.perf_counter(), time.process_time()
        loss = model.ctc_loss(batch)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - w, time.process_time() - c

    out = {n: {} for n in names}
    for label, batches in (("long", long_batches), ("natural", natural_batches)):
        for n in names:  # warm-up (allocator, kernel selection), not timed
            models[n].train()
            step(n, batches[-1])
        totals = {n: [0.0, 0.0] for n in names}
        for j, batch in enumerate(batches):
            for k in range(len(names)):
                n = names[(j + k) % len(names)]
                wall, cpu = step(n, batch)
                totals[n][0] += wall
                totals[n][1] += cpu
        for n in names:
            out[n][f"{prefix}{label}_epoch_wall_s"], out[n][f"{prefix}{label}_epoch_cpu_s"] = totals[n]
            print(f"    {prefix}{label:7s} {n:8s}: {totals[n][0]:.1f} s wall, {totals[n][1]:.1f} s CPU", flush=True)
    for n in names:
        out[n][f"{prefix}long_frames"] = frames
        out[n][f"{prefix}long_max_frames"] = max(lengths)
    return out


def padding_note(results: dict, args, train_set) -> str:
    """How much of the long and the natural batches is padding, for the report (empty when nothing was timed)."""
    if train_set is None or not any("long_frames" in r for r in results.values()):
        return ""
    long_b, natural_b, _ = long_and_natural_batches(train_set, args.long_sequences)
    return (f" Padding: {100 * padded_fraction(long_b):.1f}% of the computed frames of the long batches, "
            f"{100 * padded_fraction(natural_b):.1f}% of the natural ones.")


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=ORDER, choices=ORDER)
    parser.add_argument("--parallel", type=int, default=2, help="models trained at once")
    parser.add_argument("--long-sequences", type=int, default=16)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per training process and for the timing")
    parser.add_argument("--state-dir", default=str(REPO / "logs" / "speech_table3"))
    parser.add_argument("--fresh", action="store_true", help="retrain models that have results already")
    parser.add_argument("--out", default=str(results_dir(__file__) / "speech_table3"))
    args = parser.parse_args(argv)

    import torch
    import yaml

    # One thread: on the shared 2-core machine two OpenMP threads spin-wait on each other
    # (measured 10-50x slower under load); CPU time is then also the model's compute time.
    torch.set_num_threads(args.threads)
    from linformer_lab.data.speech import SpeechDataModule

    data_args = yaml.safe_load(config_path("linear").read_text())["data"]["init_args"]
    args.hours, args.batch_size = data_args["hours"], data_args["batch_size"]
    datamodule = SpeechDataModule(hours=args.hours, seed=data_args["seed"], batch_size=args.batch_size, progress=False)
    datamodule.prepare_data()
    datamodule.setup()
    train_set = datamodule.datasets["train"]
    corpus = {
        "train_hours": float(train_set.lengths.sum()) / 360000.0,  # 100 frames per second
        "train_frames": int(train_set.lengths.sum()),
        "train_utts": len(train_set),
        "val_utts": len(datamodule.datasets["val"]),
        "test_utts": len(datamodule.datasets["test"]),
        "mean_frames": float(train_set.lengths.mean()),
        "max_frames": int(max(int(datamodule.datasets[s].lengths.max()) for s in ("train", "val", "test"))),
    }
    print(f"corpus: {corpus}", flush=True)

    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    timing_file = state_dir / "long_utterances.json"
    results: dict = {}
    if timing_file.exists() and not args.fresh:
        results = json.loads(timing_file.read_text())
    names = [n for n in ORDER if n in args.models]
    if not args.skip_training:
        train_all(list(dict.fromkeys(args.models)), args)  # in the order given: the slowest first balances the pool
    for n in ORDER:
        results.setdefault(n, {}).update(collect(n, args))
        if results[n].get("epochs_done"):
            results[n]["params"] = n_params(build_model(n))
    if not args.skip_long:
        for prefix, low, high in LONG_SETS:
            todo = [n for n in names if f"{prefix}long_epoch_cpu_s" not in results.get(n, {})]
            if todo:
                print(f"long utterances {low}-{high} frames: timing {todo} ({load_line()})", flush=True)
                for n, r in time_long_utterances(todo, args, train_set, prefix, low, high).items():
                    results.setdefault(n, {}).update(r)
        timing = {n: {k: v for k, v in r.items() if "long" in k or "natural" in k} for n, r in results.items()}
        timing_file.write_text(json.dumps(timing, indent=1))
    results = {n: r for n, r in results.items() if r}
    write_report(results, args, corpus, padding_note(results, args, train_set))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
