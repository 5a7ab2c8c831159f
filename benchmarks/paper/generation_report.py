"""Report writing of benchmarks/paper/generation.py: the markdown tables (throughput, latency, step
weight formats, state memory) against the paper's Tables 1, 2, 4, 5, and the latency plot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402

METHODS = ["softmax", "stateful-softmax", "lsh-1", "lsh-4", "linear"]
RECURRENT = ["stateful-softmax", "linear"]  # timed over whole images, interleaved
DATASETS = {
    "mnist": dict(title="MNIST", image_shape=(1, 28, 28), n_layers=8, bucket_size=29),
    "cifar10": dict(title="CIFAR-10", image_shape=(3, 32, 32), n_layers=16, bucket_size=37),
}
#: Paper values: Tables 1, 2 (images/s and speed-up over softmax), Table 4 (stateful-softmax),
#: Table 5 (seconds per image at batch 1, CPU and GPU), and bits/dim of the trained models.
PAPER = {
    "mnist": {
        "bits": {"softmax": 0.621, "stateful-softmax": 0.621, "lsh-1": 0.745, "lsh-4": 0.676, "linear": 0.644},
        "img_s": {"softmax": 0.45, "stateful-softmax": 7.56, "lsh-1": 0.68, "lsh-4": 0.27, "linear": 142.8},
        "speedup": {"softmax": 1.0, "stateful-softmax": 16.8, "lsh-1": 1.5, "lsh-4": 0.6, "linear": 317.0},
        "cpu_s": {"softmax": 72.6, "stateful-softmax": 7.4, "lsh-1": 46.0, "lsh-4": 112.0, "linear": 5.5},
        "gpu_s": {"softmax": 10.2, "stateful-softmax": 10.4, "lsh-1": 19.2, "lsh-4": 55.8, "linear": 7.3},
    },
    "cifar10": {
        "bits": {"softmax": 3.47, "stateful-softmax": 3.47, "lsh-1": 3.39, "lsh-4": 3.51, "linear": 3.40},
        "img_s": {"softmax": 0.004, "stateful-softmax": 0.32, "lsh-1": 0.015, "lsh-4": 0.005, "linear": 17.85},
        "speedup": {"softmax": 1.0, "stateful-softmax": 80.0, "lsh-1": 3.75, "lsh-4": 1.25, "linear": 4462.0},
        "cpu_s": {"softmax": 8651.4, "stateful-softmax": 71.9, "lsh-1": 2318.9, "lsh-4": 5263.7, "linear": 45.1},
        "gpu_s": {"softmax": 300.1, "stateful-softmax": 70.4, "lsh-1": 221.6, "lsh-4": 683.9, "linear": 61.3},
    },
}


def _row(rows, dataset, method, batch, fmt="model"):
    """The row of one measurement (CSV rows from --replot hold strings, and older CSVs have
    no step_weights column: their rows are all "model")."""
    return next((r for r in rows if r["dataset"] == dataset and r["method"] == method and int(r["batch"]) == batch
                 and (r.get("step_weights") or "model") == fmt), None)


def _num(x: float) -> str:
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.2f}"
    return f"{x:.2g}" if x >= 0.001 else f"{x:.1e}"


def _ratio(x: float | None) -> str:
    return "—" if x is None else (f"{x:,.0f}×" if x >= 100 else f"{x:.1f}×" if x >= 10 else f"{x:.2f}×")


def _mark(r) -> str:
    return " (fit)" if r["source"] == "fit" else ""


def throughput_table(rows, dataset, batch, methods) -> list[str]:
    paper = PAPER[dataset]
    base = _row(rows, dataset, "softmax", batch)
    header = ["Method", "Bits/dim", "Images/sec", "speed-up", "paper bits/dim", "paper images/sec", "paper speed-up"]
    body = []
    for m in methods:
        r = _row(rows, dataset, m, batch)
        if r is None:
            continue
        speed = r["images_per_s"] / base["images_per_s"] if base else None
        body.append([m, "—", _num(r["images_per_s"]) + _mark(r), _ratio(speed), paper["bits"][m], _num(paper["img_s"][m]),
                     _ratio(paper["speedup"][m])])
    return [common.markdown_table(header, body)]


def latency_table(rows, dataset, methods, device) -> list[str]:
    paper = PAPER[dataset]
    lin = _row(rows, dataset, "linear", 1)
    col = "CPU" if device == "cpu" else "GPU"
    key = "cpu_s" if device == "cpu" else "gpu_s"
    header = ["Method", f"Seconds ({col}, ours)", "(× linear)", f"paper seconds ({col})", "(paper × linear)",
              "ours vs paper"]
    body = []
    for m in methods:
        r = _row(rows, dataset, m, 1)
        if r is None:
            continue
        ours = r["seconds_per_image"]
        ratio = ours / lin["seconds_per_image"] if lin else None
        p = paper[key][m]
        body.append([m, _num(ours) + _mark(r), _ratio(ratio), _num(p), _ratio(p / paper[key]["linear"]),
                     f"{p / ours:.1f}× faster" if ours < p else f"{ours / p:.1f}× slower"])
    return [common.markdown_table(header, body)]


def formats_table(rows, datasets, formats) -> list[str]:
    """Batch-1 seconds per image of the recurrent methods in every step weight format, with
    the ratios the targets are stated in (all within this run)."""
    header = ["Dataset", "Method", "step weights", "s / image", "× faster than with model weights",
              "speed-up over softmax (recompute)", "stateful-softmax / linear (same weights)", "paper s (CPU)", "ours vs paper"]
    body = []
    for dataset in datasets:
        base = _row(rows, dataset, "softmax", 1)
        for method in RECURRENT:
            for fmt in formats:
                r, exact = _row(rows, dataset, method, 1, fmt), _row(rows, dataset, method, 1)
                if r is None:
                    continue
                ours = float(r["seconds_per_image"])
                soft, lin = _row(rows, dataset, "stateful-softmax", 1, fmt), _row(rows, dataset, "linear", 1, fmt)
                paper = PAPER[dataset]["cpu_s"][method]
                body.append([
                    DATASETS[dataset]["title"], method, fmt, _num(ours),
                    _ratio(float(exact["seconds_per_image"]) / ours) if exact else "—",
                    _ratio(float(base["seconds_per_image"]) / ours) if base else "—",
                    _ratio(float(soft["seconds_per_image"]) / float(lin["seconds_per_image"])) if soft and lin else "—",
                    _num(paper), f"{paper / ours:.1f}× faster" if ours < paper else f"{ours / paper:.1f}× slower"])
    return [common.markdown_table(header, body)]


def memory_lines(rows, datasets) -> list[str]:
    header = ["Dataset", "Method", "Batch", "state bytes / image, first pixel", "last pixel", "constant?"]
    body = []
    for r in rows:
        measured = r.get("state_bytes_first") not in (None, "")
        if r["dataset"] in datasets and measured and (r.get("step_weights") or "model") == "model":
            first, last = r["state_bytes_first"] / r["batch"], r["state_bytes_last"] / r["batch"]
            body.append([DATASETS[r["dataset"]]["title"], r["method"], r["batch"], f"{first:,.0f}", f"{last:,.0f}",
                         "yes" if first == last else f"no ({last / first:,.0f}× larger)"])
    return [common.markdown_table(header, body)] if body else []


def markdown(rows, extra, args, header_lines) -> str:
    methods = [m for m in METHODS if m in args.methods]
    out = header_lines[:]
    for dataset in args.datasets:
        spec, batch = DATASETS[dataset], 1 if args.latency_only else args.batch[dataset]
        t_main = "Table 1" if dataset == "mnist" else "Table 2"
        out += ["", f"## {spec['title']}: throughput at batch {batch} ({t_main} / Table 4 layout)", ""]
        out += throughput_table(rows, dataset, batch, methods)
        if batch != 1:
            out += ["", "Same at batch 1 (images/s = 1 / seconds per image):", ""]
            out += throughput_table(rows, dataset, 1, methods)
        out += ["", f"## {spec['title']}: seconds per image at batch 1 (Table 5 layout)", ""]
        out += latency_table(rows, dataset, methods, args.device)
    if len(args.step_weights) > 1:
        out += ["", "## Step weight formats at batch 1 (`generate(step_weights=...)`)", "",
                "`model`: the model's fp32 weights (exact); `bfloat16`: a bf16 copy; `int8`: weight-only int8 with "
                "per-output-channel scales (see linformer_lab/models/generation/weights.py). The lossy formats change the "
                "samples slightly; their cost in bits/dim is in step_weights_quality_*.md. softmax (recompute) "
                "always uses the model's weights.", ""]
        out += formats_table(rows, args.datasets, args.step_weights)
    if extra.get("floor"):
        out += ["", "## Where the time of linear goes at batch 1", ""]
        body = []
        for dataset, floors in extra["floor"].items():
            for fmt, floor in floors.items():
                lin = _row(rows, dataset, "linear", 1, fmt)
                body.append([DATASETS[dataset]["title"], fmt, _num(lin["seconds_per_image"]), _num(floor),
                             f"{100 * floor / lin['seconds_per_image']:.0f}%"])
        out.append(common.markdown_table(
            ["Dataset", "step weights", "linear, s / image", "its linear layers alone, s / image", "share"], body))
        out += ["", "The linear layers alone: the 4 weight products of every layer, once per sub-pixel, with the same "
                "kernels and weight copy as generate(). At batch 1 a step reads every weight once ("
                + ("the 4 x 128 model: 3 MB in fp32" if getattr(args, "trained", None) else
                   "MNIST 25 MB, CIFAR-10 50 MB in fp32; half in bfloat16, a quarter in int8")
                + "), so this is the floor that no change to the attention can remove."]
    out += ["", "## Memory per image during generation (state after the first and the last sub-pixel)", ""]
    out += memory_lines(rows, args.datasets)
    if extra.get("max_batch"):
        out += ["", "## GPU: largest MNIST batch generated at once by linear", ""]
        out.append(common.markdown_table(
            ["batch", "status", "seconds", "images/s", "peak GiB"],
            [[r["batch"], r["status"], _num(r.get("seconds")), _num(r.get("images_per_s")), _num(r.get("peak_gib"))]
             for r in extra["max_batch"]]))
    fits = [r for r in rows if r.get("fit_seconds") is not None]
    if fits:
        out += ["", "## Recompute methods: fitted and measured totals", "",
                "Step cost fitted as a + b (t+1) + c (t+1)^2 over the positions listed; total = sum over all positions. "
                "Rows marked (fit) above use the fitted total; where a whole image was also run, both are given here.", ""]
        out.append(common.markdown_table(
            ["Dataset", "Method", "Batch", "positions", "step seconds", "fitted total s", "measured total s"],
            [[DATASETS[r["dataset"]]["title"], r["method"], r["batch"], r["positions"].replace(";", ", "),
              r["step_seconds"].replace(";", ", "), _num(r["fit_seconds"]),
              _num(r["seconds"]) if r["source"] == "measured" else "—"] for r in fits]))
    return "\n".join(out) + "\n"


def _label(row) -> str:
    fmt = row.get("step_weights") or "model"
    return row["method"] if fmt == "model" else f"{row['method']} [{fmt}]"


def write_reports(rows: list[dict], extra: dict, args, header: list[str], stem: str) -> str:
    """Writes ``stem.csv`` (the rows), ``stem.png`` (the latency plot, where matplotlib is installed)
    and ``stem.md`` (the tables under ``header``); returns the markdown."""
    common.write_csv(f"{stem}.csv", rows)
    if plot(rows, f"{stem}.png", args.device):
        header.append(f"\n![seconds per image]({os.path.basename(stem)}.png)")
    md = markdown(rows, extra, args, header)
    with open(f"{stem}.md", "w") as f:
        f.write(md)
    return md


def plot(rows: list[dict], path: str, device: str) -> bool:
    """Seconds per image at batch 1, ours beside the paper's (its CPU or GPU column), one
    panel per dataset, log scale. Returns False when matplotlib is missing."""
    plt = common.pyplot()
    if plt is None:
        return False
    datasets = [d for d in DATASETS if any(r["dataset"] == d and int(r["batch"]) == 1 for r in rows)]
    if not datasets:
        return False
    paper_key = "gpu_s" if device == "cuda" else "cpu_s"
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 3.6), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        ours = {_label(r): float(r["seconds_per_image"]) for r in rows if r["dataset"] == dataset and int(r["batch"]) == 1}
        methods = [m for m in METHODS if m in ours] + [m for m in ours if m not in METHODS]
        y = range(len(methods))
        ax.barh([i + 0.2 for i in y], [ours[m] for m in methods], height=0.4, label=f"ours ({device})")
        ax.barh([i - 0.2 for i in y], [PAPER[dataset][paper_key][m.split(" ")[0]] for m in methods], height=0.4,
                label=f"paper ({'GPU' if device == 'cuda' else 'CPU'})", alpha=0.6)
        ax.set_yticks(list(y), methods)
        ax.set_xscale("log")
        ax.set_xlabel("seconds per image, batch 1 (log)")
        ax.set_title(DATASETS[dataset]["title"])
        ax.grid(True, axis="x", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def header_lines(args, device: str, wall: float, load_start: str) -> list[str]:
    """The run's description at the top of the markdown: ``device`` (machine, torch, threads), the
    models, the batches, how each method was timed, the wall time and the load."""
    gpu = args.device == "cuda"
    return [
        f"# Image generation throughput and latency ({args.device}; paper Tables 1, 2, 4, 5)", "",
        f"- device: {device}",
        (f"- models: the trained CPU-recipe checkpoints of benchmarks/paper/mnist_table1.py under `{args.trained}` "
         "(configs/mnist_cpu_*.yaml: 4 layers x 128, 4 heads; bits/dim in mnist_table1.md); fp32; temperature 1"
         if getattr(args, "trained", None) else
         "- models: random weights (speed does not depend on training; bits/dim \"—\"); d_model 256, 8 heads, d_ff 1024, "
         "10 logistics; MNIST 8 layers / 784 sub-pixels, CIFAR-10 16 layers / 3072; fp32; temperature 1"),
        ("- batch 1 only (--latency-only)" if args.latency_only else
         "- throughput batch: " + ", ".join(f"{DATASETS[d]['title']} {args.batch[d]}" for d in args.datasets)
         + " (the same for every method; "
         + ("chosen, not the largest that fits: on CPU memory is no limit at these sizes" if not gpu
            else "see the max-batch table for linear")
         + "); latency: batch 1"),
        f"- step weights of the recurrent methods: {', '.join(args.step_weights)}",
        f"- linear / stateful-softmax: median of {args.repeats} (batch 1) / {args.repeats_batch} (throughput batch) whole-image "
        f"generate() calls, interleaved, after a warm-up call; softmax / lsh: {args.positions} timed steps (median of "
        f"{args.step_repeats} at batch 1, {args.step_repeats_batch} at the throughput batch) fitted as a + b t + c t^2 and "
        f"summed (**(fit)**), or a whole image when the fit predicts <= {args.full_budget:.0f} s",
        f"- total wall time {wall / 60:.1f} min; {load_start} at start, {common.load_line()} at end "
        "(per-row load averages in the CSV)",
        f"- command: `{common.command_line('benchmarks/paper/generation.py', getattr(args, 'argv', []))}`",
    ]
