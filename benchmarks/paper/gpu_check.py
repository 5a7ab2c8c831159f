"""The one prepared GPU check of linformer_lab: one call on a lent GPU (15 minutes of device time,
the machine's start included), every target of the project's GPU issue measured, tables written to
``--out``.

    uv run python benchmarks/paper/gpu_check.py --export-previous REV    # here: the kernel to time beside ours
    PYTHONPATH=. python3 benchmarks/paper/gpu_check.py --out DIR --cache .gpu_cache    # on a GPU node
    uv run python benchmarks/paper/gpu_check.py --dry-run --out DIR [--cache .gpu_cache]    # every code path, CPU

Parts, in the order of what they decide, each run as a child process with its share of
``--budget-s`` (:data:`PARTS`; time a part leaves unused passes on, and the last, Fig. 2, gets all
that is left). A part checks its budget before every step (a step that would not fit is skipped
and listed under "Skipped"), and a part still running :data:`GRACE_S` after its budget is
stopped: every row it measured is already in its journal, so the report keeps them.

1. ``kernel``: ours (Triton, fused elu and normaliser) beside its previous revision and SDPA over
   the issue's grid, then beside fla, then beside the ``.cu`` numerator, fwd and fwd+bwd, bf16,
   interleaved; each kernel's share of our fwd+bwd and the launches per call at B2 T16384 H16
   D128 (torch.profiler); the HBM roofline fraction of our forward there (``gpu_check_kernel.py``);
2. ``train``: ``mnist_linear.yaml`` against ``mnist_softmax.yaml`` training images/s and GPU-busy
   ms per update (``gpu_check_model.py``);
3. ``generation``: MNIST batch-1 seconds per image, linear against stateful softmax at batch
   1,000 (both graphed), the largest linear batch;
4. ``tests``: ``cli.py plugins --check`` (every kernel compiled and compared with its reference),
   then the GPU tests through pytest (:data:`GPU_TESTS`), with a junit file;
5. ``figure2``: ``figure2_copy.py --paper`` (the paper's copy task) for the time left.

The compiled extensions (three C++ ones, the ``.cu`` numerator; those the chosen parts use) are
built at the start, one process each (a dry run: the C++ ones in one), beside the first parts
(:class:`Prebuild`): the kernel part times the ``.cu`` numerator last, once it is built, and the
tests wait for the builds. ``--cache DIR`` (the
git-ignored ``.gpu_cache``) brings what an earlier run compiled (Triton's cache: ours, fla's,
their autotune results; the extensions' builds) and the previous revision of our kernel
(``--export-previous``); ``gpu_check_cache.py`` says what each holds.

Writes to ``--out``: ``gpu_check_<device>.md`` (device, versions, date, command, the targets table,
every table), ``gpu_check_<device>.csv`` (all rows), ``gpu_check_<device>_pytest.txt`` (pytest's
summary) and ``_junit.xml``, ``gpu_check_logs.tar.gz`` (each part's log and journal,
``plugins_check.json``, ``pytest.log``, ``prebuild.log``, Fig. 2's reports) and, on a GPU,
``triton_cache.tar.gz`` and ``extensions.tar.gz`` for the next run's ``--cache``: seven files,
inside the device tool's limit of eight. ``--dry-run`` runs all parts at toy sizes on the CPU
(Triton interpreted; the graph step run eagerly; no compilation; pytest only collects the GPU
tests), which ``tests/benchmarks/test_gpu_check.py`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (the parts sit beside this script)
import common  # noqa: E402
import gpu_check_cache  # noqa: E402
import gpu_check_kernel  # noqa: E402
import gpu_check_model  # noqa: E402
import gpu_check_report  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: The GPU test files, in the order they run (the most important first: a part stopped at its
#: budget loses the last). Their CPU tests run too; a GPU-less machine skips the rest.
GPU_TESTS = ["tests/ops/test_triton_chunk_gpu.py", "tests/models/test_generation_graph.py",
             "tests/models/test_generation_fused_step.py", "tests/tasks/test_graphed_update.py",
             "tests/ops/test_linear_cuda_gpu.py", "tests/ops/test_triton_chunk.py"]
#: What makes tests/ops/test_triton_chunk.py run on the GPU instead of skipping there.
GPU_TEST_ENV = {"LINFORMER_LAB_TRITON_TESTS": "cuda"}
#: Seconds of each part at the default budget (shares of ``--budget-s``), in the order they run,
#: planned from the first run on an H200 (benchmarks/NOTES.md, "What the GPU sessions found"), a
#: bare machine: the kernel grid 240 (ours beside its previous revision and SDPA at the 7 shapes,
#: ~12 s each with the first calls' compilations, the previous revision's autotuning 13.2 s over
#: two widths; then fla, whose first forward and forward+backward at a new shape took 70-98 s
#: without its autotune results, so without a carried cache one or two shapes; then the .cu
#: numerator, ~8 s a shape); training 70 (eager and graphed rows of both configs at batch 10 and
#: 64, ~8 s each: the eager batch-10 row's warm-up took 6 s; compiled rows where time is left);
#: generation 40 (30 s held 7 of its 14 rows); the tests 90 (plugins --check
#: compiles every Triton kernel in fp32 and bf16; pytest gets the rest, 50 s ran one test of a
#: bare machine, so with nothing carried the later files are cut, and the junit file says where);
#: Fig. 2 the rest (it needs ~120 s: only a rerun or a part that left time gets it). With the
#: machine's start (~3 min) and the wheels' install, one run leaves about 3.5 minutes of the 15
#: for a rerun of a part.
PARTS = {"kernel": 240, "train": 70, "generation": 40, "tests": 90, "figure2": 10}
#: A part still running this long after its budget is stopped (its own checks should stop it first).
GRACE_S = 20
#: The C++ extensions of ``linformer_lab.ops.cpu`` that :class:`Prebuild` builds (the .cu one too on a GPU).
CPU_EXTENSIONS = ("CAUSAL_RECURRENCE", "FUSED_STEP", "LSH_WINDOW")
#: Longest the extensions' builds may take together (one after another, two of the three C++ ones
#: took 120 s on a bare H200 machine; at once, beside the kernel part, on its 16 cores), times the
#: extensions a process builds one after another (a dry run's one process builds the three C++
#: ones: 130 s without a cached build on an idle 2-core CPU).
PREBUILD_S = 150
#: pytest is interrupted (SIGINT: it still writes its junit file and summary) this long before the
#: tests part's budget ends.
PYTEST_STOP_S = 10
#: What the tests part leaves in its folder, copied beside the report as gpu_check_<device>_...
PYTEST_SUMMARY, JUNIT = "pytest_summary.txt", "junit.xml"
#: The Triton cache folders the parts compiled or loaded (``gpu_check_cache.record_compilations``).
USED_KERNELS = "triton_used.txt"


class Journal(list):
    """A list whose items are also appended, as JSON lines, to a file: what a part measured
    survives the part being stopped."""

    def __init__(self, path: Path | None, kind: str):
        super().__init__()
        self.path, self.kind = path, kind

    def append(self, item) -> None:
        super().append(item)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({self.kind: item}, default=str) + "\n")


class Budget:
    """Seconds left for a part; steps that would not fit are recorded as skipped; ``keep(rows)``
    records measured rows as they come (in the part's journal when there is one)."""

    def __init__(self, seconds: float, skipped: list[str] | None = None, journal: Path | None = None):
        self.end = time.monotonic() + seconds
        self.skipped = Journal(journal, "skipped") if skipped is None else skipped
        self.rows = Journal(journal, "row")

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float, what: str) -> bool:
        if self.left() < seconds:
            self.skipped.append(f"{what} (needs ~{seconds:.0f} s, {max(self.left(), 0):.0f} s left)")
            return False
        return True

    def keep(self, rows: list[dict]) -> list[dict]:
        for row in rows:
            self.rows.append(row)
        return rows


def read_journal(path: Path) -> tuple[list[dict], list[str]]:
    """``(rows, skipped)`` a part wrote to its journal (a line cut by a stop is dropped)."""
    rows, skipped = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        (rows.append(item["row"]) if "row" in item else skipped.append(item["skipped"]))
    return rows, skipped


def run_part(command: list[str], seconds: float, log: Path, env: dict | None = None,
             first: int = signal.SIGTERM) -> tuple[int | None, float]:
    """Run ``command`` (a part's child, or any command) with output to ``log``, in its own process
    group, stopped with everything it started (pytest, training runs) after ``seconds``, by
    ``first`` then SIGTERM and SIGKILL: ``(exit code or None when stopped, seconds taken)``."""
    start = time.monotonic()
    with open(log, "a") as out:
        # SIGINT back to its default in the child: a process started with SIGINT ignored (a background
        # job of a script, an xdist worker) passes that on, and Python then never raises KeyboardInterrupt
        child = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            return child.wait(timeout=max(seconds, 1)), time.monotonic() - start
        except subprocess.TimeoutExpired:
            for sig, wait in ((first, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(child.pid, sig)
                    child.wait(timeout=wait)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            out.write(f"\n[stopped after {time.monotonic() - start:.0f} s: over its {seconds:.0f} s]\n")
            return None, time.monotonic() - start


def device_label(device: str) -> str:
    """``h100`` style name for files: the GPU's model, or ``cpu_dry_run``."""
    if device != "cuda":
        return "cpu_dry_run"
    import torch

    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"[^A-Za-z0-9]+", "_", name)).lower()


def _env() -> dict:
    return {**os.environ, **GPU_TEST_ENV, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class Prebuild:
    """The compiled extensions that the chosen ``parts`` use built at once, one process each, into
    the build cache that the parts then load from (a failed build is no failure here: ``plugins
    --check`` reports it): the C++ ones for the tests, the ``.cu`` one on a GPU for the kernel part
    and the tests; every one for the whole command. In the background: the parts run meanwhile;
    when all are done, :data:`gpu_check_kernel.PREBUILD_FILE` appears in ``work`` (the kernel part
    and the tests wait for it). :meth:`row` waits. A dry run builds the C++ ones in one process,
    one after another: cached (as the suite's other tests leave them) they only load, and on a CPU each process's
    start, importing torch, costs more than loading (~5 s against ~0.1 s)."""

    def __init__(self, device: str, work: Path, parts: list[str]):
        cpu = CPU_EXTENSIONS if "tests" in parts else ()
        cu = device == "cuda" and bool({"kernel", "tests"} & set(parts))
        groups = [[name] for name in cpu] if device == "cuda" else [list(cpu)] if cpu else []
        commands = [["-c", "from linformer_lab.ops import cpu; " + "; ".join(f"cpu.{name}.load()" for name in group)]
                    for group in groups]
        commands += [["-m", "linformer_lab.ops.cuda", "build"]] if cu else []
        # the extensions of each process, in the processes' order
        self.built_by = [[f"cpu.{name}" for name in group] for group in groups] + ([["linear_cuda"]] if cu else [])
        self.work, self.start = work, time.monotonic()
        with open(work / "prebuild.log", "a") as log:
            self.children = [subprocess.Popen([sys.executable, *c], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                              env=_env(), start_new_session=True) for c in commands]
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        codes = []
        for child, names in zip(self.children, self.built_by):
            try:
                codes.append(child.wait(timeout=max(self.start + PREBUILD_S * len(names) - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                codes.append(None)
        # an extension's exit code: its process's
        by_name = {name: code for names, code in zip(self.built_by, codes) for name in names}
        built = list(by_name.values())
        self.result = {"part": "build", "method": f"build {len(built)} extensions at once",
                       "seconds": time.monotonic() - self.start, "exit": next((c for c in codes if c != 0), 0),
                       "result": f"{built.count(0)} of {len(built)} built or cached", **by_name}
        (self.work / gpu_check_kernel.PREBUILD_FILE).write_text(json.dumps(self.result))

    def row(self) -> dict:
        self.thread.join()
        return self.result


def wait_for(path: Path, budget: Budget) -> bool:
    """Wait until ``path`` exists, within the budget: whether it does."""
    while not path.exists() and budget.left() > 1:
        time.sleep(1)
    return path.exists()


def part_tests(device: str, budget: Budget, out: Path, dry_run: bool) -> list[dict]:
    """Once the extensions are built (:class:`Prebuild`): ``cli.py plugins --check --json`` (a row
    per kernel, device and dtype), then pytest on :data:`GPU_TESTS` with :data:`GPU_TEST_ENV` and a
    junit file (collection only in a dry run), interrupted before the budget ends so that it still
    writes the junit file and its summary (:data:`PYTEST_SUMMARY`)."""
    if not wait_for(out / gpu_check_kernel.PREBUILD_FILE, budget):
        budget.skipped.append("the tests: the extensions' builds were not done within the part's budget")
        return []
    check = out / "plugins_check.json"
    code, seconds = run_part([sys.executable, "cli.py", "plugins", "--check", "--json"], min(120, budget.left()),
                             check, env=_env())
    text = check.read_text()
    try:  # the JSON report, then any error lines (stderr goes to the same file)
        results = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]["kernel_check"]
    except (ValueError, KeyError):
        results = []
        budget.skipped.append(f"cli.py plugins --check: no report (exit {code}; its output is in the logs)")
    budget.keep([{"part": "kernel_check", **r} for r in results])
    budget.keep([{"part": "tests", "method": "cli.py plugins --check", "seconds": seconds, "exit": code,
                  "result": ", ".join(f"{sum(r['status'] == s for r in results)} {s}"
                                      for s in ("pass", "FAIL", "error", "not here"))}])
    files = [f for f in GPU_TESTS if (REPO / f).exists()]
    command = [sys.executable, "-m", "pytest", *files, "-v", "-p", "no:cacheprovider", "-rfE", "--durations=15",
               f"--junitxml={out / JUNIT}"] + (["--collect-only", "-q"] if dry_run else [])
    log = out / "pytest.log"
    code, seconds = run_part(command, budget.left() - PYTEST_STOP_S, log, env=_env(), first=signal.SIGINT)
    text = log.read_text()
    (out / PYTEST_SUMMARY).write_text(pytest_summary(text, files, code))
    counts = {word: len(re.findall(rf" {word}\b", text)) for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    last = ([line for line in text.splitlines() if line.strip()] or ["(no output)"])[-1]
    result = last if code is not None else f"stopped at its budget: {counts}"
    return budget.keep([{"part": "tests", "method": " ".join(files), "result": result, "exit": code, "seconds": seconds,
                         **{k.lower(): v for k, v in counts.items()}, "env": " ".join(f"{k}={v}" for k, v in
                                                                          GPU_TEST_ENV.items())}])


def pytest_summary(log: str, files: list[str], code: int | None) -> str:
    """What pytest's log says in the end: the command's files and exit, then its sections from
    the slowest durations or the short summary on (failures' tracebacks stay in the log)."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"=+ (slowest|short test summary)", line)),
                 max(len(lines) - 40, 0))
    return "\n".join([f"pytest {' '.join(files)} ({' '.join(f'{k}={v}' for k, v in GPU_TEST_ENV.items())}): "
                      f"exit {'stopped at its budget' if code is None else code}", "", *lines[start:]]) + "\n"


def run_child(args) -> int:
    """One part in this process (``--child PART``), its rows and skips journaled as they come."""
    device = "cpu" if args.dry_run else "cuda"
    budget = Budget(args.budget_s, journal=args.journal)
    gpu_check_cache.record_compilations(args.out / USED_KERNELS)
    previous = args.cache / gpu_check_cache.PREVIOUS_DIR if args.cache else None
    parts = {"tests": lambda: part_tests(device, budget, args.out, args.dry_run),
             "kernel": lambda: gpu_check_kernel.measure(device, budget, args.dry_run, args.out, previous),
             "train": lambda: gpu_check_model.training(device, budget, args.dry_run),
             "generation": lambda: gpu_check_model.generation(device, budget, args.dry_run),
             "figure2": lambda: gpu_check_model.figure2(device, budget, args.out, args.dry_run)}
    parts[args.child]()
    return 0


def carried(args, device: str) -> list[str]:
    """Restore what ``--cache`` carries (on a GPU: a dry run leaves this machine's caches alone),
    and say what it brought."""
    if args.cache is None:
        return ["Nothing carried (no `--cache`): every first call compiles, fla's autotunes."]
    lines = []
    if device == "cuda":
        triton = gpu_check_cache.restore_triton_cache(args.cache / gpu_check_cache.TRITON_ARCHIVE)
        builds = gpu_check_cache.restore_extensions(args.cache / gpu_check_cache.EXTENSIONS_ARCHIVE)
        lines.append(f"Carried from an earlier run (`--cache`): {triton['kernels']} compiled Triton kernels, "
                     f"{triton['autotune']} autotune results, {builds} extension builds.")
    revision = gpu_check_cache.exported_revision(args.cache / gpu_check_cache.PREVIOUS_DIR)
    lines.append(f"Previous revision of our kernel (`ours_prev`): {revision or 'none exported'}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the result files")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (what the tests run)")
    parser.add_argument("--budget-s", type=float, default=float(sum(PARTS.values())),
                        help=f"seconds for all parts (default {sum(PARTS.values())})")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help=f"what an earlier run on the same kind of GPU compiled ({gpu_check_cache.TRITON_ARCHIVE}, "
                             f"{gpu_check_cache.EXTENSIONS_ARCHIVE}) and the previous kernel "
                             f"({gpu_check_cache.PREVIOUS_DIR}/); the device command's is {gpu_check_cache.CACHE_DIR}")
    parser.add_argument("--export-previous", metavar="REV",
                        help="write the Triton chunk kernel of git revision REV into the --cache folder (default "
                             f"{gpu_check_cache.CACHE_DIR}) for timing beside the working tree's, and exit")
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, in a child process
    parser.add_argument("--journal", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.export_previous:
        folder = (args.cache or REPO / gpu_check_cache.CACHE_DIR) / gpu_check_cache.PREVIOUS_DIR
        commit = gpu_check_cache.export_previous(args.export_previous, folder)
        print(f"exported the Triton chunk kernel of {commit} to {folder}")
        return 0
    if args.out is None:
        parser.error("--out is required (or --export-previous REV)")
    if args.dry_run:  # before anything imports Triton: the kernels run in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.child:
        return run_child(args)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU node, or add --dry-run for the CPU toy run")
    device = "cpu" if args.dry_run else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"  # the parts' autotune results land in Triton's cache, then the archive
    notes = carried(args, device)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    names = [p for p in PARTS if p in args.parts]
    prebuild = Prebuild(device, work, names)
    end, skipped, rows = time.monotonic() + args.budget_s, [], []
    for i, name in enumerate(names):
        left = end - time.monotonic()
        share = max(left * PARTS[name] / sum(PARTS[p] for p in names[i:]), 0)
        journal, log = work / f"{name}.jsonl", work / f"{name}.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--journal", str(journal),
                   "--budget-s", f"{share:.1f}", "--out", str(work), *(["--dry-run"] if args.dry_run else []),
                   *(["--cache", str(args.cache.resolve())] if args.cache else [])]
        code, seconds = run_part(command, share + GRACE_S, log)
        got, skips = read_journal(journal)
        rows += got
        skipped += skips
        if code is None:
            skipped.append(f"part {name} stopped after {seconds:.0f} s (its budget {share:.0f} s): "
                           f"the {len(got)} rows it measured before are kept")
        elif code:
            tail = " | ".join(log.read_text().strip().splitlines()[-3:])[-400:]
            skipped.append(f"part {name} failed (exit {code}): {tail}")
        print(f"== {name}: {seconds:.0f} s of {share:.0f} s, {len(got)} rows ==", flush=True)
    rows.insert(0, prebuild.row())
    stem = args.out / f"gpu_check_{device_label(device)}"
    for name, suffix in ((PYTEST_SUMMARY, "_pytest.txt"), (JUNIT, "_junit.xml")):
        if (work / name).is_file():
            shutil.copy(work / name, f"{stem}{suffix}")
    if device == "cuda":  # for the next run's --cache
        used = set((work / USED_KERNELS).read_text().split()) if (work / USED_KERNELS).is_file() else set()
        triton = gpu_check_cache.save_triton_cache(args.out / gpu_check_cache.TRITON_ARCHIVE, used)
        builds = gpu_check_cache.save_extensions(args.out / gpu_check_cache.EXTENSIONS_ARCHIVE)
        notes.append(f"Saved for the next run's `--cache`: {triton['kernels']} compiled Triton kernels ({triton['used']} "
                     f"of them used by the timed parts, {triton['left_out']} left out at the size cap), "
                     f"{triton['autotune']} autotune results, {triton['bytes'] / 2**20:.1f} MiB; {builds} extension builds.")
    md = gpu_check_report.report(rows, skipped, args.argv, device, notes)
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    common.write_csv(str(stem.with_suffix(".csv")), rows)
    with tarfile.open(args.out / "gpu_check_logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpu_check_logs")
    table = md.index("## Targets (the GPU-speed issue; ratios from this run)")
    print("\n".join(md[table:table + 12]))
    print("\n".join(f"skipped: {s}" for s in skipped))
    print(f"wrote {', '.join(sorted(p.name for p in args.out.iterdir()))} to {args.out}"
          + ("; copy the two cache archives into .gpu_cache/ for the next run" if device == "cuda" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
