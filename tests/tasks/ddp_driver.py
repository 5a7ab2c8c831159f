"""Runs several ``cli.py`` commands in each process of one ``torchrun`` job, and the tests' side of
such jobs (tests/tasks/test_ddp*.py: :func:`run_job` starts one and waits for it).

    torchrun ... ddp_driver.py PLAN.json

``PLAN.json`` holds ``{"commands": [[ARG, ...], ...]}`` (or ``{"args": [ARG, ...], "exit_code": N}``
for a command that should end with code N): every process runs the commands in order
through ``linformer_lab.cli.entry.main``, as ``python cli.py ARG ...`` would, the Trainer of each finding
the job's process group (torchrun's environment) instead of starting processes of its own. One
job then holds a whole story (fit, stop, resume, validate, test, predict) and pays the start of
its processes once. A command that fails ends the process with its exit code, which makes
torchrun end the others: no process waits on a partner that is gone.

:class:`SaveWeights` (``--trainer.callbacks+=ddp_driver.SaveWeights``) writes each process's
weights at the end of training, so a test sees that the processes hold the same model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch

TASKS = Path(__file__).resolve().parent
REPO = TASKS.parents[1]


class SignalRank(L.Callback):
    """Sends process ``rank`` SIGTERM at the start of update ``step`` (1-based): a preemption of one process."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


class SaveWeights(L.Callback):
    """At the end of training writes ``{prefix}rank{global rank}.pt``: the module's state_dict."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(pl_module.state_dict(), f"{self.prefix}rank{trainer.global_rank}.pt")


def save_weights(prefix: Path) -> str:
    """A ``--trainer.callbacks+=`` argument: every process writes its weights to ``{prefix}rankN.pt``."""
    callback = {"class_path": "ddp_driver.SaveWeights", "init_args": {"prefix": str(prefix)}}
    return f"--trainer.callbacks+={json.dumps(callback)}"


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(got: dict, want: dict, atol: float = 0.0) -> None:
    assert got.keys() == want.keys()
    for name in want:
        error = (got[name] - want[name]).abs().max().item()
        assert error <= atol, f"{name} differs by {error:.3g}"


def metrics(run_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of the logged ``key`` in ``run_dir/metrics.csv`` (a ``version_N`` folder)."""
    from conftest import read_metrics

    return {int(r["step"]): r[key] for r in read_metrics(run_dir) if key in r}


def only(values: dict[int, float]) -> float:
    """The one value of an evaluation run's metric."""
    assert len(values) == 1, values
    return next(iter(values.values()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def job_env() -> dict[str, str]:
    """The environment of a job's processes: this folder and conftest's importable (callbacks by class path)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(TASKS), str(REPO / "tests")])}


def run_job(plan: list[list[str]], out: Path, processes: list[tuple[list[str], dict[str, str]]],
            timeout: float = 420) -> None:
    """Runs ``plan`` (cli.py commands) in every process of a DDP job. ``processes``: per process
    started here, the command that runs this script (``python`` or a ``torchrun`` line, the script
    and the plan are appended) and its own environment variables. Output goes to
    ``out/processN.log``; fails with the output of one that failed, ending the others."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps({"commands": plan}))
    procs, logs = [], []
    for i, (command, env) in enumerate(processes):
        log = open(out / f"process{i}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(subprocess.Popen([*command, str(TASKS / "ddp_driver.py"), str(out / "plan.json")], cwd=REPO,
                                      env={**job_env(), **env}, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        # a process that failed leaves its partners waiting in a collective: stop at the first
        while time.monotonic() < deadline and any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:  # torchrun ends its workers (each in a session of its own) on SIGTERM
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    assert not failed, "\n".join((out / f"process{i}.log").read_text()[-4000:] for i in failed)


def slurm_env(rank: int, tasks: int, port: int) -> dict[str, str]:
    """The variables ``srun`` gives task ``rank`` of a job of ``tasks`` tasks on one node, with
    its rendezvous on 127.0.0.1:``port`` (what Lightning's SLURM environment reads)."""
    return {"SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_NNODES": "1",
            "SLURM_NODEID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "linformer_lab", "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def main(plan_path: str) -> int:
    from linformer_lab.cli.entry import main as cli_main

    for command in json.loads(Path(plan_path).read_text())["commands"]:
        # a command is its arguments, or {"args": [...], "exit_code": N} where it should end with N
        args, expected = (command["args"], command["exit_code"]) if isinstance(command, dict) else (command, 0)
        start = time.process_time()
        try:
            code = cli_main(list(args))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        # what each command costs this process, for keeping the jobs small
        root = next((a.split("=", 1)[1] for a in args if a.startswith("--trainer.default_root_dir=")), "")
        sys.stderr.write(f"ddp_driver: {time.process_time() - start:.1f} s CPU: {args[0]} {Path(root).name}\n")
        if code != expected:
            sys.stderr.write(f"ddp_driver: exit code {code} (expected {expected}) from: cli.py {' '.join(args)}\n")
            return code or 1
    return 0


def run(plan_path: str) -> int:
    """:func:`main`, then the job's process group closed, as ``cli.py`` closes it."""
    from linformer_lab.cli.entry import close_process_group

    try:
        return main(plan_path)
    finally:
        close_process_group()


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
