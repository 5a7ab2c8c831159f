"""The benchmark scripts stay runnable and use only the library's public names."""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
ROOMS = ("paper", "dev")  # the paper's reproduction; development measurements
#: The runnable scripts (helper modules such as common.py or generation_report.py have no __main__).
SCRIPTS = sorted(p for p in BENCHMARKS.rglob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def private_imports(path: Path) -> list[str]:
    """``from linformer_lab... import _name`` and ``linformer_lab...._name`` attribute reads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "linformer_lab":
            found += [f"{path.name}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                      if a.name.startswith("_")]
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.append(f"{path.name}:{node.lineno} imports the private module {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "linformer_lab" and any(p.startswith("_") for p in a.name.split("."))]
    return found


def test_no_benchmark_imports_a_private_name():
    found = [line for path in sorted(BENCHMARKS.rglob("*.py")) for line in private_imports(path)]
    assert not found, "benchmarks must use public names:\n" + "\n".join(found)


def test_the_checker_sees_private_imports(tmp_path):
    script = tmp_path / "b.py"
    script.write_text("from linformer_lab.models.transformer import _PrefixCache\nimport linformer_lab._x\n")
    assert len(private_imports(script)) == 2


def test_every_script_lives_in_one_of_the_two_rooms():
    assert len(SCRIPTS) >= 12, SCRIPTS
    misplaced = [str(p.relative_to(BENCHMARKS)) for p in SCRIPTS if p.parent.name not in ROOMS or p.parent.parent != BENCHMARKS]
    assert not misplaced, f"benchmark scripts belong in benchmarks/paper/ or benchmarks/dev/: {misplaced}"


#: The one path bootstrap of every benchmark module (benchmarks/common.py's docstring).
BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"
MODULES = sorted(p for room in ROOMS for p in (BENCHMARKS / room).glob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, nested imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found


def test_no_script_imports_another_script():
    """Scripts share code through common.py and the library only; a helper module without a main
    (a script's report writer) may be imported."""
    scripts = {p.stem for p in SCRIPTS}
    found = [f"{p.relative_to(BENCHMARKS)} imports {name}" for p in MODULES for name in sorted(imported_modules(p))
             if name in scripts and name != p.stem]
    assert not found, "imports between benchmark scripts:\n" + "\n".join(found)


def test_the_import_check_sees_nested_imports(tmp_path):
    script = tmp_path / "a.py"
    script.write_text("import common\ndef f():\n    from generation import x\n    import scaling.y\n")
    assert imported_modules(script) == {"common", "generation", "scaling"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_module_bootstraps_one_way_and_writes_to_its_rooms_results(path):
    """One ``sys.path`` line, common.py's, before importing it; results go to ``common.results_dir``
    (the script's room), never a folder spelled out in the script."""
    text = path.read_text()
    inserts = re.findall(r"^sys\.path\.insert\(.*$", text, flags=re.M)
    if "common" in imported_modules(path) and 'if __name__ == "__main__":' in text:
        assert len(inserts) == 1 and inserts[0].startswith(BOOTSTRAP), inserts
    else:
        assert all(line.startswith(BOOTSTRAP) for line in inserts), inserts
    assert not re.search(r"""["']results["']""", text), "results folder spelled out: use common.results_dir(__file__)"


#: Runs ``SCRIPT --help`` for each script given, as ``python SCRIPT --help`` would (``__main__``, the
#: script's folder first on the path), one after another in one process, which pays for torch and
#: Lightning once; the benchmarks' own modules and the path are reset before each script, so one
#: that cannot import its helpers by itself fails as in a process of its own. Writes
#: {script: [exit code, stdout, stderr]} as JSON to the first argument.
_HELP_RUNNER = """
import contextlib, io, json, os, runpy, sys, traceback
out_file, scripts = sys.argv[1], sys.argv[2:]
benchmarks, path, results = os.path.abspath("benchmarks"), list(sys.path), {}
for script in scripts:
    for name, module in list(sys.modules.items()):
        if os.path.abspath(getattr(module, "__file__", None) or "/").startswith(benchmarks + os.sep):
            del sys.modules[name]
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + path[1:]
    sys.argv = [script, "--help"]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[script] = [code, out.getvalue(), err.getvalue()]
with open(out_file, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def help_of_every_script(tmp_path_factory) -> dict[str, list]:
    """``--help`` of every benchmark script from the repository root: {relative path: [exit code, stdout, stderr]}."""
    out = tmp_path_factory.mktemp("help") / "help.json"
    scripts = [str(script.relative_to(REPO)) for script in SCRIPTS]
    done = subprocess.run([sys.executable, "-c", _HELP_RUNNER, str(out), *scripts], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_benchmark_parses_its_options(script, help_of_every_script):
    """``python benchmarks/<room>/<script>.py --help`` from the repository root, as the README runs them."""
    code, out, err = help_of_every_script[str(script.relative_to(REPO))]
    assert code == 0, err[-2000:]
    assert "usage" in out.lower()


def test_compare_revisions_generate_reports_medians_and_ratios(tmp_path):
    """compare_revisions.py generate's report: per mode the median over rounds of each variant, their
    ratio, and the stepped/prefill speedup within each variant; the old revision named as a commit."""
    import argparse

    sys.path.insert(0, str(BENCHMARKS / "dev"))
    try:
        import compare_revisions
    finally:
        sys.path.remove(str(BENCHMARKS / "dev"))
    runs = {"old": [{"prefill": p, "stepped": s} for p, s in ((1.0, 3.0), (2.0, 4.0), (9.0, 5.0))],
            "new": [{"prefill": p, "stepped": s} for p, s in ((0.5, 2.0), (1.5, 2.5), (0.9, 8.0))]}
    args = argparse.Namespace(what="generate", rev="HEAD", commit="abc1234", batch=3, rounds=3, calls=1, threads=1,
                              out=str(tmp_path / "g"))
    compare_revisions.write_generate_results(args, runs)
    text = (tmp_path / "g_batch3.md").read_text()
    assert "at HEAD = abc1234 (old)" in text and f"--out {os.path.relpath(tmp_path / 'g', REPO)}" in text
    assert "`benchmarks/dev/compare_revisions.py generate --rev HEAD --batch 3 --rounds 3 --calls 1 --out" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| mode")}
    assert rows["prefill"] == ["2.000", "0.900", "0.450"]
    assert rows["stepped"] == ["4.000", "2.500", "0.625"]
    assert rows["stepped / prefill"][:2] == ["2.000", "2.778"]
    args.out = str(compare_revisions.DEFAULT_OUT["generate"])  # the default --out is left out of the command
    assert "--out" not in compare_revisions.command_line(args, "")


@pytest.mark.parametrize("doc", ["README.md", "NOTES.md"])
def test_the_benchmark_docs_name_files_that_exist(doc):
    """Every markdown link and every backquoted ``paper/...``, ``dev/...`` or ``results/...`` path of
    benchmarks/README.md and NOTES.md points to a file (a moved or deleted result shows up here)."""
    text = (BENCHMARKS / doc).read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text)
    paths = re.findall(r"`((?:paper|dev)/[\w./]+\.(?:py|md|csv|png))`", text)
    missing = [p for p in links + paths if not p.startswith("http") and not (BENCHMARKS / p).exists()]
    assert links and paths and not missing, missing


def test_links_into_the_notes_name_a_section():
    """``NOTES.md#anchor`` links from benchmarks/README.md lead to a heading of NOTES.md (GitHub's slugs)."""
    headings = re.findall(r"^#+ (.+)$", (BENCHMARKS / "NOTES.md").read_text(), flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    anchors = re.findall(r"\]\(NOTES\.md#([^)\s]+)\)", (BENCHMARKS / "README.md").read_text())
    assert anchors and not [a for a in anchors if a not in slugs], (anchors, sorted(slugs))


def _import_script(name: str, room: str = "paper"):
    sys.path.insert(0, str(BENCHMARKS / room))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS / room))


def test_generation_times_the_trained_checkpoints(tmp_path, monkeypatch):
    """generation.py --trained RUNS loads each method's newest best checkpoint of mnist_table1.py's runs
    (both softmax methods the softmax run's), refuses a run of the wrong backend or a missing one, and
    says in the report which models it timed."""
    import lightning
    import torch

    from linformer_lab.tasks.image_generation import ImageGenerationTask

    generation = _import_script("generation")

    def save(run: str, backend: str, name: str, d_model: int) -> None:
        torch.manual_seed(0)
        task = ImageGenerationTask(attention={"backend": backend}, n_layers=1, n_heads=2, d_model=d_model, d_ff=16,
                                   num_mixtures=2)
        folder = tmp_path / f"mnist_cpu_{run}" / "version_0" / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                    "pytorch-lightning_version": lightning.__version__}, folder / name)

    save("linear", "linear", "best-epoch=0-step=1.ckpt", 8)
    save("linear", "linear", "best-epoch=0-step=2.ckpt", 16)  # written last: the newest best
    newest = tmp_path / "mnist_cpu_linear" / "version_0" / "checkpoints" / "best-epoch=0-step=2.ckpt"
    os.utime(newest, (newest.stat().st_mtime + 10, newest.stat().st_mtime + 10))  # not within one clock tick
    save("softmax", "linear", "best-epoch=0-step=1.ckpt", 8)  # a run of the wrong backend
    model = generation.trained_model("linear", str(tmp_path), "cpu")
    assert model.d_model == 16 and model.attention_config.backend == "linear" and not model.training
    with pytest.raises(SystemExit, match="is a linear model, not stateful-softmax"):
        generation.trained_model("stateful-softmax", str(tmp_path), "cpu")
    with pytest.raises(SystemExit, match="no best-.*mnist_cpu_lsh1.*--methods lsh1"):
        generation.trained_model("lsh-1", str(tmp_path), "cpu")

    generation.main(["--trained", str(tmp_path), "--quick", "--methods", "linear", "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "generation_cpu_quick_mnist_trained.md").read_text()
    assert f"trained CPU-recipe checkpoints of benchmarks/paper/mnist_table1.py under `{tmp_path}`" in text
    assert "| linear |" in text and "## CIFAR-10" not in text

    # mnist_table1.py's report shows those timings beside the paper's Tables 4 and 5
    mnist_table1 = _import_script("mnist_table1")
    monkeypatch.setattr(mnist_table1, "TIMINGS", tmp_path / "out" / "generation_cpu_quick_mnist_trained.csv")
    lines = mnist_table1.timing_lines()
    assert lines[1] == "## Tables 4 and 5 on these models" and "images/s, batch 8" in lines[-1]
    assert re.search(r"\| linear \| [\d.]+ \| 1x \| 5.5 \| 1x \| [\d.]+ \| 1x \| 142.8 \|", lines[-1]), lines[-1]
    monkeypatch.setattr(mnist_table1, "TIMINGS", tmp_path / "none.csv")
    assert mnist_table1.timing_lines() == []


@pytest.mark.slow
def test_cpu_floors_reports_a_training_update_against_the_gemm_rate(tmp_path):
    """dev/cpu_floors.py --quick: the GEMM rate, the training update with images/s, its share of the
    GEMM rate and a profile, under the common provenance header."""
    cpu_floors = _import_script("cpu_floors", "dev")
    cpu_floors.main(["--quick", "--out", str(tmp_path)])
    text = (tmp_path / "cpu_floors_quick.md").read_text()
    assert re.search(r"GEMM rate \(fp32 mm 512\^2\): \*\*\d+ GFLOP/s\*\*", text)
    assert "| mnist_cpu_linear.yaml, batch 4, fp32 |" in text and "aten::" in text
    assert "- command: `python benchmarks/dev/cpu_floors.py --quick --out DIR`" in text and "- machine: " in text
    rows = (tmp_path / "cpu_floors_quick.csv").read_text().splitlines()
    assert len(rows) == 2 and float(rows[1].split(",")[0]) > 0


def test_compare_revisions_train_child_times_updates_of_the_configs_model():
    """compare_revisions.py train's child: updates of configs/<config>'s model from the package it imported."""
    sys.path.insert(0, str(BENCHMARKS / "dev"))
    try:
        import compare_revisions
    finally:
        sys.path.remove(str(BENCHMARKS / "dev"))
    child = compare_revisions.train_child("mnist_cpu_linear.yaml", updates=1, threads=1)
    assert Path(child["package"]).resolve() == REPO and child["update"] > 0
    args = compare_revisions.parser().parse_args(["train", "--rev", "HEAD~1", "--updates", "2"])
    assert (args.config, args.rounds, args.updates, args.out) == (
        "mnist_cpu_linear.yaml", 5, 2, str(compare_revisions.DEFAULT_OUT["train"]))


def test_report_commands_show_the_note_as_dots():
    """mnist_table1.py and mnist_lr.py print their --note below the table: the command shows "..."."""
    mnist_table1 = _import_script("mnist_table1")
    assert mnist_table1.command_line("m.py", ["--methods", "lsh4", "--note", "long text", "--report-only"]) == (
        'python m.py --methods lsh4 --note "..." --report-only')
    assert mnist_table1.command_line("m.py", ["--methods", "lsh4"]) == "python m.py --methods lsh4"


def test_mnist_table1_reads_a_resumed_run_in_version_order(tmp_path, monkeypatch):
    """common.fit_run through mnist_table1.collect: a killed run logs updates past its last checkpoint;
    the resumed version logs them again and wins, also past version_9 (version_10 sorts before
    version_2 as text); the minutes add the fit's spans."""
    mnist_table1 = _import_script("mnist_table1")
    monkeypatch.setattr(mnist_table1, "root", lambda method: tmp_path / method)
    for version, rows in {2: [(499, 1.5), (999, 1.9)], 10: [(999, 1.4), (1499, 1.3)]}.items():
        folder = tmp_path / "linear" / f"version_{version}"
        folder.mkdir(parents=True)
        lines = ["epoch,step,val/bits_per_dim", *(f"0,{step},{bpd}" for step, bpd in rows)]
        (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "linear" / "fit_seconds.json").write_text('[{"start": 0, "end": 60}, {"start": 100, "end": 220}]')
    result = mnist_table1.collect("linear")
    assert result["curve"] == {500: 1.5, 1000: 1.4, 1500: 1.3}
    assert result["fit_minutes"] == 3.0 and result["test_bpd"] is None


@pytest.mark.slow
def test_every_mnist_probe_parses_through_the_real_cli():
    """Each probe of benchmarks/dev/mnist_probes.py is the README's MNIST command plus its flags: the
    CLI must accept them and hand every value over as given (an int that arrived as a float, or a
    flag the parser dropped, would make a probe measure something else)."""
    from conftest import run_cli

    sys.path.insert(0, str(BENCHMARKS / "dev"))
    try:
        import mnist_probes
    finally:
        sys.path.remove(str(BENCHMARKS / "dev"))
    for name, (_, changes) in mnist_probes.PROBES.items():
        flags = [*mnist_probes.BASE_ARGS, *changes]
        code, out, err = run_cli(["fit", "--config", "mnist_cpu_linear.yaml", *flags, "--print_config"])
        assert code == 0, f"{name}: {err[-2000:]}"
        printed = yaml.safe_load(out)
        sections = {"model": printed["model"]["init_args"], "data": printed["data"]["init_args"]}
        given = dict(flag[2:].split("=", 1) for flag in flags)  # later flags win, as in the CLI
        for key, value in given.items():
            section, field = key.split(".", 1)
            assert str(sections[section][field]) == value, f"{name}: {key} is {sections[section][field]!r}, given {value}"


def test_forward_backward_frees_its_own_gradients_inside_the_timed_call():
    """common.forward_backward: the backward runs inside the context (a substituted kernel serves
    forward and backward), and the inputs' gradients are gone when the call returns, so the next
    implementation timed does not pay for freeing them."""
    import contextlib

    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
    seen = {"inside": False, "backward_inside": None}

    @contextlib.contextmanager
    def context():
        seen["inside"] = True
        yield
        seen["inside"] = False

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            seen["backward_inside"] = seen["inside"]
            return 2 * g

    x = torch.ones(3, requires_grad=True)
    grads = []
    call = common.forward_backward(lambda: Double.apply(x), (x,), torch.ones(3), context)
    x.register_post_accumulate_grad_hook(lambda t: grads.append(t.grad.clone()))
    call()
    assert seen["backward_inside"] is True and x.grad is None
    assert torch.equal(grads[0], torch.full((3,), 2.0))


def test_interleaved_rounds_rotate_the_order():
    """common.interleaved_medians: rounds A B C, C B A, B C A, A C B, ...: each callable runs right
    after each other one as often as right before it (a kernel timed right after another on the
    same tensors finds them in cache)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = common.interleaved_medians(fns, repeats=4, warmup=0)
    assert "".join(calls) == "abc" + "cba" + "bca" + "acb"
    pairs = ["".join(calls)[i:i + 2] for i in range(0, 12, 3)] + ["".join(calls)[i + 1:i + 3] for i in range(0, 12, 3)]
    assert pairs.count("ab") == pairs.count("ba") and pairs.count("bc") == pairs.count("cb")
    assert all(len(times[name]["samples"]) == 4 for name in "abc")


def test_command_line_shows_arguments_but_not_folders():
    """Report headers quote the command as run, with --out as DIR: no machine path in a result."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
    shown = common.command_line("benchmarks/paper/gpu_check.py", ["--part", "kernel", "--out", "runs/k", "--budget-s", "230"])
    assert shown == "python benchmarks/paper/gpu_check.py --part kernel --out DIR --budget-s 230"
    assert common.command_line("g.py", ["--out=runs/results", "--tag", "out"]) == "python g.py --out=DIR --tag out"


@pytest.mark.slow
def test_mnist_lr_reads_settings_from_the_saved_config(tmp_path):
    """dev/mnist_lr.py: lr, seed and attention come from each run's saved config.yaml, validation
    and test bits/dim from its metrics, minutes from fit_seconds.json; a wrong root is named."""
    run = tmp_path / "runs" / "linear_lr"
    (run / "version_0").mkdir(parents=True)
    (run / "version_1").mkdir()
    config = {"seed_everything": 3, "trainer": {"max_steps": 1000, "gradient_clip_val": 0.5},
              "model": {"init_args": {"lr": 0.0007, "attention": {"backend": "linear"}}}}
    (run / "version_0" / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "version_0" / "metrics.csv").write_text("epoch,step,val/bits_per_dim\n0,499,1.5\n0,999,1.25\n")
    (run / "version_1" / "metrics.csv").write_text("epoch,step,test/bits_per_dim\n0,1000,1.2345678\n")
    (run / "fit_seconds.json").write_text('[{"start": 0, "end": 1800}]')
    out = tmp_path / "mnist_lr"
    mnist_lr = _import_script("mnist_lr", "dev")  # its main in this process: its start is the --help test's
    assert mnist_lr.main(["--run", str(run), "--out", str(out)]) == 0
    row = next(csv.DictReader(Path(f"{out}.csv").read_text().splitlines()))
    assert (row["lr"], row["seed"], row["attention"], row["fit_minutes"]) == ("0.0007", "3", "linear", "30.0")
    assert (row["val_bpd_500"], row["val_bpd_1000"], row["test_bpd"]) == ("1.5", "1.25", "1.2345678")
    assert "| linear_lr | linear | 0.0007 | 0.5 | 3 | 1000 | 30.0 | 1.2346 | 1.25 |" in Path(f"{out}.md").read_text()
    with pytest.raises(SystemExit, match="config.yaml not found"):
        mnist_lr.main(["--run", str(tmp_path), "--out", str(out)])
