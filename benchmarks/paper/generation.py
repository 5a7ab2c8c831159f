"""Paper Tables 1, 2, 4 and 5 (§4.2, appendix C): autoregressive image-generation throughput
(images/s at a large batch) and latency (seconds for one image at batch 1) of the MNIST
model (8 layers, 784 sub-pixels) and the CIFAR-10 model (16 layers, 3072 sub-pixels), both
d_model 256, 8 heads, d_ff 1024, 10 logistics, with random weights (the time per image does
not depend on training; bits/dim is therefore "—").

Methods
-------
- ``softmax``: the paper's baseline, a transformer that re-runs its parallel forward over the
  whole prefix at every step (what a plain PyTorch transformer does). This one method is
  implemented here (:func:`recompute_step`), on the model's own ``embed`` / ``transformer`` /
  ``head``.
- ``stateful-softmax`` (appendix C.1): ``PixelTransformer.generate`` with the softmax
  backend, whose step keeps a KV cache.
- ``lsh-1``, ``lsh-4``: ``generate`` with Reformer attention (64 buckets; chunks of 29 for
  MNIST, 37 for CIFAR-10, as in the paper). LSH has no recurrent form, so the library's step
  re-runs the stack over the prefix.
- ``linear``: ``generate`` with linear attention (elu + 1) in RNN mode (§3.4).

Timing
------
``linear`` and ``stateful-softmax`` are always timed over whole images: every repeat is one
full ``generate`` call, the two methods interleaved (L, S, L, S, ...), median reported, after
one untimed warm-up call that also records the recurrent state's size at the first and at the
last sub-pixel (``state_nbytes``; on GPU also ``torch.cuda.memory_allocated``).

The recompute methods (``softmax``, ``lsh-*``) cost O(t) or more at step t, so a whole image
can take hours. For them the step at position t is timed at several positions spread over
the whole image (``--positions``, always including the first and the last), a least-squares
fit ``cost(t) = a + b (t + 1) + c (t + 1)^2`` is made (softmax attention over the prefix is
quadratic in t, the projections linear), and the total is ``sum_t cost(t)`` over all N
positions. Rows made that way are labelled **fit** in every table. When the fitted total is
under ``--full-budget`` seconds the method is also run over a whole image and the measured
time is reported instead (the fit's prediction stays in the CSV as a check of the method).
A timed step is exactly the step the generation loop runs at that position: for ``softmax``
the forward over the prefix ``0..t`` plus head and sampling; for ``lsh-*`` the library's
``Transformer.step`` on a prefix state holding ``t`` earlier inputs, plus head and sampling.

CPU runs use ``--threads`` intra-op threads for every method (default 1: on a loaded 2-core machine
two threads made the recompute step at t = 400 take 1.1 s against 0.09 s with one).
GPU runs (``--device cuda``) time with CUDA events and search the largest batch of MNIST images
``linear`` generates at once (``--max-batch``; paper: 10,000 on an 11 GB GPU).

    uv run python benchmarks/paper/generation.py                 # full CPU run (~30-40 min on 2 cores)
    uv run python benchmarks/paper/generation.py --quick         # smoke run (~1-2 min)
    uv run python benchmarks/paper/generation.py --device cuda   # GPU: CUDA events, max linear batch
    uv run python benchmarks/paper/generation.py --trained logs  # Tables 4, 5 on the trained CPU-recipe MNIST models

Writes ``benchmarks/paper/results/generation_<device>[_quick][_tag].{csv,md,png}``; ``--replot CSV`` redraws the PNG."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402
from generation_report import DATASETS, METHODS, RECURRENT, header_lines, plot, write_reports  # noqa: E402

from linformer_lab.attention.config import AttentionConfig  # noqa: E402
from linformer_lab.models.generation import STEP_WEIGHT_FORMATS, dynamic_step  # noqa: E402
from linformer_lab.models.pixel_transformer import PixelTransformer  # noqa: E402
from linformer_lab.ops.state import SequenceBuffer, state_nbytes  # noqa: E402  (SequenceBuffer: lsh's step state, to time one step)
from linformer_lab.tasks.checkpoint_files import CheckpointMismatchError, load_checkpoint_header  # noqa: E402
from linformer_lab.tasks.image_generation import ImageGenerationTask  # noqa: E402

RESULTS = str(common.results_dir(__file__))

# ---------------------------------------------------------------- models and methods
def attention_config(method: str, dataset: str) -> AttentionConfig:
    if method in ("softmax", "stateful-softmax"):
        return AttentionConfig(backend="softmax")
    if method.startswith("lsh-"):
        kwargs = {"n_hashes": int(method[4:]), "bucket_size": DATASETS[dataset]["bucket_size"], "n_buckets": 64}
        return AttentionConfig(backend="lsh", kwargs=kwargs)
    if method == "linear":
        return AttentionConfig(backend="linear", feature_map="elu")
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def build_model(method: str, dataset: str, device: str, seed: int = 0, trained: str | None = None) -> PixelTransformer:
    if trained:
        return trained_model(method, trained, device)
    spec = DATASETS[dataset]
    torch.manual_seed(seed)
    model = PixelTransformer(
        attention_config(method, dataset), n_layers=spec["n_layers"], n_heads=8, d_model=256, d_ff=1024,
        num_mixtures=10, image_shape=spec["image_shape"],
    )
    return model.to(device).eval()


#: --trained: the run of benchmarks/paper/mnist_table1.py behind each method (both softmaxes time one model)
TRAINED_RUN = {"linear": "linear", "softmax": "softmax", "stateful-softmax": "softmax", "lsh-1": "lsh1", "lsh-4": "lsh4"}


def trained_model(method: str, runs: str, device: str) -> PixelTransformer:
    """The model that Table 1 at CPU scale reports for ``method``: its run's best checkpoint."""
    path = common.best_checkpoint(TRAINED_RUN[method], runs)
    try:  # the header first: it refuses a file holding anything but tensors and plain data, before it runs
        load_checkpoint_header(str(path))
    except CheckpointMismatchError as err:  # not there, unreadable or unsafe
        raise SystemExit(f"error: {err}") from None
    # weights_only given explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD overrides only an unset one
    model = ImageGenerationTask.load_from_checkpoint(path, map_location=device, weights_only=True).model
    if model.attention_config.backend != attention_config(method, "mnist").backend:
        raise SystemExit(f"--trained: {path} is a {model.attention_config.backend} model, not {method}")
    return model.to(device).eval()


@torch.inference_mode()
def recompute_step(model: PixelTransformer, values: torch.Tensor, t: int, generator=None) -> None:
    """The paper's ``softmax`` baseline at position ``t``: the parallel forward over the
    prefix ``0..t`` (inputs are the values ``0..t-1``), the output head at ``t`` and a sample
    written to ``values[:, t]``. No state is kept between positions."""
    hidden = model.transformer(model.embed(values[:, : t + 1]))[:, -1]
    values[:, t] = model.head.sample(model.head(hidden), temperature=1.0, generator=generator)


@torch.inference_mode()
def generate_recompute(model: PixelTransformer, batch_size: int, generator=None) -> torch.Tensor:
    """A whole image with :func:`recompute_step` at every position: uint8 ``(B, C, H, W)``."""
    values = torch.zeros(batch_size, model.seq_len, dtype=torch.long, device=model.start.device)
    for t in range(model.seq_len):
        recompute_step(model, values, t, generator)
    return model.to_images(values)


@torch.inference_mode()
def lsh_step_at(model: PixelTransformer, batch_size: int, t: int):
    """A zero-argument call that runs exactly the generation loop's step at position ``t`` for
    a backend without a recurrent form (lsh): ``fast_step`` (here ``Transformer.step``) on a
    prefix state holding ``t`` earlier inputs, then the output head and sampling. Each call starts from a fresh
    copy of the state (built outside the call)."""
    device = model.start.device
    gen = torch.Generator(device=device).manual_seed(t)
    earlier = torch.randn(batch_size, t, model.d_model, generator=gen, device=device) * 0.02
    x_t = torch.randn(batch_size, model.d_model, generator=gen, device=device) * 0.02
    states = []

    def prepare():
        state = SequenceBuffer(x_t, dim=1)
        for i in range(t):
            state.append(earlier[:, i])
        states.append(state)

    def call():
        with torch.inference_mode():
            hidden, _ = dynamic_step.fast_step(model.transformer, x_t, states.pop())
            model.head.sample(model.head(hidden))

    return prepare, call


class StateRecorder:
    """Wraps ``dynamic_step.fast_step`` (the step ``generate`` runs) during one ``generate`` call
    and records the recurrent state's size after the first and after the last sub-pixel (and on
    GPU the allocated memory at those two points)."""

    def __init__(self, model: PixelTransformer):
        self.model, self.step, self.position = model, dynamic_step.fast_step, 0
        self.first_bytes = self.last_bytes = self.first_alloc = self.last_alloc = None
        self.cuda = model.start.is_cuda

    def __call__(self, transformer, x_t, state=None):
        out, state = self.step(transformer, x_t, state)
        if self.position == 0 or self.position == self.model.seq_len - 1:
            nbytes = state_nbytes(state)  # lsh's state: its prefix of inputs, a SequenceBuffer
            alloc = torch.cuda.memory_allocated() if self.cuda else None
            if self.position == 0:
                self.first_bytes, self.first_alloc = nbytes, alloc
            else:
                self.last_bytes, self.last_alloc = nbytes, alloc
        self.position += 1
        return out, state

    def __enter__(self):
        dynamic_step.fast_step = self  # generate() looks it up on the module at every step
        return self

    def __exit__(self, *exc):
        dynamic_step.fast_step = self.step


def fit_total(positions: list[int], seconds: list[float], n: int) -> tuple[float, list[float]]:
    """Least squares ``cost(t) = a + b (t+1) + c (t+1)^2`` over the measured steps; returns
    ``(sum over t = 0..n-1 of cost(t), [a, b, c])`` (degree lowered if too few positions)."""
    degree = min(2, len(positions) - 1)
    x = torch.tensor([[float(t + 1) ** k for k in range(degree + 1)] for t in positions], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(x, y, driver="gelsd").solution.squeeze(1).tolist()
    power_sums = [sum(float(t) ** k for t in range(1, n + 1)) for k in range(degree + 1)]
    return sum(c * s for c, s in zip(coef, power_sums)), coef


def spread_positions(n: int, count: int) -> list[int]:
    """``count`` positions from 0 to n - 1, denser at the end where steps cost most."""
    if count <= 1:
        return [n - 1]
    return sorted({round((n - 1) * math.sqrt(i / (count - 1))) for i in range(count)})


# ---------------------------------------------------------------- measurements
def measure_recurrent(models: dict, batch: int, repeats: int, timer: common.Timer, bar) -> dict:
    """Whole-image ``generate`` calls of the recurrent methods, interleaved; ``models`` maps
    ``(method, step weight format)`` to a model. Per key the median seconds, all samples, load
    averages and the state sizes of the warm-up call."""
    out = {}
    for (method, fmt), model in models.items():
        bar.set_postfix_str(f"{method} [{fmt}] B={batch} warm-up")
        with StateRecorder(model) as rec:
            model.generate(batch, generator=_generator(model, 0), step_weights=fmt)
        out[method, fmt] = dict(samples=[], loads=[], state_first=rec.first_bytes, state_last=rec.last_bytes,
                                alloc_first=rec.first_alloc, alloc_last=rec.last_alloc)
        bar.update()
    for r in range(repeats):
        for (method, fmt), model in models.items():
            bar.set_postfix_str(f"{method} [{fmt}] B={batch} repeat {r + 1}/{repeats}")
            seconds = timer(lambda: model.generate(batch, generator=_generator(model, r + 1), step_weights=fmt))
            out[method, fmt]["samples"].append(seconds)
            out[method, fmt]["loads"].append(os.getloadavg()[0])
            bar.update()
    for res in out.values():
        res["seconds"] = statistics.median(res["samples"])
    return out


def measure_recompute(method: str, model: PixelTransformer, batch: int, positions: list[int], repeats: int,
                      full_budget: float, timer: common.Timer, bar) -> dict:
    """Steps at ``positions`` (median of ``repeats``), the fitted total, and a whole image when
    the fit predicts at most ``full_budget`` seconds."""
    n = model.seq_len
    device = model.start.device
    step_seconds = []
    for t in positions:
        bar.set_postfix_str(f"{method} B={batch} step at t={t}")
        if method == "softmax":
            values = torch.randint(0, 256, (batch, n), device=device)
            call = lambda: recompute_step(model, values, t)  # noqa: E731
            prepare = lambda: None  # noqa: E731
        else:
            prepare, call = lsh_step_at(model, batch, t)
        prepare()
        first = timer(call)  # warm-up at this size; kept as a sample when it is long (> 1 s)
        samples = [first] if first > 1.0 else []
        while len(samples) < repeats:
            prepare()
            samples.append(timer(call))
        step_seconds.append(statistics.median(samples))
        bar.update()
    total_fit, coef = fit_total(positions, step_seconds, n)
    res = dict(positions=positions, step_seconds=step_seconds, fit_seconds=total_fit, fit_coef=coef,
               seconds=total_fit, source="fit", loads=[os.getloadavg()[0]])
    if total_fit <= full_budget:
        bar.set_postfix_str(f"{method} B={batch} whole image")
        gen = _generator(model, 1)
        if method == "softmax":
            seconds = timer(lambda: generate_recompute(model, batch, gen))
        else:
            seconds = timer(lambda: model.generate(batch, generator=gen))
        res.update(seconds=seconds, source="measured", loads=res["loads"] + [os.getloadavg()[0]])
    bar.update()
    return res


@torch.inference_mode()
def matvec_floor(model: PixelTransformer, batch: int, repeats: int, timer: common.Timer, fmt: str = "model") -> float:
    """Seconds per image (median of ``repeats``) for only the weight products that every
    step of the recurrent methods makes: the four linear layers of each transformer layer,
    through the same kernels and weight copy as ``generate`` (``step_linear`` inside
    ``weight_copies_for_steps(..., fmt)``), once per sub-pixel. At batch 1 they read every weight
    once per step, so this is the memory-bandwidth floor of RNN-mode generation here."""
    from linformer_lab.models.generation import generation_kernels, step_linear, weight_copies_for_steps

    device = model.start.device
    x = torch.randn(batch, model.d_model, device=device)
    h = torch.randn(batch, model.transformer.layers[0].feedforward[0].out_features, device=device)
    linears = [(layer.attention.qkv, layer.attention.out, layer.feedforward[0], layer.feedforward[3])
               for layer in model.transformer.layers]

    def image():
        for _ in range(model.seq_len):
            for qkv, out, up, down in linears:
                step_linear(x, qkv), step_linear(x, out), step_linear(x, up), step_linear(h, down)

    # the kernels generate() steps under (oneDNN off on CPU, one thread for small batches)
    with weight_copies_for_steps(model.transformer, fmt), generation_kernels(device, batch):
        image()
        samples = [timer(image) for _ in range(repeats)]
    return statistics.median(samples) / batch


def _generator(model: PixelTransformer, seed: int) -> torch.Generator:
    return torch.Generator(device=model.start.device).manual_seed(seed)


def max_linear_batch(dataset: str, device: str, candidates: list[int], timer: common.Timer, bar) -> list[dict]:
    """GPU only: whole-image ``linear`` generation at growing batch sizes until one does not
    fit; per batch the seconds, images/s and peak memory."""
    model = build_model("linear", dataset, device)
    rows = []
    for batch in candidates:
        bar.set_postfix_str(f"max batch: linear B={batch}")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            seconds = timer(lambda: model.generate(batch, generator=_generator(model, 0)))
        except torch.OutOfMemoryError:
            rows.append(dict(batch=batch, status="out of memory"))
            break
        rows.append(dict(batch=batch, status="ok", seconds=seconds, images_per_s=batch / seconds,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
    bar.update()
    return rows


# ---------------------------------------------------------------- run
def run(args) -> tuple[list[dict], dict]:
    device = args.device
    timer = common.Timer(device)
    rows: list[dict] = []
    extra: dict = {}
    plan = []  # (dataset, batch, kind)
    for dataset in args.datasets:
        for batch in sorted({1} if args.latency_only else {1, args.batch[dataset]}):
            plan.append((dataset, batch))
    n_recompute = len([m for m in args.methods if m not in RECURRENT])
    n_recurrent = len([m for m in args.methods if m in RECURRENT])

    def formats(batch: int) -> list[str]:  # lossy step weights are a latency measure: batch 1 only
        return args.step_weights if batch == 1 else ["model"]

    total = sum(n_recurrent * len(formats(b)) * (1 + (args.repeats if b == 1 else args.repeats_batch))
                + (len(args.step_weights) if b == 1 and n_recurrent else 0) + n_recompute * (len(spread_positions(
        DATASETS[d]["image_shape"][0] * DATASETS[d]["image_shape"][1] * DATASETS[d]["image_shape"][2],
        args.positions)) + 1) for d, b in plan) + (1 if device == "cuda" else 0)
    bar = _progress(total)
    for dataset, batch in plan:
        built = {m: build_model(m, dataset, device, trained=args.trained) for m in args.methods if m in RECURRENT}
        recurrent = {(m, fmt): model for m, model in built.items() for fmt in formats(batch)}
        load_before = os.getloadavg()[0]
        repeats = args.repeats if batch == 1 else args.repeats_batch
        results = measure_recurrent(recurrent, batch, repeats, timer, bar) if recurrent else {}
        for key in recurrent:
            results[key]["source"] = "measured"
        if "linear" in built and batch == 1:
            for fmt in formats(batch):
                bar.set_postfix_str(f"linear layers alone [{fmt}] (floor)")
                extra.setdefault("floor", {}).setdefault(dataset, {})[fmt] = matvec_floor(
                    built["linear"], 1, args.repeats, timer, fmt)
                bar.update()
        del recurrent, built
        for method in [m for m in args.methods if m not in RECURRENT]:
            model = build_model(method, dataset, device, trained=args.trained)
            positions = spread_positions(model.seq_len, args.positions)
            results[method, "model"] = measure_recompute(method, model, batch, positions,
                                                         args.step_repeats if batch == 1 else args.step_repeats_batch,
                                                         args.full_budget, timer, bar)
        for (method, fmt), r in sorted(results.items(), key=lambda kv: (METHODS.index(kv[0][0]), kv[0][1] != "model")):
            rows.append(dict(
                dataset=dataset, method=method, step_weights=fmt, batch=batch, device=device,
                threads=torch.get_num_threads(),
                source=r["source"], seconds=r["seconds"], images_per_s=batch / r["seconds"],
                seconds_per_image=r["seconds"] / batch,
                repeats=len(r.get("samples", [])) or None,
                samples=";".join(f"{s:.3f}" for s in r.get("samples", [])) or None,
                fit_seconds=r.get("fit_seconds"),
                fit_coef=";".join(f"{c:.4g}" for c in r["fit_coef"]) if "fit_coef" in r else None,
                positions=";".join(map(str, r["positions"])) if "positions" in r else None,
                step_seconds=";".join(f"{s:.4f}" for s in r["step_seconds"]) if "step_seconds" in r else None,
                state_bytes_first=r.get("state_first"), state_bytes_last=r.get("state_last"),
                cuda_alloc_first=r.get("alloc_first"), cuda_alloc_last=r.get("alloc_last"),
                loadavg_1m_before=round(load_before, 2), loadavg_1m_max=round(max(r.get("loads", [load_before])), 2),
            ))
    if device == "cuda" and "mnist" in args.datasets and "linear" in args.methods:
        extra["max_batch"] = max_linear_batch("mnist", device, args.max_batch, timer, bar)
    bar.close()
    return rows, extra


def _progress(total: int):
    return tqdm(total=total, unit="step", dynamic_ncols=True)


# ---------------------------------------------------------------- tables
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--datasets", nargs="+", default=["mnist", "cifar10"], choices=list(DATASETS))
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--batch-mnist", type=int, default=None, help="throughput batch (default: CPU 64, GPU 100)")
    p.add_argument("--batch-cifar10", type=int, default=None, help="throughput batch (default: CPU 16, GPU 16)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on CPU (see the module docstring)")
    p.add_argument("--repeats", type=int, default=3, help="whole-image repeats of the recurrent methods at batch 1")
    p.add_argument("--repeats-batch", type=int, default=2, help="the same at the throughput batch")
    p.add_argument("--positions", type=int, default=7, help="positions timed for the recompute methods")
    p.add_argument("--step-repeats", type=int, default=3, help="timings per position (median) at batch 1")
    p.add_argument("--step-repeats-batch", type=int, default=1, help="the same at the throughput batch")
    p.add_argument("--full-budget", type=float, default=150.0,
                   help="s; run a recompute method over a whole image when its fit predicts at most this")
    p.add_argument("--max-batch", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 10000, 16384, 32768, 65536],
                   help="GPU: batch sizes tried for linear's largest MNIST batch")
    p.add_argument("--step-weights", nargs="+", default=["model"], choices=list(STEP_WEIGHT_FORMATS),
                   help="weight copies the recurrent methods' steps read (generate(step_weights=...)); formats other "
                        "than model are timed at batch 1 only (they are a latency measure)")
    p.add_argument("--latency-only", action="store_true", help="batch 1 only (no throughput batch)")
    p.add_argument("--trained", metavar="RUNS", help="time mnist_table1.py's trained MNIST models (runs under RUNS: logs)")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--quick", action="store_true", help="smoke run: MNIST, batch 1 and 8, 1 repeat, 3 positions")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--replot", metavar="CSV", help="only redraw the PNG of an earlier run from its CSV, then exit")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.replot:
        import csv

        with open(args.replot) as f:
            rows = list(csv.DictReader(f))
        png = os.path.splitext(args.replot)[0] + ".png"
        print(png if plot(rows, png, rows[0]["device"] if rows else args.device) else "no plot")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    gpu = args.device == "cuda"
    args.batch = {"mnist": args.batch_mnist or (100 if gpu else 64), "cifar10": args.batch_cifar10 or 16}
    if args.quick:
        args.datasets, args.repeats, args.repeats_batch, args.positions, args.step_repeats = ["mnist"], 1, 1, 3, 1
        args.batch["mnist"] = args.batch_mnist or 8
        args.full_budget = min(args.full_budget, 0.0)
        args.max_batch = args.max_batch[:2]
    if args.trained:  # only MNIST has a CPU recipe
        args.datasets, args.tag = ["mnist"], args.tag or "mnist_trained"
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    load_start = common.load_line()
    t0 = time.perf_counter()
    rows, extra = run(args)
    wall = time.perf_counter() - t0
    mach = common.machine_info()
    device_name = torch.cuda.get_device_name() if gpu else mach["cpu"]
    tag = args.device + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    threads = f"{torch.get_num_threads()} intra-op thread(s)" if not gpu else "CUDA events"
    header = header_lines(args, f"{device_name}; {mach['logical_cpus']} logical CPUs, {mach['mem_gib']} GiB; "
                          f"torch {torch.__version__}; {threads}", wall, load_start)
    print(write_reports(rows, extra, args, header, os.path.join(args.out, f"generation_{tag}")))


if __name__ == "__main__":
    main()
