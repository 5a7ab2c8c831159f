"""The model parts of ``gpu_check.py``: MNIST training images/s (``configs/mnist_linear.yaml``
against ``configs/mnist_softmax.yaml``, eager and as one CUDA graph, then compiled), MNIST generation speed (batch 1,
batch 1,000 linear against stateful softmax, the largest batch), each step checked against the
part's time budget, and Fig. 2 at the paper's shape for the time left (``figure2_copy.py --paper``;
``--quick``'s toy matrix, reduced to one run of each recipe, in a dry run).

Training: the configs' model on random images at the config's batch (the paper's 10) and at
:data:`BIG_BATCH`, bf16 autocast on a GPU as ``precision: bf16-mixed``; an update is
``training_step`` (the task's loss and its bits/dim metric), ``backward`` and RAdam, without
the Lightning loop around it (data loading and logging are not timed); a graphed row runs the
task's own ``cuda_graph`` path (``training_step`` replaying forward, backward and a capturable
RAdam's step as one CUDA graph, ``linformer_lab/tasks/graphed_update.py``), its capture in the
warm-up. Generation: random
weights (the time per image does not depend on training), ``PixelTransformer.generate`` with
the decoder and step weights of each row; a row's time is one whole ``generate`` call (graph
capture included), the median of its repeats.
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("mnist_linear.yaml", "mnist_softmax.yaml")
#: A batch beside the paper's 10, to show what the GPU does when the paper's batch is not needed.
BIG_BATCH = 64
#: Toy model of the dry run (CPU).
TINY = {"n_layers": 1, "n_heads": 2, "d_model": 16, "d_ff": 32, "image_shape": [1, 4, 4]}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _task(config: str, device: str, dry_run: bool, **overrides):
    import torch
    import yaml

    from linformer_lab.tasks.image_generation import ImageGenerationTask

    spec = yaml.safe_load((REPO / "configs" / config).read_text())
    args = {**spec["model"]["init_args"], **(TINY if dry_run else {}), **overrides}
    torch.manual_seed(0)
    task = ImageGenerationTask(**args).to(device)
    task.configure_model()
    return task, spec["data"]["init_args"]["batch_size"]


def train_rate(config: str, device: str, compile: str, batch: int | None, seconds: float, dry_run: bool,
               graph: bool = False) -> dict:
    """Images/s of training updates of ``config``'s model (see the module docstring); ``graph``:
    the update as one CUDA graph (a CUDA device only)."""
    import torch

    from linformer_lab.tasks.graphed_update import WARMUP_UPDATES, CudaGraphUpdate

    task, config_batch = _task(config, device, dry_run, compile=compile, cuda_graph=graph)
    batch = batch or config_batch
    images = torch.randint(0, 256, (batch, *task.model.image_shape), dtype=torch.uint8, device=device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    optimizer = torch.optim.RAdam(task.parameters(), lr=1e-4)
    if graph:  # what Lightning's loop hands the task (GraphedTraining.graphed_update) made here
        task.cuda_graph_update = CudaGraphUpdate(task.update_loss, optimizer)

    def update(i: int):
        # Lightning's bf16-mixed autocast: no cast cache, which a graph would replay stale
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda", cache_enabled=False):
            if graph:
                task.training_step((images, labels), i)  # forward, backward and the step: one replay
                return
            optimizer.zero_grad(set_to_none=True)
            loss = task.training_step((images, labels), i)
        loss.backward()
        optimizer.step()

    start = time.perf_counter()
    for i in range(WARMUP_UPDATES + 2 if graph else 3):  # warm-up; the compilation, the capture
        update(i)
    _sync(device)
    warmup = time.perf_counter() - start
    start, done = time.perf_counter(), 0
    while done < 3 or (time.perf_counter() - start < seconds and done < 2000):
        update(done)
        done += 1
        if done % 10 == 0:
            _sync(device)
    _sync(device)
    elapsed = time.perf_counter() - start
    if graph:
        assert task.cuda_graph_update.replays >= done, "the timed updates were not replays"
    return {"part": "train", "config": config, "compile": compile, "graph": "cuda_graph" if graph else "",
            "batch": batch, "updates": done,
            "ms_per_update": elapsed / done * 1e3, "images_per_s": done * batch / elapsed, "warmup_s": warmup,
            **gpu_work(lambda: update(done), device)}


def gpu_work(call, device: str) -> dict:
    """What one call asks of the GPU (torch.profiler): ``kernels_per_update``, the launches that
    launch overhead multiplies, and ``gpu_busy_ms``, the kernels' own time; an update that takes
    much longer than its busy time waits on the host (Python, launches), not on the GPU."""
    if device != "cuda":
        return {}
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"kernels_per_update": sum(e.count for e in kernels),
                "gpu_busy_ms": sum(e.self_device_time_total for e in kernels) / 1e3}
    except Exception:  # noqa: BLE001 - a profiler that cannot run here: the columns stay empty
        return {}


def training(device: str, budget, dry_run: bool) -> list[dict]:
    """Eager and graphed at the config batch (the paper's), the same at :data:`BIG_BATCH`, then
    compiled (eager and graphed) at the config batch: each pair eager / graphed, softmax beside linear."""
    rows = []
    seconds = 0.0 if dry_run else 3.0  # a dry run's rows: the three timed updates every row has
    graphs = (False, True) if device == "cuda" else (False,)
    plan = [(c, "none", batch, g) for batch in (None, BIG_BATCH) for g in graphs for c in CONFIGS]
    plan += [] if dry_run else [(c, "model", None, g) for g in graphs for c in CONFIGS]
    for config, compile, batch, graph in plan:
        need = (5 if dry_run else 8) + (0 if compile == "none" else 50)
        what = f"training {config} compile={compile}{' cuda_graph' if graph else ''} batch={batch or 'config'}"
        if not budget.allows(need, what):
            continue
        try:
            rows += budget.keep([train_rate(config, device, compile, batch, seconds, dry_run, graph)])
        except Exception as err:  # noqa: BLE001 - reported, the other rows go on
            budget.skipped.append(f"{what}: {type(err).__name__}: {str(err)[:200]}")
    if dry_run:
        budget.skipped.append("compiled training (torch.compile takes minutes on a CPU; tests/tasks/test_compiled_training.py)")
    if device != "cuda":
        budget.skipped.append("graphed training (a CUDA graph needs a GPU; tests/tasks/test_graphed_update.py checks on "
                              "CPU that the update traces whole and reads nothing on the host)")
    return rows


def _model(method: str, device: str, dry_run: bool):
    import torch

    from linformer_lab.models.pixel_transformer import PixelTransformer

    torch.manual_seed(0)
    size = TINY if dry_run else {"n_layers": 8, "n_heads": 8, "d_model": 256, "d_ff": 1024, "image_shape": (1, 28, 28)}
    backend = {"linear": {"backend": "linear", "feature_map": "elu"}, "stateful-softmax": {"backend": "softmax"}}[method]
    return PixelTransformer(backend, num_mixtures=10, **size).to(device).eval()


def generate_seconds(model, batch: int, decoder: str, step_weights: str, repeats: int, device: str) -> list[float]:
    import torch

    out = []
    for r in range(repeats):
        generator = torch.Generator(device=device).manual_seed(r)
        _sync(device)
        start = time.perf_counter()
        model.generate(batch, generator=generator, decoder=decoder, step_weights=step_weights)
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def generation(device: str, budget, dry_run: bool) -> list[dict]:
    """Batch 1 (latency), batch 1,000 linear against stateful softmax, the largest linear batch."""
    import torch

    graph = "graph"  # without a GPU (a dry run) the graph step runs eagerly
    if dry_run:
        budget.skipped.append("CUDA graphs (no GPU in a dry run; the graph step runs eagerly)")
    models = {m: _model(m, device, dry_run) for m in ("linear", "stateful-softmax")}
    mid = 4 if dry_run else 1000
    largest = [8, 16] if dry_run else [4096, 16384, 65536]
    plan = [  # (role, method, batch, decoder, step weights, repeats, seconds needed)
        ("latency", "linear", 1, "dynamic", "model", 1, 8), ("latency", "linear", 1, graph, "model", 3, 6),
        ("latency", "linear", 1, graph, "bfloat16", 3, 6), ("latency", "stateful-softmax", 1, graph, "model", 3, 6),
        ("latency", "stateful-softmax", 1, "dynamic", "model", 1, 6),
        ("batch 1,000", "linear", mid, graph, "model", 2, 10), ("batch 1,000", "stateful-softmax", mid, graph, "model", 2, 10),
        ("batch 1,000", "linear", mid, graph, "bfloat16", 2, 8),
        ("batch 1,000", "stateful-softmax", mid, graph, "bfloat16", 2, 8),
    ]
    plan += [("largest", "linear", b, graph, "bfloat16", 1, 15 * b / 16384 + 5) for b in largest]
    rows = []
    for role, method, batch, decoder, weights, repeats, need in plan:
        what = f"generation {method} batch {batch} {decoder} {weights}"
        if not budget.allows(1 if dry_run else need, what):
            continue
        try:
            if batch > 1000:  # warm-up where the first call is special
                generate_seconds(models[method], min(batch, 8), decoder, weights, 1, device)
            samples = generate_seconds(models[method], batch, decoder, weights, repeats, device)
        except torch.OutOfMemoryError:
            budget.skipped.append(f"{what}: out of memory")
            torch.cuda.empty_cache()
            break
        except Exception as err:  # noqa: BLE001 - reported, the other rows go on
            budget.skipped.append(f"{what}: {type(err).__name__}: {str(err)[:200]}")
            continue
        seconds = statistics.median(samples)
        rows += budget.keep([{"part": "generation", "role": role, "method": method, "batch": batch, "decoder": decoder,
                     "step_weights": weights,
                     "seconds": seconds, "seconds_per_image": seconds / batch, "images_per_s": batch / seconds,
                     "samples": ";".join(f"{s:.4f}" for s in samples),
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
    return rows


def training_table(rows: list[dict]) -> list[list]:
    return [[r["config"], r["compile"] + (" + CUDA graph" if r.get("graph") else ""), r["batch"], r["updates"],
             f"{r['ms_per_update']:.1f}", f"{r['images_per_s']:.0f}",
             f"{r['warmup_s']:.1f}", r.get("kernels_per_update") or "—",
             f"{r['gpu_busy_ms']:.1f}" if r.get("gpu_busy_ms") else "—"] for r in rows if r["part"] == "train"]


def generation_table(rows: list[dict]) -> list[list]:
    return [[r["role"], r["method"], r["batch"], r["decoder"], r["step_weights"], f"{r['seconds']:.3f}",
             f"{r['seconds_per_image']:.4f}", f"{r['images_per_s']:.1f}"] for r in rows if r["part"] == "generation"]


#: Seconds a Fig. 2 run needs before its first update (imports, CUDA start, the first compile) and
#: the script after the runs stop (reports): Lightning's max_time counts neither.
FIGURE2_OVERHEAD_S = 60


def figure2(device: str, budget, out: Path, dry_run: bool) -> list[dict]:
    """``figure2_copy.py --paper`` (eight runs at once on the GPU) stopped by Lightning's max_time
    within the budget; a dry run: one run of ``--quick`` (bf16 linear attention, our recipe). Rows of part
    ``figure2``; the reports go to ``out/figure2``."""
    left = budget.left() - FIGURE2_OVERHEAD_S
    if not dry_run and not budget.allows(FIGURE2_OVERHEAD_S + 60, "Fig. 2 at the paper's shape"):
        return []
    results = out / "figure2"
    command = [sys.executable, str(REPO / "benchmarks" / "paper" / "figure2_copy.py"), "--out", str(results),
               "--log-root", tempfile.mkdtemp(prefix="figure2_logs_")]  # checkpoints stay out of the results
    if dry_run:
        command += ["--quick", "--methods", "linear", "--precisions", "bf16-mixed", "--recipes", "ours", "--jobs", "1"]
    else:
        command += ["--paper", "--accelerator", "cuda", "--jobs", "8", "--max-minutes", f"{left / 60:.2f}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    (out / "figure2_copy.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        budget.skipped.append(f"Fig. 2 failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    summaries = sorted(results.glob("*_summary.csv"))
    rows = [{"part": "figure2", **r} for path in summaries for r in csv.DictReader(path.open())]
    return budget.keep(rows)


def figure2_lines(rows: list[dict]) -> list[str]:
    """Markdown of the Fig. 2 part: a row per run."""
    def cell(value):
        return "—" if value in (None, "") else f"{float(value):.4f}"

    table = [[r["recipe"], r["precision"], r["method"], r.get("updates") or r.get("error", ""), cell(r.get("train_loss")),
              cell(r.get("train_loss_no_dropout")), cell(r.get("val_loss")), cell(r.get("val_accuracy"))]
             for r in rows if r["part"] == "figure2"]
    import common

    return ["## Fig. 2 at the paper's shape for the time left (`figure2_copy.py --paper`; its files in the logs archive)",
            "", common.markdown_table(["recipe", "precision", "method", "updates", "train loss", "train loss, no dropout",
                                       "val loss", "val copy accuracy"], table), ""]
