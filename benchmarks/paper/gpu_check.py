"""The one prepared GPU check of linformer_lab: one call on a lent GPU (15 minutes of device time,
the machine's start included), every target of the project's GPU issue measured, tables written to
``--out``.

    PYTHONPATH=. python3 benchmarks/paper/gpu_check.py --out DIR           # on a GPU node
    uv run python benchmarks/paper/gpu_check.py --dry-run --out DIR         # every code path, toy sizes, CPU

Parts, in order, each run as a child process with its share of ``--budget-s`` (:data:`PARTS`;
time a part leaves unused passes on, and the last, Fig. 2, gets all that is left). A part checks
its budget before every step (a step that would not fit is skipped and listed under "Skipped"),
and a part still running :data:`GRACE_S` after its budget is stopped: every row it measured is
already in its journal, so the report keeps them.

1. ``tests``: ``cli.py plugins --check`` (every kernel compiled and compared with its reference),
   then the GPU tests through pytest: the Triton kernel's GPU file, the graph-decoder tests, the
   CUDA numerator's GPU file, and the Triton interpreter tests run on the GPU
   (``LINFORMER_LAB_TRITON_TESTS=cuda``), in that order;
2. ``kernel``: ours (Triton, fused elu and normaliser), the earlier CUDA kernel, fla's
   ``chunk_linear_attn(normalize=True)`` and SDPA, fwd and fwd+bwd, bf16, interleaved, on the
   issue's grid; the first call of each (Triton's compilation and autotuning); the HBM roofline
   fraction of our forward at B2 T16384 H16 D128 (``gpu_check_kernel.py``);
3. ``train``: ``mnist_linear.yaml`` against ``mnist_softmax.yaml`` training images/s, eager and
   compiled (``gpu_check_model.py``);
4. ``generation``: MNIST batch-1 seconds per image, linear against stateful softmax at batch
   1,000 (both graphed), the largest linear batch;
5. ``figure2``: ``figure2_copy.py --paper`` (the paper's copy-task model, our and the authors'
   recipe, fp32 and bf16) for the time left.

Writes ``gpu_check_<device>.md`` (device, versions, date, command, the targets table, every table),
``gpu_check_<device>.csv`` (all rows) and ``gpu_check_logs.tar.gz`` (each part's log and journal,
``plugins_check.json``, ``pytest.log``, Fig. 2's reports): three files, inside the device tool's
limit of eight. ``--dry-run`` runs all parts at toy sizes on the CPU (Triton interpreted; the graph
step run eagerly; no compilation; pytest only collects the GPU tests), which
``tests/benchmarks/test_gpu_check.py`` runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (the parts sit beside this script)
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: The GPU test files, in the order they run (the most important first: a part stopped at its
#: budget loses the last). Their CPU tests run too; a GPU-less machine skips the rest.
GPU_TESTS = ["tests/ops/test_triton_chunk_gpu.py", "tests/models/test_generation_graph.py",
             "tests/ops/test_linear_cuda_gpu.py", "tests/ops/test_triton_chunk.py"]
#: What makes tests/ops/test_triton_chunk.py run on the GPU instead of skipping there.
GPU_TEST_ENV = {"LINFORMER_LAB_TRITON_TESTS": "cuda"}
#: Seconds of each part at the default budget (shares of ``--budget-s``), in the order they run,
#: planned from the first run on an H200 (benchmarks/NOTES.md, "What the GPU sessions found"):
#: tests 140, the extensions built at once (built one after another they took all of
#: plugins --check's 120 s on a bare machine), plugins --check (Triton compiles its kernels for fp32
#: and bf16, forward and backward), then the GPU tests (each new shape compiles: the interpreter
#: file, last, may be cut); the kernel grid 200 (the 7 shapes without fla, about 12 s each, then
#: fla beside ours at the longest shape, whose first forward and forward+backward there took 105 s); training 40
#: (eager); generation 30; Fig. 2 the rest (it needs ~120 s, so only a rerun or a part another left
#: time to gets it). With the machine's start and the wheels' install, one run leaves about 3.5
#: minutes of the 15 for a rerun of a part.
PARTS = {"tests": 140, "kernel": 200, "train": 40, "generation": 30, "figure2": 10}
#: A part still running this long after its budget is stopped (its own checks should stop it first).
GRACE_S = 20
#: The C++ extensions of ``linformer_lab.ops.cpu`` that :func:`prebuild` builds (the .cu one too on a GPU).
CPU_EXTENSIONS = ("CAUSAL_RECURRENCE", "FUSED_STEP", "LSH_WINDOW")
#: Longest the extensions' builds may take together.
PREBUILD_S = 100


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


def run_part(command: list[str], seconds: float, log: Path, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``command`` (a part's child, or any command) with output to ``log``, in its own process
    group, stopped with everything it started (pytest, training runs) after ``seconds``: ``(exit
    code or None when stopped, seconds taken)``."""
    start = time.monotonic()
    with open(log, "a") as out:
        child = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=env)
        try:
            return child.wait(timeout=max(seconds, 1)), time.monotonic() - start
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
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


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(title: str, script: str, argv: list[str], device: str) -> list[str]:
    import torch

    info = common.machine_info()
    where = f"GPU {torch.cuda.get_device_name()}" if device == "cuda" else "CPU (dry run, toy sizes)"
    return [f"# {title}", "",
            f"Date {time.strftime('%Y-%m-%d %H:%M')} UTC; {where}; host {info.get('cpu')}; torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}); Triton {_version('triton')}; fla {_version('flash-linear-attention')}; "
            f"command: `{common.command_line(script, argv)}`", ""]


def _env() -> dict:
    return {**os.environ, **GPU_TEST_ENV, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def prebuild(device: str, budget: Budget, out: Path) -> None:
    """Build every compiled extension at once, one process each, into the build cache that
    ``plugins --check`` then loads from (a failed build is no failure here: the check reports it)."""
    commands = [["-c", f"from linformer_lab.ops import cpu; cpu.{name}.load()"] for name in CPU_EXTENSIONS]
    commands += [["-m", "linformer_lab.ops.cuda", "build"]] if device == "cuda" else []
    start, codes = time.monotonic(), []
    with open(out / "prebuild.log", "a") as log:
        children = [subprocess.Popen([sys.executable, *c], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                     start_new_session=True) for c in commands]
        for child in children:
            try:
                codes.append(child.wait(timeout=max(start + min(PREBUILD_S, budget.left()) - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                codes.append(None)
    budget.keep([{"part": "tests", "method": f"build {len(commands)} extensions at once", "seconds": time.monotonic() - start,
                  "exit": next((c for c in codes if c != 0), 0),
                  "result": f"{codes.count(0)} of {len(commands)} built or cached"}])


def part_tests(device: str, budget: Budget, out: Path, dry_run: bool) -> list[dict]:
    """The extensions built at once (:func:`prebuild`), ``cli.py plugins --check --json`` (a row
    per kernel, device and dtype), then pytest on :data:`GPU_TESTS` with :data:`GPU_TEST_ENV`
    (collection only in a dry run)."""
    prebuild(device, budget, out)
    log = out / "pytest.log"
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
    command = [sys.executable, "-m", "pytest", *files, "-v", "-p", "no:cacheprovider", "-rfE", "--durations=15"]
    code, seconds = run_part(command + (["--collect-only", "-q"] if dry_run else []), budget.left(), log, env=_env())
    text = log.read_text()
    counts = {word: len(re.findall(rf" {word}\b", text)) for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    last = ([line for line in text.splitlines() if line.strip()] or ["(no output)"])[-1]
    result = last if code is not None else f"stopped at its budget: {counts}"
    return budget.keep([{"part": "tests", "method": " ".join(files), "result": result, "exit": code, "seconds": seconds,
                         **{k.lower(): v for k, v in counts.items()}, "env": " ".join(f"{k}={v}" for k, v in
                                                                          GPU_TEST_ENV.items())}])


def _best(rows, part, key, **match):
    values = [r[key] for r in rows if r["part"] == part and r.get(key) and all(r.get(k) == v for k, v in match.items())]
    return values


def targets(rows: list[dict]) -> list[list]:
    """The issue's targets table, filled from the rows: ``[what, must, aim, measured, verdict]``."""
    import gpu_check_kernel

    against = gpu_check_kernel.rounds_against(rows)
    out = []

    def ratio(ours, other, key, shapes):
        kernel = against(other)
        got = [m[ours][f"{key}_ms"] / m[other][f"{key}_ms"] for s, m in kernel.items() if s in shapes
               and m.get(ours, {}).get(f"{key}_ms") and m.get(other, {}).get(f"{key}_ms")]
        return got

    grid = set(gpu_check_kernel.GRID)
    vs_fla = ratio("ours", "fla", "fwd_bwd", grid)
    long = ratio("ours", "fla", "fwd_bwd", {s for s in grid if s[1] >= 8192})
    timed = len(vs_fla) == len(grid)
    out.append(["causal fwd+bwd vs fla (ours / fla)", "≤ 1 at every shape", "≤ 0.6 at T ≥ 8,192",
                f"max {max(vs_fla):.2f} over {len(vs_fla)} of {len(grid)} shapes, at T ≥ 8,192 max {max(long):.2f}"
                if vs_fla and long else "not measured",
                "met where timed" if vs_fla and max(vs_fla) <= 1 and not timed
                else _verdict(vs_fla and max(vs_fla) <= 1, long and max(long) <= 0.6)])
    from_4k = ratio("ours", "sdpa", "fwd_bwd", {s for s in grid if s[1] >= 4096})
    from_2k = ratio("ours", "sdpa", "fwd_bwd", {s for s in grid if s[1] >= 2048})
    out.append(["vs SDPA causal fwd+bwd (ours / sdpa)", "< 1 from T = 4,096", "< 1 from T = 2,048",
                f"max from 4,096: {max(from_4k):.2f}; from 2,048: {max(from_2k):.2f}" if from_4k and from_2k else "not measured",
                _verdict(from_4k and max(from_4k) < 1, from_2k and max(from_2k) < 1)])
    roof = [r["fraction"] for r in rows if r["part"] == "roofline"]
    out.append(["B2 T16384 H16 D128 fwd, HBM roofline fraction", "≥ 25 %", "≥ 50 %",
                f"{roof[0]:.1%}" if roof else "not measured", _verdict(roof and roof[0] >= 0.25, roof and roof[0] >= 0.5)])
    train = {(r["config"], r["compile"], r["batch"]): r["images_per_s"] for r in rows if r["part"] == "train"}
    pairs = [(c, b) for (cfg, c, b) in train if cfg == "mnist_linear.yaml" and ("mnist_softmax.yaml", c, b) in train]
    best = max(pairs, key=lambda p: train[("mnist_linear.yaml", *p)], default=None)
    if best:
        lin, soft = train[("mnist_linear.yaml", *best)], train[("mnist_softmax.yaml", *best)]
        out.append(["mnist_linear vs mnist_softmax training images/s", "≥ 1.0×", "≥ 1,500 images/s",
                    f"{lin / soft:.2f}× ({lin:.0f} vs {soft:.0f}; compile={best[0]}, batch {best[1]})",
                    _verdict(lin / soft >= 1.0, lin >= 1500)])
    else:
        out.append(["mnist_linear vs mnist_softmax training images/s", "≥ 1.0×", "≥ 1,500 images/s", "not measured", "—"])
    latency = _best(rows, "generation", "seconds_per_image", method="linear", role="latency")
    out.append(["MNIST batch-1 generation, s per image (linear, best decoder)", "≤ 0.15", "≤ 0.05",
                f"{min(latency):.3f}" if latency else "not measured", _verdict(latency and min(latency) <= 0.15,
                                                                             latency and min(latency) <= 0.05)])
    big = [r for r in rows if r["part"] == "generation" and r["role"] == "largest"]
    top = max(big, key=lambda r: r["images_per_s"], default=None)
    out.append(["MNIST generation at the largest batch, images/s", "≥ 5,000", "≥ 20,000",
                f"{top['images_per_s']:.0f} (batch {top['batch']}, {top['step_weights']})" if top else "not measured",
                _verdict(top and top["images_per_s"] >= 5000, top and top["images_per_s"] >= 20000)])
    mid = {(r["method"], r["step_weights"]): r["images_per_s"] for r in rows
           if r["part"] == "generation" and r["role"] == "batch 1,000" and r["decoder"] == "graph"}
    ratios = [(w, mid["linear", w] / mid["stateful-softmax", w]) for w in ("model", "bfloat16")
              if ("linear", w) in mid and ("stateful-softmax", w) in mid]
    out.append(["linear ÷ stateful-softmax images/s at batch 1,000 (both graphed)", "≥ 5×", "≥ 19×",
                "; ".join(f"{r:.2f}× ({w})" for w, r in ratios) if ratios else "not measured",
                _verdict(ratios and max(r for _, r in ratios) >= 5, ratios and max(r for _, r in ratios) >= 19)])
    return out


def _verdict(must, aim) -> str:
    """``must``/``aim``: booleans, or an empty value where nothing was measured."""
    if not isinstance(must, bool):
        return "—"
    return "aim met" if aim is True else "met" if must else "NOT met"


def report(rows: list[dict], skipped: list[str], args, device: str) -> list[str]:
    import gpu_check_kernel
    import gpu_check_model

    md = header("GPU check", "benchmarks/paper/gpu_check.py", args.argv, device)
    if getattr(args, "restored", 0):
        md += [f"Autotune results of an earlier run restored ({args.restored}, `--autotune-cache`): first calls "
               "at their shapes compile the chosen configs without timing the others.", ""]
    md += ["## Targets (the GPU-speed issue; ratios from this run)", "",
           common.markdown_table(["what", "must", "aim", "measured", "verdict"], targets(rows)), ""]
    md += ["## Tests", ""] + [f"- `{r['method']}`: {r['result']} (exit {r['exit']}, {r.get('seconds', 0):.0f} s)"
                              for r in rows if r["part"] == "tests"]
    md += ["", "## Kernel check (`cli.py plugins --check`: each kernel against its float64 reference)", "",
           common.markdown_table(["op", "kernel", "device", "dtype", "status", "rel. error", "allowed", "detail"],
                                 [[r["op"], r["candidate"], r["device"], r["dtype"], r["status"],
                                   _sci(r.get("error")), _sci(r.get("allowed")), r["detail"][:120]]
                                  for r in rows if r["part"] == "kernel_check"]), ""]
    md += [""] + gpu_check_kernel.report_lines(rows)
    md += ["## Training (images/s; an update = training_step, backward, RAdam; bf16 autocast on a GPU)", "",
           common.markdown_table(["config", "compile", "batch", "updates", "ms/update", "images/s", "warm-up s",
                                  "GPU kernels per update", "GPU busy ms/update"],
                                 gpu_check_model.training_table(rows)), "",
           "## Generation (MNIST model, random weights; one whole generate call per sample, median)", "",
           common.markdown_table(["role", "method", "batch", "decoder", "step weights", "s per call", "s per image", "images/s"],
                                 gpu_check_model.generation_table(rows)), ""]
    md += gpu_check_model.figure2_lines(rows)
    return md + ["## Skipped", ""] + [f"- {s}" for s in skipped or ["nothing"]]


def _triton_cache() -> Path:
    import triton

    return Path(triton.knobs.cache.dir)


def restore_tuning(archive: Path | None) -> int:
    """Unpack an earlier run's autotune results (:func:`save_tuning`'s archive) into Triton's
    cache, where Triton looks them up by kernel source, configs, key and GPU architecture: the
    number of results restored (0 without an archive)."""
    if archive is None or not archive.is_file():
        return 0
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".autotune.json")]
        tar.extractall(_triton_cache(), members=members, filter="data")
    return len(members)


def save_tuning(archive: Path) -> int:
    """Every autotune result in Triton's cache (ours and fla's, saved there because the parts run
    with ``TRITON_CACHE_AUTOTUNING=1``) into ``archive``, for the next run's
    ``--autotune-cache``: the number saved (no archive when none)."""
    root = _triton_cache()
    found = sorted(root.glob("*/*.autotune.json")) if root.is_dir() else []
    if found:
        with tarfile.open(archive, "w:gz") as tar:
            for path in found:
                tar.add(path, arcname=str(path.relative_to(root)))
    return len(found)


def _sci(value) -> str:
    return "—" if value is None else f"{value:.1e}"


def run_child(args) -> int:
    """One part in this process (``--child PART``), its rows and skips journaled as they come."""
    import gpu_check_kernel
    import gpu_check_model

    device = "cpu" if args.dry_run else "cuda"
    budget = Budget(args.budget_s, journal=args.journal)
    parts = {"tests": lambda: part_tests(device, budget, args.out, args.dry_run),
             "kernel": lambda: gpu_check_kernel.measure(device, budget, args.dry_run),
             "train": lambda: gpu_check_model.training(device, budget, args.dry_run),
             "generation": lambda: gpu_check_model.generation(device, budget, args.dry_run),
             "figure2": lambda: gpu_check_model.figure2(device, budget, args.out, args.dry_run)}
    parts[args.child]()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the result files")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (what the tests run)")
    parser.add_argument("--budget-s", type=float, default=float(sum(PARTS.values())),
                        help=f"seconds for all parts (default {sum(PARTS.values())})")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--autotune-cache", type=Path, metavar="TAR_GZ",
                        help="an earlier run's triton_autotune.tar.gz on the same kind of GPU: its autotune "
                             "results are reused (fla's first call at a new shape otherwise times configs for minutes)")
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, in a child process
    parser.add_argument("--journal", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.dry_run:  # before anything imports Triton: the kernels run in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.child:
        return run_child(args)
    import gpu_check_kernel
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU node, or add --dry-run for the CPU toy run")
    device = "cpu" if args.dry_run else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"  # the parts' autotune results land in Triton's cache for save_tuning
    args.restored = restore_tuning(args.autotune_cache)
    if args.restored:
        os.environ[gpu_check_kernel.RESTORED_TUNING] = "1"
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    end, skipped, rows = time.monotonic() + args.budget_s, [], []
    names = [p for p in PARTS if p in args.parts]
    for i, name in enumerate(names):
        left = end - time.monotonic()
        share = max(left * PARTS[name] / sum(PARTS[p] for p in names[i:]), 0)
        journal, log = work / f"{name}.jsonl", work / f"{name}.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--journal", str(journal),
                   "--budget-s", f"{share:.1f}", "--out", str(work), *(["--dry-run"] if args.dry_run else [])]
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
    stem = args.out / f"gpu_check_{device_label(device)}"
    md = report(rows, skipped, args, device)
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    common.write_csv(str(stem.with_suffix(".csv")), rows)
    with tarfile.open(args.out / "gpu_check_logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpu_check_logs")
    saved = save_tuning(args.out / "triton_autotune.tar.gz") if device == "cuda" else 0
    table = md.index("## Targets (the GPU-speed issue; ratios from this run)")
    print("\n".join(md[table:table + 11]))
    print("\n".join(f"skipped: {s}" for s in skipped))
    print(f"wrote {stem}.md, {stem}.csv and {args.out / 'gpu_check_logs.tar.gz'}"
          + (f"; {saved} autotune results to {args.out / 'triton_autotune.tar.gz'}" if saved else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
