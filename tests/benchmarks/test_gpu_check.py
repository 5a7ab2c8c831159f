"""benchmarks/paper/gpu_check.py, the one GPU command: its plan against the device's 15 minutes
(the command in benchmarks/README.md), a part stopped at its budget keeping what it measured, and
its dry run (every part at toy sizes on CPU, through the command line: Triton's interpreter for
our kernel, the graph step run eagerly, pytest collecting the GPU tests, Fig. 2's
toy matrix), so the command cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import csv
import importlib
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time

import pytest
from conftest import REPO


def import_benchmark(name: str):
    """A script of benchmarks/paper imported as a module (with benchmarks/common.py on the path)."""
    folders = [str(REPO / "benchmarks" / "paper"), str(REPO / "benchmarks")]
    sys.path[:0] = folders
    try:
        return importlib.import_module(name)
    finally:
        for folder in folders:
            sys.path.remove(folder)


gpu_check = import_benchmark("gpu_check")

#: The device's budget for a session, a machine's start, and what a rerun of a part needs (seconds).
DEVICE_BUDGET_S, MACHINE_START_S, RERUN_S = 900, 180, 200


def readme_command() -> tuple[list[str], int]:
    """The device command of benchmarks/README.md's GPU section: (gpu_check.py's arguments, timeout_s)."""
    section = (REPO / "benchmarks" / "README.md").read_text().split("## The GPU check on a lent device")[1]
    line = next(line for line in section.splitlines() if "benchmarks/paper/gpu_check.py" in line and "pip install" in line)
    words = shlex.split(line.split("&&")[-1])
    timeout = int(re.search(r"`timeout_s: (\d+)`", section).group(1))
    return words[words.index("benchmarks/paper/gpu_check.py") + 1:], timeout


def test_the_readme_command_fits_the_device_budget_with_a_rerun():
    args, timeout = readme_command()
    budget = float(args[args.index("--budget-s") + 1])
    assert budget == sum(gpu_check.PARTS.values())  # the parts' seconds as planned
    assert timeout >= budget + gpu_check.GRACE_S + 40  # the wheels' install and the report
    assert MACHINE_START_S + timeout + RERUN_S <= DEVICE_BUDGET_S
    assert args[:2] == ["--out", "$OUT"]
    section = (REPO / "benchmarks" / "README.md").read_text().split("## The GPU check on a lent device")[1]
    for part, seconds in list(gpu_check.PARTS.items())[:-1]:  # the table says each part's seconds
        assert re.search(rf"^\| {part} \| {seconds} \|", section, flags=re.M), part
    assert re.search(r"^\| figure2 \| the rest \|", section, flags=re.M)


def test_the_test_part_runs_both_triton_files_and_the_graph_decoder_on_the_gpu():
    assert all((REPO / f).is_file() for f in gpu_check.GPU_TESTS)
    assert {"tests/ops/test_triton_chunk.py", "tests/ops/test_triton_chunk_gpu.py",
            "tests/models/test_generation_graph.py"} <= set(gpu_check.GPU_TESTS)
    assert gpu_check.GPU_TESTS[0] == "tests/ops/test_triton_chunk_gpu.py"  # the GPU checks proper first
    # the switch that makes the interpreter file run compiled on a GPU instead of skipping there
    assert gpu_check.GPU_TEST_ENV == {"LINFORMER_LAB_TRITON_TESTS": "cuda"}
    assert 'os.environ.get("LINFORMER_LAB_TRITON_TESTS") == "cuda"' in (REPO / "tests/ops/test_triton_chunk.py").read_text()


def test_a_budget_journals_rows_and_skips_as_they_come(tmp_path):
    journal = tmp_path / "part.jsonl"
    budget = gpu_check.Budget(0.0, journal=journal)
    assert not budget.allows(5, "a step")
    assert budget.keep([{"part": "kernel", "fwd_ms": 1.5}]) == [{"part": "kernel", "fwd_ms": 1.5}]
    with open(journal, "a") as f:
        f.write('{"row": {"part": "cut off')  # a line cut by the stop is dropped
    rows, skipped = gpu_check.read_journal(journal)
    assert rows == [{"part": "kernel", "fwd_ms": 1.5}] and skipped == ["a step (needs ~5 s, 0 s left)"]


@pytest.mark.slow
def test_a_part_over_its_budget_is_stopped_with_its_children_and_keeps_its_rows(tmp_path):
    journal, log = tmp_path / "part.jsonl", tmp_path / "part.log"
    script = (f"import json, subprocess, sys, time\n"
              f"open({str(journal)!r}, 'a').write(json.dumps({{'row': {{'part': 'x', 'n': 1}}}}) + '\\n')\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              "print('grandchild', child.pid, flush=True)\n"
              "time.sleep(120)\n")
    code, seconds = gpu_check.run_part([sys.executable, "-c", script], 5, log)
    assert code is None and seconds < 30
    assert gpu_check.read_journal(journal)[0] == [{"part": "x", "n": 1}]
    text = log.read_text()
    assert "[stopped after" in text
    pid = int(re.search(r"grandchild (\d+)", text).group(1))
    for _ in range(50):  # the grandchild went with its group (reaped by init once killed)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the part's own child outlived the stop")


@pytest.mark.slow
def test_the_readme_commands_dry_run_writes_every_table(tmp_path):
    args, _ = readme_command()
    args = [str(tmp_path) if a == "$OUT" else a for a in args]
    args[args.index("--budget-s") + 1] = "3000"  # toy sizes, but a loaded 2-core CPU: every part to its end
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", *args, "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    for part in gpu_check.PARTS:
        assert f"== {part}:" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check_cpu_dry_run.csv", "gpu_check_cpu_dry_run.md",
                                                          "gpu_check_logs.tar.gz"]
    report = (tmp_path / "gpu_check_cpu_dry_run.md").read_text()
    for section in ("## Targets", "## Tests", "## Kernel check", "## Kernels: median ms", "## Kernels: ratios",
                    "## Kernels: first call", "## Training", "## Generation", "## Fig. 2", "## Skipped"):
        assert section in report
    assert "--dry-run" in report and "Triton" in report and "torch" in report
    assert "stopped after" not in report and "failed" not in report, report.split("## Skipped")[1]
    rows = list(csv.DictReader((tmp_path / "gpu_check_cpu_dry_run.csv").read_text().splitlines()))
    checked = {(r["op"], r["candidate"]): r["status"] for r in rows if r["part"] == "kernel_check"}
    assert checked[("causal", "recurrence")] == "pass" and checked[("causal_attention", "triton")] == "not here"
    tests = [r for r in rows if r["part"] == "tests"]
    assert tests[0]["method"] == "build 3 extensions at once" and tests[0]["result"] == "3 of 3 built or cached"
    assert tests[1]["method"] == "cli.py plugins --check" and tests[1]["exit"] == "0"
    assert tests[2]["method"] == " ".join(gpu_check.GPU_TESTS) and "collected" in tests[2]["result"]
    assert tests[2]["env"] == "LINFORMER_LAB_TRITON_TESTS=cuda"
    kernel = {r["method"]: r for r in rows if r["part"] == "kernel" and r["fwd_bwd_ms"]}
    assert {"ours", "ours_nomap", "sdpa"} <= set(kernel)  # ours through the interpreter, timed fwd and fwd+bwd
    assert float(kernel["ours"]["first_fwd_bwd_s"]) > 0  # the first call (Triton: compile, autotune) is recorded
    agreement = [float(r["rel_err"]) for r in rows if r["part"] == "agreement"]
    assert agreement and max(agreement) < 1e-5  # fp32 interpreted kernel against the float64 definition
    train = {(r["config"], r["batch"]) for r in rows if r["part"] == "train"}
    assert {("mnist_linear.yaml", "10"), ("mnist_softmax.yaml", "10"), ("mnist_linear.yaml", "64")} <= train
    roles = {(r["role"], r["method"]) for r in rows if r["part"] == "generation"}
    assert {("latency", "linear"), ("batch 1,000", "linear"), ("batch 1,000", "stateful-softmax"), ("largest", "linear")} <= roles
    figure2 = {(r["recipe"], r["precision"], r["method"]): r for r in rows if r["part"] == "figure2"}
    assert set(figure2) == {("ours", "bf16-mixed", "linear"), ("authors", "bf16-mixed", "linear")}
    assert all(r["updates"] == "4" and float(r["train_loss_no_dropout"]) > 0 for r in figure2.values())
    assert "fla: needs a CUDA GPU" in report  # what did not run is said
    with tarfile.open(tmp_path / "gpu_check_logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu_check_logs/plugins_check.json", "gpu_check_logs/pytest.log", "gpu_check_logs/figure2/figure2_quick.md",
            "gpu_check_logs/kernel.jsonl", "gpu_check_logs/prebuild.log"} <= names


@pytest.mark.slow
def test_without_a_gpu_a_real_run_says_what_to_do(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA GPU visible" in done.stderr and "--dry-run" in done.stderr


@pytest.mark.slow
def test_the_kernel_part_runs_alone(tmp_path):
    command = [sys.executable, "benchmarks/paper/gpu_check.py", "--parts", "kernel", "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "gpu_check_cpu_dry_run.md").read_text()
    assert "## Kernels: median ms" in report and "| ours |" in report


def test_the_kernel_report_shows_each_autotuning_and_their_sum():
    gpu_check_kernel = import_benchmark("gpu_check_kernel")
    rows = [{"part": "tuning", "method": name, "key": "(64, 64, 64)", "config": "BV: 64, num_warps: 4", "seconds": s}
            for name, s in (("chunk_states_forward", 1.25), ("chunk_states_backward", 2.5))]
    report = "\n".join(gpu_check_kernel.report_lines(rows))
    assert "| chunk_states_backward | (64, 64, 64) | BV: 64, num_warps: 4 | 2.50 |" in report
    assert "Autotuning in all: 3.8 s over 2 keys." in report
    assert gpu_check_kernel.tuning_rows() == []  # nothing tuned here: the interpreter times no configs


def test_ratios_against_fla_come_from_the_round_that_timed_ours_beside_it():
    gpu_check_kernel = import_benchmark("gpu_check_kernel")
    big, small = (2, 16384, 16, 128), (8, 1024, 8, 64)

    def row(part, method, shape, ms):
        return {"part": part, "method": method, **dict(zip("BTHD", shape)), "fwd_ms": ms / 4, "fwd_bwd_ms": ms}

    rows = [row("kernel", "ours", big, 8.0), row("kernel", "sdpa", big, 16.0), row("kernel", "ours", small, 1.0),
            row("kernel", "sdpa", small, 0.5),  # the round without fla, every shape
            row("kernel_fla", "ours", big, 6.0), row("kernel_fla", "fla", big, 3.0)]  # fla beside ours, one shape
    ratios = {r[0]: r[1:] for r in gpu_check_kernel.ratio_rows(rows)}
    columns = [f"{a}/{b}/{k}" for a, b, k in gpu_check_kernel.RATIOS]
    cell = dict(zip(columns, ratios["2×16384×16×128"]))
    assert cell["ours/fla/fwd_bwd"] == "2.00" and cell["ours/sdpa/fwd_bwd"] == "0.50"  # 6/3 and 8/16, not 8/3
    assert dict(zip(columns, ratios["8×1024×8×64"]))["ours/fla/fwd_bwd"] == "—"
    targets = {t[0]: t for t in gpu_check.targets(rows)}
    vs_fla = targets["causal fwd+bwd vs fla (ours / fla)"]
    assert vs_fla[3] == "max 2.00 over 1 of 7 shapes, at T ≥ 8,192 max 2.00" and vs_fla[4] == "NOT met"
    rows[-2]["fwd_bwd_ms"] = 1.5  # faster than fla where timed, but only one shape of the grid was
    vs_fla = {t[0]: t for t in gpu_check.targets(rows)}["causal fwd+bwd vs fla (ours / fla)"]
    assert vs_fla[4] == "met where timed"


def test_autotune_results_travel_from_one_run_to_the_next(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(first))
    for folder, name in (("a1b2", "chunk_states_forward"), ("c3d4", "chunk_bwd_kernel_dh")):
        (first / folder).mkdir(parents=True)
        (first / folder / f"{name}.autotune.json").write_text('{"key": [64], "configs_timings": []}')
    (first / "a1b2" / "chunk_states_forward.cubin").write_bytes(b"binary")  # compiled code stays behind
    archive = tmp_path / "triton_autotune.tar.gz"
    assert gpu_check.save_tuning(archive) == 2
    monkeypatch.setenv("TRITON_CACHE_DIR", str(second))
    assert gpu_check.restore_tuning(archive) == 2
    assert (second / "c3d4" / "chunk_bwd_kernel_dh.autotune.json").read_text() == '{"key": [64], "configs_timings": []}'
    assert not (second / "a1b2" / "chunk_states_forward.cubin").exists()
    assert gpu_check.restore_tuning(tmp_path / "missing.tar.gz") == 0  # the first run anywhere: nothing to reuse
    assert gpu_check.save_tuning(tmp_path / "again.tar.gz") == 2
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert gpu_check.save_tuning(tmp_path / "none.tar.gz") == 0 and not (tmp_path / "none.tar.gz").exists()


def test_the_kernel_part_times_fla_in_a_round_of_its_own_beside_ours(monkeypatch):
    import torch

    gpu_check_kernel = import_benchmark("gpu_check_kernel")

    def causal_mean(q, k, v):  # any causal function of (B, T, H, D) inputs stands in for a kernel here
        return v.cumsum(1) / torch.arange(1, v.shape[1] + 1).view(1, -1, 1, 1) + 0 * (q + k)

    found = {"ours": (causal_mean, "bthd"), "fla": (lambda q, k, v: causal_mean(q, k, v) * 1.0, "bthd"),
             "sdpa": (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), "bhtd")}
    monkeypatch.setattr(gpu_check_kernel, "methods", lambda device: (found, {}))
    budget = gpu_check.Budget(600.0)
    summary, rows = gpu_check_kernel.measure("cpu", budget, dry_run=True)
    rounds = {part: {r["method"] for r in rows if r["part"] == part} for part in ("kernel", "kernel_fla")}
    assert rounds == {"kernel": {"ours", "sdpa"}, "kernel_fla": {"ours", "fla"}}
    assert all(r.get("fwd_bwd_ms") for r in rows if r["part"] in ("kernel", "kernel_fla"))
    ratios = gpu_check_kernel.ratio_rows(rows)
    assert len(ratios) == 1 and "—" not in ratios[0][1:2]  # ours/fla from the fla round


def test_the_kernel_profile_says_where_a_step_spends_its_time():
    import torch

    gpu_check_kernel = import_benchmark("gpu_check_kernel")

    def attention(q, k, v):  # a causal function of (B, T, H, D) whose backward runs a matrix product
        scores = torch.einsum("bthd,bshd->bhts", q, k).tril()
        return torch.einsum("bhts,bshd->bthd", scores, v)

    rows = gpu_check_kernel.kernel_profile((1, 64, 2, 16), attention, torch.float32, "cpu", steps=2)
    assert rows and rows == sorted(rows, key=lambda r: -r["ms"]) and all(r["ms"] > 0 for r in rows)
    assert any("bmm" in r["kernel"] or "mm" in r["kernel"] for r in rows)
    # each share of the step's whole time, not of the rows kept (the longest 12)
    assert 0 < sum(r["share"] for r in rows) <= 1 + 1e-9
    assert all(abs(r["share"] / rows[0]["share"] - r["ms"] / rows[0]["ms"]) < 1e-9 for r in rows)
    report = "\n".join(gpu_check_kernel.report_lines(rows))
    assert "## Kernels: where our fwd+bwd spends its time" in report and "| 1×64×2×16 |" in report


def test_the_training_table_says_how_long_the_gpu_was_busy_in_an_update():
    gpu_check_model = import_benchmark("gpu_check_model")
    row = {"part": "train", "config": "mnist_linear.yaml", "compile": "none", "batch": 10, "updates": 226,
           "ms_per_update": 35.4, "images_per_s": 282.0, "warmup_s": 6.0}
    on_gpu = {**row, "kernels_per_update": 766, "gpu_busy_ms": 9.25}  # the rest of the 35.4 ms waits on the host
    assert gpu_check_model.training_table([on_gpu, row])[0][-2:] == [766, "9.2"]
    assert gpu_check_model.training_table([on_gpu, row])[1][-2:] == ["—", "—"]  # no profile (a CPU dry run)
    assert gpu_check_model.gpu_work(lambda: None, "cpu") == {}
