"""benchmarks/paper/gpu_check.py, the one GPU command: its plan against the device's 15 minutes
(the command in benchmarks/README.md, the parts in the order of what they decide), a part stopped
at its budget keeping what it measured (pytest still writing its junit file), and its dry run
(every part at toy sizes on CPU, through the command line: Triton's interpreter for our kernel
and the previous revision's, the graph step run eagerly, pytest collecting the GPU tests, Fig.
2's toy matrix), so the command cannot rot between the rare runs on a GPU. What it carries
(the previous kernel, the compiled caches): test_gpu_check_cache.py."""

from __future__ import annotations

import csv
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from xml.etree import ElementTree

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
gpu_check_kernel = import_benchmark("gpu_check_kernel")
gpu_check_report = import_benchmark("gpu_check_report")

#: The device's budget for a session, a machine's start, and what a rerun of a part needs (seconds).
DEVICE_BUDGET_S, MACHINE_START_S, RERUN_S = 900, 180, 200


def readme_section() -> str:
    return (REPO / "benchmarks" / "README.md").read_text().split("## The GPU check on a lent device")[1]


def readme_command() -> tuple[list[str], int]:
    """The device command of benchmarks/README.md's GPU section: (gpu_check.py's arguments, timeout_s)."""
    section = readme_section()
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
    # the carried folder holds the previous kernel and the last run's compiled code, and travels
    assert args[args.index("--cache") + 1] == ".gpu_cache" == gpu_check.gpu_check_cache.CACHE_DIR
    section = readme_section()
    assert re.search(r'`carry: \[".whl", ".gpu_cache"\]`', section)
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu_cache/triton_chunk_prev/launch.py"], cwd=REPO)
    assert ignored.returncode == 0  # never committed: a device run's binaries and another revision's code
    assert "--export-previous 10c4e5b" in section  # prepared here, where the git history is
    for part, seconds in list(gpu_check.PARTS.items())[:-1]:  # the table says each part's seconds, in order
        assert re.search(rf"^\| {part} \| {seconds} \|", section, flags=re.M), part
    assert re.search(r"^\| figure2 \| the rest \|", section, flags=re.M)
    order = [m.group(1) for m in re.finditer(r"^\| (\w+) \| (?:\d+|the rest) \|", section, flags=re.M)]
    assert order == list(gpu_check.PARTS)


def test_the_parts_run_in_the_order_of_what_they_decide():
    # the kernel grid first, then training, generation, the tests; Fig. 2 with what is left
    assert list(gpu_check.PARTS) == ["kernel", "train", "generation", "tests", "figure2"]
    # within the kernel part: the previous revision and SDPA over the grid, then fla, then the .cu
    assert list(gpu_check_kernel.ROUNDS) == ["kernel", "kernel_fla", "kernel_cu"]
    assert gpu_check_kernel.ROUNDS["kernel"] == ("ours", "ours_prev", "sdpa")
    assert len(gpu_check_kernel.GRID) == 7 and gpu_check_kernel.ROOFLINE_SHAPE in gpu_check_kernel.GRID


def test_the_test_part_runs_both_triton_files_and_the_graph_decoder_on_the_gpu():
    assert all((REPO / f).is_file() for f in gpu_check.GPU_TESTS)
    assert {"tests/ops/test_triton_chunk.py", "tests/ops/test_triton_chunk_gpu.py",
            "tests/models/test_generation_graph.py"} <= set(gpu_check.GPU_TESTS)
    assert gpu_check.GPU_TESTS[0] == "tests/ops/test_triton_chunk_gpu.py"  # the GPU checks proper first
    (tests_row,) = [line for line in readme_section().splitlines() if line.startswith("| tests |")]
    assert re.findall(r"`(tests/[\w/]+\.py)`", tests_row) == gpu_check.GPU_TESTS  # the README says what runs, in order
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
    # 3 s: the part journals and starts its child within a fraction of one (0.05 s each alone)
    code, seconds = gpu_check.run_part([sys.executable, "-c", script], 3, log)
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
def test_pytest_stopped_at_its_budget_still_writes_its_junit_file_and_summary(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                           "def test_slow():\n    time.sleep(120)\n")
    junit, log = tmp_path / "junit.xml", tmp_path / "pytest.log"
    command = [sys.executable, "-m", "pytest", str(tmp_path / "test_slow.py"), "-v", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "--rootdir", str(tmp_path)]
    # no plugins autoloaded: pytest starts in a second (0.8 s alone; none is needed here), and
    # test_quick has passed long before the 6 s budget. Under xdist this process ignores SIGINT;
    # run_part must not pass that on, or the interrupt is lost
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    code, seconds = gpu_check.run_part(command, 6, log, env=env, first=signal.SIGINT)
    assert code is None and seconds < 40
    cases = {c.get("name"): c for c in ElementTree.parse(junit).getroot().iter("testcase")}
    assert "test_quick" in cases and not list(cases["test_quick"])  # passed: no failure or skip element
    summary = gpu_check.pytest_summary(log.read_text(), ["test_slow.py"], code)
    assert summary.startswith("pytest test_slow.py (LINFORMER_LAB_TRITON_TESTS=cuda): exit stopped at its budget")
    assert "KeyboardInterrupt" in summary and "1 passed" in summary


@pytest.mark.slow
def test_the_readme_commands_dry_run_writes_every_table(tmp_path):
    args, _ = readme_command()
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = [str(out) if a == "$OUT" else str(cache) if a == ".gpu_cache" else a for a in args]
    args[args.index("--budget-s") + 1] = "3000"  # toy sizes, but a loaded 2-core CPU: every part to its end
    # the kernel of revision 10c4e5b (two state walks, autotuned) timed beside the working tree's
    export = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", "--export-previous", "10c4e5b",
                             "--cache", str(cache)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    done = subprocess.run([sys.executable, "benchmarks/paper/gpu_check.py", *args, "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = [m.group(1) for m in re.finditer(r"^== (\w+):", done.stdout, flags=re.M)]
    assert parts == list(gpu_check.PARTS)
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check_cpu_dry_run.csv", "gpu_check_cpu_dry_run.md", "gpu_check_cpu_dry_run_junit.xml",
        "gpu_check_cpu_dry_run_pytest.txt", "gpu_check_logs.tar.gz"]
    report = (out / "gpu_check_cpu_dry_run.md").read_text()
    for section in ("## Targets", "## Kernels", "### Median ms", "### Ratios", "### First call", "### Where a fwd+bwd",
                    "### Launches per call", "### Compilations", "## Training", "## Generation", "## Tests",
                    "## Kernel check", "## Fig. 2", "## Skipped"):
        assert section in report
    assert report.index("## Kernels") < report.index("## Training") < report.index("## Generation") < report.index("## Tests")
    assert "--dry-run" in report and "Triton" in report and "torch" in report
    assert "Previous revision of our kernel (`ours_prev`): 10c4e5b." in report
    assert "stopped after" not in report and "failed" not in report, report.split("## Skipped")[1]
    rows = list(csv.DictReader((out / "gpu_check_cpu_dry_run.csv").read_text().splitlines()))
    checked = {(r["op"], r["candidate"]): r["status"] for r in rows if r["part"] == "kernel_check"}
    assert checked[("causal_attention", "cpp")] == "pass" and checked[("causal_attention", "triton")] == "not here"
    build = [r for r in rows if r["part"] == "build"]
    assert build[0]["method"] == "build 3 extensions at once" and build[0]["result"] == "3 of 3 built or cached"
    assert [build[0][f"cpu.{name}"] for name in gpu_check.CPU_EXTENSIONS] == ["0"] * 3  # each one's exit: its process's
    tests = [r for r in rows if r["part"] == "tests"]
    assert tests[0]["method"] == "cli.py plugins --check" and tests[0]["exit"] == "0"
    assert tests[1]["method"] == " ".join(gpu_check.GPU_TESTS) and "collected" in tests[1]["result"]
    assert tests[1]["env"] == "LINFORMER_LAB_TRITON_TESTS=cuda"
    collected = ElementTree.parse(out / "gpu_check_cpu_dry_run_junit.xml").getroot()
    assert collected.tag in ("testsuites", "testsuite")  # pytest's junit file, written beside the report
    summary = (out / "gpu_check_cpu_dry_run_pytest.txt").read_text()
    assert summary.startswith(f"pytest {' '.join(gpu_check.GPU_TESTS)} (LINFORMER_LAB_TRITON_TESTS=cuda): exit 0")
    kernel = {r["method"]: r for r in rows if r["part"] == "kernel" and r["fwd_bwd_ms"]}
    assert set(kernel) == {"ours", "ours_prev", "sdpa"}  # both revisions through the interpreter, fwd and fwd+bwd
    assert float(kernel["ours"]["first_fwd_bwd_s"]) > 0  # the first call (Triton: compile) is recorded
    assert [r["revision"] for r in rows if r["part"] == "previous"] == ["10c4e5b"]
    agreement = {r["method"]: float(r["rel_err"]) for r in rows if r["part"] == "agreement"}
    # fp32 interpreted kernels against the float64 definition, and the two revisions against each other
    assert {"ours vs float64 definition", "ours_prev vs float64 definition", "ours_prev vs ours",
            "ours_prev vs ours, gradients of q, k, v (the largest)"} <= set(agreement)
    assert max(agreement.values()) < 1e-5
    profiled = {r["method"] for r in rows if r["part"] == "kernel_profile"}
    assert profiled == {"ours", "ours_prev"}
    launches = {r["method"]: r for r in rows if r["part"] == "launches"}
    assert set(launches) == {"ours", "ours_prev"} and launches["ours"]["unit"] == "operators"
    train = {(r["config"], r["batch"]) for r in rows if r["part"] == "train"}
    assert {("mnist_linear.yaml", "10"), ("mnist_softmax.yaml", "10"), ("mnist_linear.yaml", "64")} <= train
    roles = {(r["role"], r["method"]) for r in rows if r["part"] == "generation"}
    assert {("latency", "linear"), ("batch 1,000", "linear"), ("batch 1,000", "stateful-softmax"), ("largest", "linear")} <= roles
    figure2 = {(r["recipe"], r["precision"], r["method"]): r for r in rows if r["part"] == "figure2"}
    assert set(figure2) == {("ours", "bf16-mixed", "linear")}
    assert all(r["updates"] == "4" and float(r["train_loss_no_dropout"]) > 0 for r in figure2.values())
    assert "fla: needs a CUDA GPU" in report  # what did not run is said
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu_check_logs/plugins_check.json", "gpu_check_logs/pytest.log", "gpu_check_logs/figure2/figure2_quick.md",
            "gpu_check_logs/kernel.jsonl", "gpu_check_logs/prebuild.log", "gpu_check_logs/prebuild.json"} <= names


def test_without_a_gpu_a_real_run_says_what_to_do(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as stopped:  # in this process: the check comes before any part starts
        gpu_check.main(["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "no CUDA GPU visible" in err and "--dry-run" in err
    assert not any(tmp_path.iterdir())  # stopped before writing anything


@pytest.mark.slow
def test_the_kernel_part_runs_alone(tmp_path, monkeypatch):
    # the command's own process is this one (the part still runs in a child): what main sets is undone after
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    assert gpu_check.main(["--parts", "kernel", "--dry-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "gpu_check_cpu_dry_run.md").read_text()
    assert "### Median ms" in report and "| ours |" in report
    # without --cache nothing is carried, and the report says how to time the previous revision
    assert "Nothing carried (no `--cache`)" in report and "gpu_check.py --export-previous REV" in report
    rows = list(csv.DictReader((tmp_path / "gpu_check_cpu_dry_run.csv").read_text().splitlines()))
    assert {r["part"] for r in rows} >= {"kernel", "agreement"} and not {"train", "tests", "figure2"} & {r["part"] for r in rows}
    # the kernel part needs no compiled extension on a CPU: none is built beside it
    assert next(r for r in rows if r["part"] == "build")["method"] == "build 0 extensions at once"


def test_the_kernel_report_shows_each_compilation_and_their_sum():
    rows = [{"part": "compile", "method": method, "kernel": name, "key": "(64, 64, 64)", "config": "num_warps: 4",
             "seconds": s} for method, name, s in (("ours", "superchunk_forward", 1.25), ("ours", "superchunk_dq", 2.5),
                                                   ("ours_prev", "chunk_states_backward", 0.5))]
    report = "\n".join(gpu_check_report.report_lines(rows))
    assert "| ours | superchunk_dq | (64, 64, 64) | num_warps: 4 | 2.50 |" in report
    assert "Compilations in all: ours 3.8 s over 2; ours_prev 0.5 s over 1." in report
    assert gpu_check_kernel.compile_rows() == []  # nothing compiled here: the interpreter compiles nothing


def row(part, method, shape, ms):
    return {"part": part, "method": method, **dict(zip("BTHD", shape)), "dtype": "bfloat16", "layout": "bthd",
            "fwd_ms": ms / 4, "fwd_bwd_ms": ms}


def test_each_ratio_comes_from_the_round_that_timed_ours_beside_the_other():
    big, small = (2, 16384, 16, 128), (8, 1024, 8, 64)
    rows = [row("kernel", "ours", big, 8.0), row("kernel", "sdpa", big, 16.0), row("kernel", "ours_prev", big, 10.0),
            row("kernel", "ours", small, 1.0), row("kernel", "sdpa", small, 0.5),
            row("kernel", "ours_prev", small, 1.05),  # the first round: every shape
            row("kernel_fla", "ours", big, 6.0), row("kernel_fla", "fla", big, 3.0),  # fla beside ours, one shape
            row("kernel_cu", "ours", small, 1.2), row("kernel_cu", "cuda_old", small, 2.4)]
    ratios = {r[0]: r[1:] for r in gpu_check_report.ratio_rows(rows)}
    columns = [f"{a}/{b}/{k}" for a, b, k in gpu_check_kernel.RATIOS]
    cell = dict(zip(columns, ratios["2×16384×16×128"]))
    assert cell["ours/fla/fwd_bwd"] == "2.00" and cell["ours/sdpa/fwd_bwd"] == "0.50"  # 6/3 and 8/16, not 8/3
    assert cell["ours/ours_prev/fwd_bwd"] == "0.80"
    small_cells = dict(zip(columns, ratios["8×1024×8×64"]))
    assert small_cells["ours/fla/fwd_bwd"] == "—" and small_cells["ours/cuda_old/fwd_bwd"] == "0.50"  # 1.2/2.4
    report = "\n".join(gpu_check_report.report_lines(rows))
    assert "The 10 % rule (ours / ours_prev fwd+bwd ≤ 0.90): met at 1 of 2 shapes (2×16384×16×128)" in report
    targets = {t[0]: t for t in gpu_check_report.targets(rows)}
    vs_fla = targets["causal fwd+bwd, ours ÷ fla, every grid shape"]
    assert vs_fla[3] == "max 2.00 over 1 of 7 shapes, at T ≥ 8,192 max 2.00" and vs_fla[4] == "NOT met"
    vs_prev = targets["causal fwd+bwd, ours ÷ the previous revision (the 10 % rule)"]
    assert vs_prev[3:] == ["0.80-0.95 over 2 shapes, ≤ 0.90 at 1", "met at 1 of 2"]
    rows[7]["fwd_bwd_ms"] = 12.0  # ours at half fla's time where timed, but only one shape of the grid was
    vs_fla = {t[0]: t for t in gpu_check_report.targets(rows)}["causal fwd+bwd, ours ÷ fla, every grid shape"]
    assert vs_fla[4] == "met where timed"
    vs_cu = targets["causal fwd and fwd+bwd, ours ÷ the .cu numerator, every grid shape"]
    assert vs_cu[3:] == ["max 0.50 over 1 of 7 shapes", "met where timed"]  # 1.2 / 2.4, fwd and fwd+bwd alike
    rows[-1]["fwd_ms"] = 0.2  # the .cu's forward faster than ours (0.3 ms): not at or below it at every shape
    targets = {t[0]: t for t in gpu_check_report.targets(rows)}
    assert targets["causal fwd and fwd+bwd, ours ÷ the .cu numerator, every grid shape"][3:] == [
        "max 1.50 over 1 of 7 shapes", "NOT met"]


def test_the_targets_are_the_issues():
    rows = [{"part": "roofline", "fraction": 0.31},
            {"part": "launches", "method": "ours", **dict(zip("BTHD", (2, 16384, 16, 128))), "fwd": 2.0, "bwd": 3.0,
             "unit": "kernels"}]
    train = [("mnist_linear.yaml", "none", 10, 282.0), ("mnist_softmax.yaml", "none", 10, 477.0),
             ("mnist_linear.yaml", "cuda_graph", 10, 3100.0), ("mnist_softmax.yaml", "cuda_graph", 10, 2500.0),
             ("mnist_linear.yaml", "none", 64, 900.0)]  # softmax not timed at 64: no ratio there
    rows += [{"part": "train", "config": c, "compile": m, "batch": b, "images_per_s": v} for c, m, b, v in train]
    targets = {t[0]: t[1:] for t in gpu_check_report.targets(rows)}
    assert targets["forward at B2 T16384 H16 D128, share of the HBM roofline"] == ["≥ 30 %", "≥ 60 %", "31.0%", "met"]
    assert targets["launches per forward / backward (ours, B2 T16384 H16 D128)"] == ["≤ 2 / ≤ 3", "1 / 2", "2 / 3", "met"]
    # each config at its best mode: the graphed linear against the graphed softmax
    assert targets["MNIST training images/s, linear ÷ softmax, each at its best mode"] == [
        "≥ 1.0", "≥ 1.2 and ≥ 3,000 images/s",
        "batch 10: 1.24 (3100, compile=cuda_graph vs 2500, compile=cuda_graph)", "aim met"]
    assert targets["ours ÷ SDPA causal fwd+bwd"][2:] == ["not measured", "—"]


def test_the_kernel_part_times_each_comparison_in_a_round_of_its_own(monkeypatch):
    import torch

    def causal_mean(q, k, v):  # any causal function of (B, T, H, D) inputs stands in for a kernel here
        return v.cumsum(1) / torch.arange(1, v.shape[1] + 1).view(1, -1, 1, 1) + 0 * (q + k)

    def scaled(factor):
        return lambda q, k, v: causal_mean(q, k, v) * factor

    found = {"ours": (causal_mean, "bthd"), "ours_prev": (scaled(1.0), "bthd"), "fla": (scaled(1.0), "bthd"),
             "sdpa": (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), "bhtd")}
    monkeypatch.setattr(gpu_check_kernel, "methods", lambda device, previous: (found, {}))
    monkeypatch.setattr(gpu_check_kernel, "cuda_numerator", lambda device, work, budget: (scaled(1.0), "bthd"))
    budget = gpu_check.Budget(600.0)
    summary, rows = gpu_check_kernel.measure("cpu", budget, dry_run=True)
    rounds = {part: {r["method"] for r in rows if r["part"] == part} for part in gpu_check_kernel.ROUNDS}
    assert rounds == {"kernel": {"ours", "ours_prev", "sdpa"}, "kernel_fla": {"ours", "fla"},
                      "kernel_cu": {"ours", "cuda_old"}}
    assert all(r.get("fwd_bwd_ms") for r in rows if r["part"] in gpu_check_kernel.ROUNDS)
    assert [r["part"] for r in rows if r["part"] in gpu_check_kernel.ROUNDS] == \
        ["kernel"] * 3 + ["kernel_fla"] * 2 + ["kernel_cu"] * 2  # in the order of what they decide
    assert "—" not in gpu_check_report.ratio_rows(rows)[0][1:3]  # ours/ours_prev and ours/fla
    assert {r["method"] for r in rows if r["part"] == "kernel_profile"} == {"ours", "ours_prev", "fla"}


def test_the_cu_numerator_waits_for_its_build(tmp_path):
    budget = gpu_check.Budget(600.0)
    assert gpu_check_kernel.cuda_numerator("cpu", tmp_path, budget) is None and not budget.skipped  # methods says why


def test_the_kernel_profile_says_where_a_step_spends_its_time_and_what_it_launches():
    import torch

    def attention(q, k, v):  # a causal function of (B, T, H, D) whose backward runs a matrix product
        scores = torch.einsum("bthd,bshd->bhts", q, k).tril()
        return torch.einsum("bhts,bshd->bthd", scores, v)

    rows = gpu_check_kernel.kernel_profile((1, 64, 2, 16), attention, torch.float32, "cpu", "ours", steps=2)
    profile = [r for r in rows if r["part"] == "kernel_profile"]
    assert profile and profile == sorted(profile, key=lambda r: -r["ms"]) and all(r["ms"] > 0 for r in profile)
    assert any("bmm" in r["kernel"] or "mm" in r["kernel"] for r in profile)
    # each share of the step's whole time, not of the rows kept (the longest 12)
    assert 0 < sum(r["share"] for r in profile) <= 1 + 1e-9
    assert all(abs(r["share"] / profile[0]["share"] - r["ms"] / profile[0]["ms"]) < 1e-9 for r in profile)
    launches = [r for r in rows if r["part"] == "launches"]
    assert len(launches) == 1 and launches[0]["unit"] == "operators"
    # the backward of two einsums runs more operators than their forward, and both run some
    assert 0 < launches[0]["fwd"] < launches[0]["bwd"]
    report = "\n".join(gpu_check_report.report_lines(rows))
    assert "### Where a fwd+bwd spends its time" in report and "| ours | 1×64×2×16 |" in report


def test_the_training_table_says_how_long_the_gpu_was_busy_in_an_update():
    gpu_check_model = import_benchmark("gpu_check_model")
    row = {"part": "train", "config": "mnist_linear.yaml", "compile": "none", "batch": 10, "updates": 226,
           "ms_per_update": 35.4, "images_per_s": 282.0, "warmup_s": 6.0}
    on_gpu = {**row, "kernels_per_update": 766, "gpu_busy_ms": 9.25}  # the rest of the 35.4 ms waits on the host
    assert gpu_check_model.training_table([on_gpu, row])[0][-2:] == [766, "9.2"]
    assert gpu_check_model.training_table([on_gpu, row])[1][-2:] == ["—", "—"]  # no profile (a CPU dry run)
    assert gpu_check_model.gpu_work(lambda: None, "cpu") == {}
