"""What every benchmark script shares: the path bootstrap, the results folder, a report's
provenance header and progress line; timing, peak RSS, child processes, tables, and a git
revision's package for before / after runs. Every script starts the same way::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
    import common  # noqa: E402  (puts the repository on sys.path: an uninstalled checkout runs)

and imports only this module and the library, never another script. Torch is imported lazily so
a driver stays small (its RSS would leak into spawned children's ``ru_maxrss``)."""

from __future__ import annotations

import contextlib
import csv
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the library of this checkout, installed or not
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------- a report's place, header and progress
def results_dir(script: str) -> Path:
    """The results folder of a script (``__file__``): ``benchmarks/paper/results`` for the paper's
    figures and tables, ``benchmarks/dev/results`` for development measurements."""
    return Path(script).resolve().parent / "results"


def git_commit() -> str:
    """The checkout's short commit hash, or ``unknown`` (no git, e.g. a copied tree on a GPU node)."""
    try:
        return resolve_commit("HEAD")
    except (OSError, ValueError):
        return "unknown"


def provenance(script: str, argv: list[str], **notes: Any) -> list[str]:
    """The header lines of a report: the command as run (folders as ``DIR``), the machine, torch
    and its threads, the date and commit, the load, and any
    ``notes`` as ``- key: value`` lines."""
    import torch

    info = machine_info()
    lines = [f"- command: `{command_line(Path(script).resolve().relative_to(REPO).as_posix(), argv)}`",
             f"- machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, {info['mem_gib']} GiB",
             f"- torch {torch.__version__}, {torch.get_num_threads()} threads, Python {info['python']}, "
             f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}",
             f"- {time.strftime('%Y-%m-%d %H:%M %Z')}, commit {git_commit()}; {load_line()} at start"]
    return lines + [f"- {key.replace('_', ' ')}: {value}" for key, value in notes.items()]


def progress(done: int, total: int, what: str, start: float) -> None:
    """The progress line: ``[done/total] what (seconds since start, load)``, flushed at once."""
    print(f"[{done}/{total}] {what} ({time.perf_counter() - start:.0f} s, {load_line()})", flush=True)


def gemm_rate(size: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of ``torch.mm`` of two ``size`` x ``size`` matrices (median of ``repeats``): the
    floor every CPU measurement is compared with."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / median_seconds(lambda: torch.mm(a, b), repeats, warmup=2)


# ---------------------------------------------------------------- memory (this process)
def current_rss() -> int:
    """Resident set size now, in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss() -> int:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (``echo 5 > clear_refs``, Linux >= 4.0) so that
    ``ru_maxrss`` is the peak of what follows; False where not allowed (the peak covers setup too)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_parts() -> dict[str, int]:
    """``RssAnon``, ``RssFile``, ``RssShmem`` of this process in bytes (``/proc/self/status``)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                key, value = line.split(":")
                parts[key] = int(value.split()[0]) * 1024
    return parts


def peak_rss_increase(fn: Callable[[], Any]) -> dict:
    """Run ``fn()`` once and return how far the RSS peak rose above the RSS just before it:
    ``peak_increase_raw`` (``ru_maxrss`` after, the high-water mark reset where allowed, minus the
    RSS before) also counts shared-library pages first touched in the call (file huge pages,
    +-20 MB from run to run); ``peak_increase`` subtracts the growth of file-backed and shmem RSS,
    which leaves the anonymous memory (tensors, allocator, stacks)."""
    import gc

    gc.collect()
    was_reset = reset_peak_rss()
    before = rss_parts()
    rss_before, maxrss_before = current_rss(), max_rss()
    fn()
    maxrss_after = max_rss()
    after = rss_parts()
    file_growth = max(0, after.get("RssFile", 0) + after.get("RssShmem", 0)
                      - before.get("RssFile", 0) - before.get("RssShmem", 0))
    raw = max(0, maxrss_after - rss_before)
    return {
        "rss_before": rss_before,
        "maxrss_before": maxrss_before,
        "maxrss_after": maxrss_after,
        "file_rss_growth": file_growth,
        "peak_increase_raw": raw,
        "peak_increase": max(0, raw - file_growth),
        "hwm_reset": was_reset,
    }


# ---------------------------------------------------------------- timing
class Timer:
    """Wall time of one call in seconds, the one clock every benchmark uses: CUDA events
    around the call on a GPU (after a synchronize, so earlier work is not counted),
    ``perf_counter`` on CPU. ``Timer(device)(fn)`` -> seconds."""

    def __init__(self, device: str = "cpu"):
        self.cuda = str(device).startswith("cuda")

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1, device: str = "cpu") -> float:
    """Median of ``repeats`` timed calls after ``warmup`` untimed ones."""
    timer = Timer(device)
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(repeats))


def forward_backward(forward: Callable[[], Any], inputs: tuple, grad, context=contextlib.nullcontext) -> Callable[[], None]:
    """A timed call of ``forward().backward(grad)`` (inside ``context()``) that sets the inputs'
    ``.grad`` to None at its end, as ``zero_grad`` does in a training loop: each implementation pays
    for freeing its own gradients. Cleared at the start instead, an implementation timed by
    :func:`interleaved_medians` pays for freeing the one before's (large ones go back to the system
    page by page; NOTES.md, "How to time on a shared 2-vCPU machine?")."""
    def call():
        with context():
            forward().backward(grad)
        for t in inputs:
            t.grad = None
    return call


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1,
                        budget_s: float | None = None, device: str = "cpu") -> dict[str, dict]:
    """Time several callables in rounds (A B C, C B A, B C A, A C B, ...) so that a change of machine
    load hits all of them alike; returns per name the median, min and all samples (s).
    Every other round runs the one before backwards, and each pair of rounds starts one further
    along, so each callable follows each other one as often as it precedes it: with rounds only
    rotated, one kernel timed under two names (an A/A run of causal_cpu_grid.py) read up to 18 %
    faster under the name that always ran second.
    ``budget_s`` stops early (after at least 3 rounds) when the rounds so far took longer."""
    timer = Timer(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    start = time.perf_counter()
    for r in range(repeats):
        shift = (r // 2) % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if r % 2 else order:
            samples[name].append(timer(fns[name]))
        if budget_s is not None and r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {name: {"median": statistics.median(s), "min": min(s), "samples": s} for name, s in samples.items()}


# ---------------------------------------------------------------- child processes
def _child_entry(queue, target, kwargs):
    try:
        queue.put(("ok", target(**kwargs)))
    except BaseException as exc:  # report, never hang the parent
        out_of_memory = isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "out of memory" in str(exc)
        kind = "oom" if out_of_memory else "error"
        queue.put((kind, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


#: Environment of memory-measuring children: glibc's adaptive mmap threshold keeps freed memory in
#: its heaps (the same fwd+bwd's RSS peak varied +-20 %); a fixed one sends every block >= 128 KiB
#: to mmap/munmap, so RSS follows the live tensors and the peak repeats to < 1 %.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def run_in_child(target: Callable[..., dict], kwargs: dict, timeout_s: float, env: dict | None = None) -> tuple[str, Any]:
    """Run ``target(**kwargs)`` in a fresh spawned interpreter (its own RSS peak) and return
    ``(status, result)``: ``("ok", dict)``, ``("oom" | "error", message)``, ``("timeout", None)``
    or ``("crashed", exitcode)`` (e.g. killed by the kernel's OOM killer). ``target`` must be
    importable (a module-level function). ``env``: extra environment variables of the child."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_entry, args=(queue, target, kwargs), daemon=True)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        status, payload = queue.get(timeout=timeout_s)
    except Exception:  # queue.Empty: too slow, or died without a word
        if proc.is_alive():
            proc.kill()
            proc.join()
            return "timeout", None
        proc.join()
        return "crashed", proc.exitcode
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
    return status, payload


def limit_data_segment(cap_bytes: int | None) -> None:
    """Allocations beyond ``cap_bytes`` more than now fail rather than swap (RLIMIT_DATA, Linux >= 4.7)."""
    if not cap_bytes:
        return
    with open("/proc/self/status") as f:
        data_now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    limit = data_now + cap_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


# ---------------------------------------------------------------- machine description
def machine_info() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 1024**2
    except OSError:
        mem_gib = float("nan")
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg": tuple(round(x, 2) for x in os.getloadavg()),
    }


def torch_info() -> dict:  # versions and threads of the torch that a (child) process sees
    import torch

    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ---------------------------------------------------------------- output
def image_training_update(config: str, autocast: bool = False):
    """One training update (forward, backward, gradient clipping at 1, RAdam) of the image model of
    ``configs/<config>`` at its batch size on random images: ``(update, batch, task)``, ``update()``
    a zero-argument call. ``autocast``: bf16 autocast on CPU around the forward. The model is built
    from the config's ``model.init_args`` (seed 0) by whichever ``linformer_lab`` is importable."""
    import torch
    import yaml

    from linformer_lab.tasks.image_generation import ImageGenerationTask

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "configs", config)) as f:
        spec = yaml.safe_load(f)
    torch.manual_seed(0)
    task = ImageGenerationTask(**spec["model"]["init_args"])
    batch = spec["data"]["init_args"]["batch_size"]
    images = torch.randint(0, 256, (batch, *task.model.image_shape), dtype=torch.uint8)
    optimizer = torch.optim.RAdam(task.parameters(), lr=1e-4)

    def update():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = task.model.nll(images).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), 1.0)
        optimizer.step()

    return update, batch, task


def best_checkpoint(method: str, runs: str | Path = REPO / "logs") -> Path:
    """The newest best checkpoint of ``paper/mnist_table1.py``'s run of M (``runs/mnist_cpu_M``)."""
    if (found := newest_best_checkpoint(run_dir := Path(runs) / f"mnist_cpu_{method}")) is None:
        raise SystemExit(f"no best-*.ckpt in {run_dir}/version_*/checkpoints: train it with mnist_table1.py --methods {method}")
    return found


def newest_best_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest ``version_*/checkpoints/best-*.ckpt`` of a ``cli.py fit`` run root, or None."""
    return max(Path(run_dir).glob("version_*/checkpoints/best-*.ckpt"), key=lambda p: p.stat().st_mtime, default=None)


def metric_rows(root: str | Path) -> Iterator[dict[str, str]]:
    """Every row of a run root's ``version_N/metrics.csv`` files, versions in numeric order
    (version_10 after version_9): a resumed version's rows come after those its killed one logged
    past the checkpoint, and win where read last. The library's reader, which ``cli.py plot`` uses."""
    from linformer_lab.tasks.curves import metric_rows as run_rows

    return run_rows(root)


def test_metrics(root: str | Path) -> dict[str, float]:
    """The last logged value of every ``test/*`` column of a run root (empty: not tested yet)."""
    return {k: float(v) for row in metric_rows(root) for k, v in row.items() if k.startswith("test/") and v}


def fit_run(root: str | Path) -> dict:
    """What one ``cli.py fit`` (and ``cli.py test``) run root logged: ``curve`` (update -> validation
    bits/dim, the last logged value of each update), ``test_bpd`` (the last test bits/dim) and
    ``fit_minutes`` (the spans of ``root/fit_seconds.json``, or None)."""
    root = Path(root)
    curve = {int(row["step"]) + 1: float(row["val/bits_per_dim"]) for row in metric_rows(root) if row.get("val/bits_per_dim")}
    test = test_metrics(root).get("test/bits_per_dim")
    spans_path = root / "fit_seconds.json"
    spans = json.loads(spans_path.read_text()) if spans_path.exists() else []
    return {"curve": dict(sorted(curve.items())), "test_bpd": test,
            "fit_minutes": round(sum(s["end"] - s["start"] for s in spans) / 60, 1) if spans else None}


def write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def fmt(x: float | None, digits: int = 1) -> str:
    """A number for a table, or an em dash for a configuration that was not run."""
    return "—" if x is None else f"{x:.{digits}f}"


def command_line(script: str, argv: list[str], folders: tuple[str, ...] = ("--out",),
                 elided: tuple[str, ...] = ("--note",)) -> str:
    """``python SCRIPT ARGS`` as run, for a report's header: the folder arguments read ``DIR`` (no
    machine's path in a committed result), the ``elided`` ones (a note printed below the table) ``"..."``."""
    shown, replace_next = [], None
    for arg in argv:
        shown.append(replace_next or arg)
        replace_next = "DIR" if arg in folders else '"..."' if arg in elided else None
        if "=" in arg and arg.split("=", 1)[0] in folders:
            shown[-1] = arg.split("=", 1)[0] + "=DIR"
    return " ".join(["python", script, *shown])


def load_line() -> str:
    return "load average {:.2f} / {:.2f} / {:.2f} (1 / 5 / 15 min)".format(*os.getloadavg())


def add_omp_wait_policy_argument(parser) -> None:
    """``--omp-wait-policy`` for scripts whose timings run in this process or its children."""
    parser.add_argument("--omp-wait-policy", choices=["ACTIVE", "PASSIVE"], default=None,
                        help="OMP_WAIT_POLICY of the measuring processes (default: unset, libgomp's spin-then-sleep). "
                             "PASSIVE keeps waiting OpenMP threads from spinning, which on a loaded machine otherwise "
                             "stalls every parallel op by a scheduler time slice")


def apply_omp_wait_policy(policy: str | None) -> None:
    """Set OMP_WAIT_POLICY before torch is first imported here; spawned children inherit it."""
    if policy:
        os.environ["OMP_WAIT_POLICY"] = policy


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (after saying so) when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (uv sync --group dev)")
        return None
    return plt


# ---------------------------------------------------------------- a git revision (before / after runs)
def resolve_commit(rev: str) -> str:
    """``rev`` as a short commit hash, resolved once (HEAD may move on during a run). Raises
    ValueError naming the revision where git cannot resolve it."""
    done = subprocess.run(["git", "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git cannot resolve the revision {rev!r}: {done.stderr.strip()}")
    return done.stdout.strip()


def export_revision(rev: str, folder: str) -> str:
    """The ``linformer_lab`` package as it was at ``rev``, extracted under ``folder``; returns ``folder``."""
    archive = subprocess.run(["git", "archive", rev, "linformer_lab"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder
