"""The report of ``gpu_check.py`` (``gpu_check_<device>.md``): the header, the issue's targets
filled from the rows, then each part's tables. The kernel part's: timings per round, ratios of
ours to each other method (each from the one interleaved round that timed both), the 10 % rule
against the previous revision, first calls, profiles, launches, compilations, roofline."""

from __future__ import annotations

import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402
import gpu_check_model  # noqa: E402
from gpu_check_kernel import GRID, RATIOS, ROOFLINE_SHAPE, ROUND_NAMES, ROUNDS  # noqa: E402


def first_call_seconds(rows: list[dict], method: str = "ours") -> float:
    """Seconds the first calls of ``method`` took beyond their steady-state time, over every shape,
    round and pass: Triton's compilation (and the autotuning of the methods that autotune)."""
    return sum(max(r.get(f"first_{key}_s", 0) - r.get(f"{key}_ms", 0) / 1e3, 0) for r in rows
               if r["part"] in ROUNDS and r["method"] == method for key in ("fwd", "fwd_bwd"))


def by_shape(rows: list[dict], part: str) -> dict:
    """``{(B, T, H, D): {method: row}}`` of one timing round (a part of :data:`ROUNDS`)."""
    out: dict = {}
    for r in rows:
        if r["part"] == part:
            out.setdefault((r["B"], r["T"], r["H"], r["D"]), {})[r["method"]] = r
    return out


def rounds_against(rows: list[dict]) -> Callable[[str], dict]:
    """``other -> {shape: {method: row}}``: the round a ratio of ours to ``other`` comes from (both
    timed in one interleaved round): ``kernel_fla`` for fla, ``kernel_cu`` for the ``.cu``
    numerator, ``kernel`` for the rest."""
    rounds = {part: by_shape(rows, part) for part in ROUNDS}
    return lambda other: rounds[next((p for p in ("kernel_fla", "kernel_cu") if other in ROUNDS[p]), "kernel")]


def ratios(rows: list[dict], ours: str, other: str, key: str) -> dict:
    """``{shape: time of ours / time of other}`` for pass ``key`` where one round timed both."""
    out = {}
    for shape, m in rounds_against(rows)(other).items():
        a, b = m.get(ours, {}).get(f"{key}_ms"), m.get(other, {}).get(f"{key}_ms")
        if a and b:
            out[shape] = a / b
    return out


def ratio_rows(rows: list[dict]) -> list[list]:
    """Per shape: ours / other for each of :data:`RATIOS` (below 1: ours is faster), each ratio
    from one interleaved round (:func:`rounds_against`)."""
    cells = {(ours, other, key): ratios(rows, ours, other, key) for ours, other, key in RATIOS}
    shapes = sorted({shape for found in cells.values() for shape in found}, key=lambda s: (s[1], s))
    return [["×".join(map(str, shape)), *[common.fmt(cells[r].get(shape), 2) for r in RATIOS]] for shape in shapes]


#: The 10 % rule (docs/ARCHITECTURE.md, "Where speed code goes"): a change pays for itself with at
#: least 10 % less time on the benchmark it targets.
RULE = 0.90


def report_lines(rows: list[dict]) -> list[str]:
    """Markdown of the kernel part: agreement, timings, ratios, first calls, profiles, launches,
    compilations, roofline."""
    shape_of = "×".join
    md = ["### Agreement (normwise relative error)", "",
          common.markdown_table(["check", "rel. error"], [[r["method"], f"{r['rel_err']:.2e}"] for r in rows
                                                         if r["part"] == "agreement"]), ""]
    md += [f"`ours_prev` is the kernel at revision {r['revision']} (`gpu_check.py --export-previous`), through its "
           "launch functions.\n" for r in rows if r["part"] == "previous"]
    md += ["### Median ms (interleaved rounds, CUDA events)", "",
           common.markdown_table(["round", "method", "B", "T", "H", "D", "dtype", "layout", "fwd", "fwd+bwd", "note"],
                                 [[ROUND_NAMES[r["part"]], r["method"], r["B"], r["T"], r["H"], r["D"], r["dtype"],
                                   r["layout"], common.fmt(r.get("fwd_ms"), 3), common.fmt(r.get("fwd_bwd_ms"), 3),
                                   r.get("note", "")] for r in rows if r["part"] in ROUNDS]), "",
           "### Ratios (time of ours / time of the other; below 1 ours is faster)", "",
           common.markdown_table(["B×T×H×D", *[f"{a}/{b} {k.replace('_', '+')}" for a, b, k in RATIOS]],
                                 ratio_rows(rows)), ""]
    against_prev = ratios(rows, "ours", "ours_prev", "fwd_bwd")
    if against_prev:
        paid = [s for s, r in against_prev.items() if r <= RULE]
        md += [f"The 10 % rule (ours / ours_prev fwd+bwd ≤ {RULE:.2f}): met at {len(paid)} of {len(against_prev)} shapes "
               f"({', '.join(shape_of(map(str, s)) for s in paid) or 'none'}); ratios {min(against_prev.values()):.2f}-"
               f"{max(against_prev.values()):.2f}.", ""]
    md += ["### First call (compilation, and autotuning where a method autotunes, at each new shape), seconds",
           "", common.markdown_table(
               ["round", "method", "B×T×H×D", "fwd first", "fwd+bwd first", "fwd steady ms", "fwd+bwd steady ms"],
               [[ROUND_NAMES[r["part"]], r["method"], shape_of(str(r[k]) for k in "BTHD"),
                 common.fmt(r.get("first_fwd_s"), 2), common.fmt(r.get("first_fwd_bwd_s"), 2),
                 common.fmt(r.get("fwd_ms"), 3), common.fmt(r.get("fwd_bwd_ms"), 3)] for r in rows
                if r["part"] == "kernel" or (r["part"] in ROUNDS and r["method"] not in ROUNDS["kernel"])]), "",
           "First calls, all shapes (their compile and autotune time, less the calls' own time): "
           + "; ".join(f"{m} {first_call_seconds(rows, m):.1f} s" for m in ("ours", "ours_prev")), ""]
    md += ["### Where a fwd+bwd spends its time (torch.profiler, per step; on a CPU, operators)", "",
           common.markdown_table(["method", "B×T×H×D", "kernel", "calls", "ms", "share"],
                                 [[r["method"], shape_of(str(r[k]) for k in "BTHD"), r["kernel"],
                                   common.fmt(r["calls"], 1), common.fmt(r["ms"], 3), f"{r['share']:.0%}"]
                                  for r in rows if r["part"] == "kernel_profile"]), "",
           "### Launches per call (torch.profiler: every kernel of one forward, of one backward)", "",
           common.markdown_table(["method", "B×T×H×D", "forward", "backward", "counted"],
                                 [[r["method"], shape_of(str(r[k]) for k in "BTHD"), common.fmt(r["fwd"], 1),
                                   common.fmt(r["bwd"], 1), r["unit"]] for r in rows if r["part"] == "launches"]), ""]
    compiles = [r for r in rows if r["part"] == "compile"]
    md += ["### Compilations (ours: each kernel's first launch at a specialisation; ours_prev: its "
           "autotuning, configs compiled and timed), seconds", "",
           common.markdown_table(["method", "kernel", "key", "config", "seconds"],
                                 [[r["method"], r["kernel"], r["key"], r["config"], common.fmt(r["seconds"], 2)]
                                  for r in compiles]), "",
           "Compilations in all: " + "; ".join(
               f"{m} {sum(r['seconds'] for r in compiles if r['method'] == m):.1f} s over "
               f"{sum(r['method'] == m for r in compiles)}" for m in ("ours", "ours_prev")) + ".", ""]
    for r in rows:
        if r["part"] == "roofline":
            md += [f"Roofline: ours forward at B2 T16384 H16 D128 {r['fwd_ms']:.3f} ms against {r['floor_ms']:.3f} ms for "
                   f"reading q, k, v and writing the output once at the measured copy bandwidth "
                   f"({r['bandwidth_gb_s']:.0f} GB/s): **{r['fraction']:.1%}** of the roofline.", ""]
    return md


# ---------------------------------------------------------------- the whole report
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


def _verdict(must, aim) -> str:
    """``must``/``aim``: booleans, or an empty value where nothing was measured."""
    if not isinstance(must, bool):
        return "—"
    return "aim met" if aim is True else "met" if must else "NOT met"


def _mode(row: dict) -> str:
    """How a training row ran (its compile setting, and any other mode its part records)."""
    return ", ".join(f"{key}={row[key]}" for key in ("compile", "graph", "mode") if row.get(key) not in (None, ""))


def targets(rows: list[dict]) -> list[list]:
    """The GPU issue's targets, filled from the rows: ``[what, must, aim, measured, verdict]``."""
    out, grid = [], set(GRID)
    vs_fla = ratios(rows, "ours", "fla", "fwd_bwd")
    long = [r for s, r in vs_fla.items() if s[1] >= 8192]
    timed = len([s for s in vs_fla if s in grid]) == len(grid)
    out.append(["causal fwd+bwd, ours ÷ fla, every grid shape", "≤ 1.0", "≤ 0.5 at T ≥ 8,192",
                f"max {max(vs_fla.values()):.2f} over {len(vs_fla)} of {len(grid)} shapes"
                + (f", at T ≥ 8,192 max {max(long):.2f}" if long else "") if vs_fla else "not measured",
                "met where timed" if vs_fla and max(vs_fla.values()) <= 1 and not timed
                else _verdict(vs_fla and max(vs_fla.values()) <= 1, long and max(long) <= 0.5)])
    cu_fwd, cu_both = (ratios(rows, "ours", "cuda_old", key) for key in ("fwd", "fwd_bwd"))
    vs_cu = [max(cu_both[shape], cu_fwd.get(shape, 0)) for shape in cu_both]
    # issue 53, item 2: where ours is at or below the .cu numerator at every grid shape, the .cu goes
    out.append(["causal fwd and fwd+bwd, ours ÷ the .cu numerator, every grid shape", "≤ 1.0", "—",
                f"max {max(vs_cu):.2f} over {len(vs_cu)} of {len(grid)} shapes" if vs_cu else "not measured",
                "—" if not vs_cu else "NOT met" if max(vs_cu) > 1 else "met" if len(vs_cu) == len(grid)
                else "met where timed"])
    vs_sdpa = ratios(rows, "ours", "sdpa", "fwd_bwd")
    from_2k, from_1k = ([r for s, r in vs_sdpa.items() if s[1] >= t] for t in (2048, 1024))
    out.append(["ours ÷ SDPA causal fwd+bwd", "< 1 from T = 2,048", "< 1 from T = 1,024",
                f"max from 2,048: {max(from_2k):.2f}; from 1,024: {max(from_1k):.2f}" if from_2k else "not measured",
                _verdict(from_2k and max(from_2k) < 1, from_1k and max(from_1k) < 1)])
    vs_prev = ratios(rows, "ours", "ours_prev", "fwd_bwd")
    paid = [r for r in vs_prev.values() if r <= RULE]
    out.append(["causal fwd+bwd, ours ÷ the previous revision (the 10 % rule)", f"≤ {RULE:.2f}", "—",
                f"{min(vs_prev.values()):.2f}-{max(vs_prev.values()):.2f} over {len(vs_prev)} shapes, ≤ {RULE:.2f} at "
                f"{len(paid)}" if vs_prev else "not measured",
                "—" if not vs_prev else "met" if len(paid) == len(vs_prev) else f"met at {len(paid)} of {len(vs_prev)}"])
    roof = [r["fraction"] for r in rows if r["part"] == "roofline"]
    out.append(["forward at B2 T16384 H16 D128, share of the HBM roofline", "≥ 30 %", "≥ 60 %",
                f"{roof[0]:.1%}" if roof else "not measured", _verdict(roof and roof[0] >= 0.3, roof and roof[0] >= 0.6)])
    launches = [r for r in rows if r["part"] == "launches" and r["method"] == "ours" and r["unit"] == "kernels"
                and (r["B"], r["T"], r["H"], r["D"]) == ROOFLINE_SHAPE]
    out.append(["launches per forward / backward (ours, B2 T16384 H16 D128)", "≤ 2 / ≤ 3", "1 / 2",
                f"{launches[0]['fwd']:.0f} / {launches[0]['bwd']:.0f}" if launches else "not measured",
                _verdict(launches and launches[0]["fwd"] <= 2 and launches[0]["bwd"] <= 3,
                         launches and launches[0]["fwd"] <= 1 and launches[0]["bwd"] <= 2)])
    out.append(training_target(rows))
    latency = [r["seconds_per_image"] for r in rows if r["part"] == "generation" and r["method"] == "linear"
               and r["role"] == "latency"]
    out.append(["MNIST batch-1 generation, s per image (linear, best decoder)", "≤ 0.15", "≤ 0.05",
                f"{min(latency):.3f}" if latency else "not measured", _verdict(latency and min(latency) <= 0.15,
                                                                             latency and min(latency) <= 0.05)])
    big = [r for r in rows if r["part"] == "generation" and r["role"] == "largest"]
    top = max(big, key=lambda r: r["images_per_s"], default=None)
    out.append(["MNIST generation at the largest batch, images/s", "≥ 5,000", "≥ 20,000",
                f"{top['images_per_s']:.0f} (batch {top['batch']}, {top['step_weights']})" if top else "not measured",
                _verdict(top and top["images_per_s"] >= 5000, top and top["images_per_s"] >= 20000)])
    return out


def training_target(rows: list[dict]) -> list:
    """MNIST training images/s, linear ÷ softmax, each config at its best mode, per batch; the
    verdict at the config's (the paper's) batch where it was measured."""
    train = [r for r in rows if r["part"] == "train"]
    best = {}
    for r in train:
        key = (r["config"], int(r["batch"]))
        if key not in best or r["images_per_s"] > best[key]["images_per_s"]:
            best[key] = r
    batches = sorted(b for (c, b) in best if c == "mnist_linear.yaml" and ("mnist_softmax.yaml", b) in best)
    what = ["MNIST training images/s, linear ÷ softmax, each at its best mode", "≥ 1.0", "≥ 1.2 and ≥ 3,000 images/s"]
    if not batches:
        return [*what, "not measured", "—"]
    cells, verdict = [], None
    for b in batches:
        lin, soft = best["mnist_linear.yaml", b], best["mnist_softmax.yaml", b]
        ratio = lin["images_per_s"] / soft["images_per_s"]
        cells.append(f"batch {b}: {ratio:.2f} ({lin['images_per_s']:.0f}, {_mode(lin)} vs {soft['images_per_s']:.0f}, "
                     f"{_mode(soft)})")
        if verdict is None or b == 10:
            verdict = _verdict(ratio >= 1.0, ratio >= 1.2 and lin["images_per_s"] >= 3000)
    return [*what, "; ".join(cells), verdict]


def report(rows: list[dict], skipped: list[str], argv: list[str], device: str, notes: list[str] = ()) -> list[str]:
    """The whole report: header, ``notes`` (what the run restored and carried), targets, each part."""
    md = header("GPU check", "benchmarks/paper/gpu_check.py", argv, device) + [*notes, ""] * bool(notes)
    md += ["## Targets (the GPU-speed issue; ratios from this run)", "",
           common.markdown_table(["what", "must", "aim", "measured", "verdict"], targets(rows)), ""]
    md += ["## Kernels", ""] + report_lines(rows)
    md += ["## Training (images/s; an update = training_step, backward, RAdam; bf16 autocast on a GPU)", "",
           common.markdown_table(["config", "compile", "batch", "updates", "ms/update", "images/s", "warm-up s",
                                  "GPU kernels per update", "GPU busy ms/update"],
                                 gpu_check_model.training_table(rows)), "",
           "## Generation (MNIST model, random weights; one whole generate call per sample, median)", "",
           common.markdown_table(["role", "method", "batch", "decoder", "step weights", "s per call", "s per image", "images/s"],
                                 gpu_check_model.generation_table(rows)), ""]
    md += ["## Tests (the pytest summary and junit file beside this report)", ""]
    md += [f"- `{r['method']}`: {r['result']} (exit {r['exit']}, {r.get('seconds', 0):.0f} s)"
           for r in rows if r["part"] in ("build", "tests")]
    md += ["", "## Kernel check (`cli.py plugins --check`: each kernel against its float64 reference)", "",
           common.markdown_table(["op", "kernel", "device", "dtype", "status", "rel. error", "allowed", "detail"],
                                 [[r["op"], r["candidate"], r["device"], r["dtype"], r["status"],
                                   _sci(r.get("error")), _sci(r.get("allowed")), r["detail"][:120]]
                                  for r in rows if r["part"] == "kernel_check"]), ""]
    md += gpu_check_model.figure2_lines(rows)
    return md + ["## Skipped", ""] + [f"- {s}" for s in skipped or ["nothing"]]


def _sci(value) -> str:
    return "—" if value is None else f"{value:.1e}"
