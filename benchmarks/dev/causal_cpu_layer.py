"""The causal linear-attention *layer* on CPU against its bare kernel (issue #45): forward+backward of
``LinearAttention(causal=True)`` (elu + 1) before and after the fused C++ kernel, the kernel alone
on mapped q, k, and fast-transformers 0.4.0's ``CausalLinearAttention`` layer, fp32, timed
interleaved in one process (1 thread by default), on the timing thread's CPU time by default
(``--clock``; the machine is shared) with wall times beside them in the csv.

* ``layer after``: the layer as it runs now: the ``cpp`` candidate of the ``causal_attention`` op
  (``ops/cpu/causal_recurrence.cpp``'s ``attention_forward`` / ``attention_backward``: phi, the
  numerator and the normaliser in one forward and one backward);
* ``layer before``: the same layer with ``LINFORMER_LAB_KERNELS=causal_attention=pytorch``: the elu
  map, the numerator and the normaliser in PyTorch and their gradients;
* ``kernel``: the fused kernel alone (``causal_recurrence.causal_attention``, numerator and
  normaliser) on feature-mapped q, k given through an identity map, what the layer must stay within
  1.3x of;
* ``FT layer``: fast-transformers' layer with its own elu feature map, on its layout (B, N, H, D),
  with its full-length mask objects (no padding).

Shapes: the six of issue #23 and the grid of ``causal_cpu_grid.py`` (D = M in {16, 32, 64, 128} x
B*H in {1, 8, 64, 512} x N in {256, 4096, 65536}), less those with more than ``--max-elements``
numbers per input tensor (listed as skipped); ``--quick``: the quick grid (the six and eight
small ones).

fast-transformers lives in a separate venv (benchmarks/README.md, "fast-transformers baseline
venv"); without it the others still run::

    PYTHONPATH=. .bench_env/bin/python benchmarks/dev/causal_cpu_layer.py [--quick]

``--bf16``: also the layer on bf16 inputs, on the fused kernel (which runs them as float32), over the
float32 layer.

End to end, ``--train mnist_cpu_linear.yaml``: one training update of the config's image model
(or ``copy_linear.yaml``'s copy task, under bf16 autocast as it trains) before and after,
alternating in one process, CPU time (``causal_cpu_layer_train_<config>.{csv,md}``);
``--generate``: batch-1 MNIST completion, prefilled and stepped, before and after
(``causal_cpu_layer_generate.{csv,md}``).

Results: ``benchmarks/dev/results/causal_cpu_layer{_quick}{tag}.{csv,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402

RESULTS = str(common.results_dir(__file__))
#: the identity as a feature map: the kernel row's q, k are phi(q), phi(k) already (taken as a map's
#: applied before the kernel: no ``kernel_form``)
MAPPED_ALREADY = types.SimpleNamespace(forward_queries=lambda x: x, forward_keys=lambda x: x)
#: (B, H, N, D = M): issue #23's six shapes, then the grid of causal_cpu_grid.py
ISSUE_SHAPES = [(4, 8, 4096, 64), (1, 8, 16384, 32), (1, 8, 4096, 32), (8, 8, 1024, 64), (2, 4, 8192, 128),
                (16, 8, 512, 32)]


def grid(heads, rows, lengths) -> list[tuple]:
    """B*H rows as (B*H / 8, 8), or (1, 1) for one row, by N and D."""
    return [((r // 8, 8) if r >= 8 else (1, 1)) + (n, d) for d in heads for r in rows for n in lengths]


def shapes_to_run(args) -> tuple[list[tuple], list[tuple]]:
    """(shapes to run, shapes over --max-elements), or --shapes alone."""
    if args.shapes:
        return args.shapes, []
    shapes = ISSUE_SHAPES + (grid([16, 64], [1, 64], [256, 4096]) if args.quick
                             else grid([16, 32, 64, 128], [1, 8, 64, 512], [256, 4096, 65536]))
    return ([s for s in shapes if s[0] * s[1] * s[2] * s[3] <= args.max_elements],
            [s for s in shapes if s[0] * s[1] * s[2] * s[3] > args.max_elements])


def shape_argument(text: str) -> tuple[int, int, int, int]:
    """``"8x8x4096x128"`` -> (8, 8, 4096, 128)."""
    try:
        b, h, n, d = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BxHxNxD, e.g. 8x8x4096x128, not {text!r}") from None
    return b, h, n, d


def ft_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pytorch-fast-transformers")
    except metadata.PackageNotFoundError:
        return "not installed"


def switched(value: str):
    """``LINFORMER_LAB_KERNELS=value`` within the block (the dispatch reads it at every selection)."""
    from linformer_lab.ops import kernels

    return kernels.switched(value)


def ft_layer(torch, d: int):
    """fast-transformers' causal layer and its mask objects' makers, or None where it is not installed."""
    try:
        from fast_transformers.attention.causal_linear_attention import CausalLinearAttention
        from fast_transformers.masking import LengthMask, TriangularCausalMask
    except ImportError:
        return None
    layer = CausalLinearAttention(d)
    return lambda q, k, v: layer(q, k, v, TriangularCausalMask(q.shape[1]),
                                 LengthMask(torch.full((q.shape[0],), q.shape[1], dtype=torch.long)),
                                 LengthMask(torch.full((q.shape[0],), q.shape[1], dtype=torch.long)))


def measure(torch, shape, args) -> dict:
    from linformer_lab.attention.linear import LinearAttention
    from linformer_lab.ops.cpu import causal_recurrence

    b, h, n, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=gen)
    # the bare kernel's inputs: feature-mapped
    phi_q, phi_k = ((torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen)) + 1).requires_grad_()
                    for _ in range(2))
    layer = LinearAttention(causal=True, query_dim=d, feature_map=args.feature_map)
    cases = {
        "kernel": common.forward_backward(lambda: causal_recurrence.causal_attention(MAPPED_ALREADY, phi_q, phi_k, v),
                                          (phi_q, phi_k, v), grad),
        "layer_after": common.forward_backward(lambda: layer(q, k, v), (q, k, v), grad),
        "layer_before": common.forward_backward(lambda: layer(q, k, v), (q, k, v), grad,
                                                lambda: switched("causal_attention=pytorch")),
    }
    if args.bf16:
        # the layer on bf16 inputs: the fused kernel runs them as float32
        qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
        cases["bf16_as_fp32"] = common.forward_backward(lambda: layer(qb, kb, vb), (qb, kb, vb), grad.bfloat16(),
                                                        lambda: switched("causal_attention=cpp"))
    ft = ft_layer(torch, d) if args.feature_map == "elu" else None  # its own map is elu's
    if ft is not None:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        grad_t = grad.transpose(1, 2).contiguous()
        cases["ft_layer"] = common.forward_backward(lambda: ft(qt, kt, vt), (qt, kt, vt), grad_t)
    round_s = common.Timer()(lambda: [fn() for fn in cases.values()])  # a warm-up round, timed to size the rest
    repeats = max(3, min(args.repeats, int(args.budget / max(round_s, 1e-6))))
    cpu_samples = {name: [] for name in cases}
    times = common.interleaved_medians(cpu_timed(cases, cpu_samples), repeats, warmup=0, budget_s=args.budget)
    row = {"B": b, "H": h, "N": n, "D": d, "repeats": len(next(iter(times.values()))["samples"]),
           "loadavg_1min": round(os.getloadavg()[0], 2), "clock": args.clock}
    for name, t in times.items():
        row[f"{name}_wall_ms"] = round(t["median"] * 1e3, 3)
        row[f"{name}_cpu_ms"] = round(statistics.median(cpu_samples[name]) * 1e3, 3)
    ms = {name: row[f"{name}_{args.clock}_ms"] for name in cases}
    for name in cases:
        row[f"{name}_ms"] = ms[name]
    row["after_over_kernel"] = round(ms["layer_after"] / ms["kernel"], 3)
    row["before_over_kernel"] = round(ms["layer_before"] / ms["kernel"], 3)
    row["before_over_after"] = round(ms["layer_before"] / ms["layer_after"], 3)
    if "bf16_as_fp32" in ms:
        row["bf16_as_fp32_over_after"] = round(ms["bf16_as_fp32"] / ms["layer_after"], 3)
    if "ft_layer" in ms:
        row["ft_over_after"] = round(ms["ft_layer"] / ms["layer_after"], 3)
        row["ft_over_before"] = round(ms["ft_layer"] / ms["layer_before"], 3)
    return row


def cpu_timed(cases: dict, samples: dict) -> dict:
    """``cases`` whose every call also appends the timing thread's CPU seconds to ``samples[name]``."""
    def timed(name, fn):
        def call():
            start = time.thread_time()
            fn()
            samples[name].append(time.thread_time() - start)
        return call

    return {name: timed(name, fn) for name, fn in cases.items()}


def cpu_medians(cases: dict, repeats: int) -> tuple[dict, dict]:
    """(median CPU seconds, all samples) per case over ``repeats`` interleaved rounds after one warm-up round."""
    samples = {name: [] for name in cases}
    timed = cpu_timed(cases, samples)
    for fn in timed.values():
        fn()
    for values in samples.values():
        values.clear()
    common.interleaved_medians(timed, repeats, warmup=0)
    return {name: statistics.median(values) for name, values in samples.items()}, samples


def train(args, env) -> str:
    """``--train CONFIG``: one training update of the config's image model (``common.image_training_update``)
    or copy task (``copy_*.yaml``) before (``causal_attention=pytorch``) and after the fused kernel,
    interleaved, CPU time."""
    update, batch = (copy_training_update(args.train) if args.train.startswith("copy")
                     else common.image_training_update(args.train)[:2])
    cases = {"after": update, "before": lambda: _switched_update(update)}
    median, samples = cpu_medians(cases, args.updates)
    row = {"config": args.train, "batch": batch, "updates_each": len(samples["after"]),
           "before_cpu_s": round(median["before"], 4), "after_cpu_s": round(median["after"], 4),
           "before_updates_per_s": round(1 / median["before"], 3), "after_updates_per_s": round(1 / median["after"], 3),
           "after_over_before_updates_per_s": round(median["before"] / median["after"], 3)}
    stem = os.path.join(args.out, f"causal_cpu_layer_train_{Path(args.train).stem}{args.tag}")
    common.write_csv(stem + ".csv", [row])
    text = "\n".join([
        f"# One training update of configs/{args.train} before and after the fused CPU attention", "",
        f"Generated by `{env['command']}` on {env['date']}; {env['cpu']} ({env['logical_cpus']} logical CPUs), "
        f"{env['threads']} torch thread, torch {env['torch']}, kernel loops for {env['isa']}; load average "
        f"{env['load_start']} at the start (a shared machine: the timing thread's CPU time, not wall time).", "",
        "Forward, backward, clipping and RAdam on random images (the copy task: one batch of its data) at the "
        "config's batch, under bf16 autocast where the config trains in bf16-mixed; before: "
        "`LINFORMER_LAB_KERNELS=causal_attention=pytorch` (the path before the fused kernel), after: the "
        "default; alternating updates (rounds A B, B A, ...) in one process, medians.", "",
        common.markdown_table(["config", "batch", "updates each", "before s", "after s", "before updates/s",
                               "after updates/s", "after / before (updates/s)"],
                              [[args.train, batch, row["updates_each"], f"{median['before']:.3f}",
                                f"{median['after']:.3f}", row["before_updates_per_s"], row["after_updates_per_s"],
                                row["after_over_before_updates_per_s"]]]), ""])
    Path(stem + ".md").write_text(text)
    return text


def generate(args, env) -> str:
    """``--generate``: batch-1 completion of the bottom half of MNIST by the paper's model (untrained, as
    ``compare_revisions.py generate`` builds it), prefix prefilled in one pass and stepped, before and
    after the fused kernel, alternating in one process, CPU time."""
    import torch

    from linformer_lab.models.pixel_transformer import PixelTransformer

    torch.manual_seed(0)
    model = PixelTransformer("linear", n_layers=8, n_heads=8, d_model=256, d_ff=1024, num_mixtures=10).eval()
    prefix = torch.randint(0, 256, (1, 1, 14, 28), dtype=torch.uint8)

    def complete(prefill: bool, switch: str | None):
        def call():
            with switched(switch) if switch else contextlib.nullcontext():
                model.generate(1, 1.0, prefix=prefix, prefill=prefill, generator=torch.Generator().manual_seed(0))
        return call

    cases = {f"{mode}_{variant}": complete(mode == "prefill", switch) for mode in ("prefill", "stepped")
             for variant, switch in (("after", None), ("before", "causal_attention=pytorch"))}
    median, samples = cpu_medians(cases, args.calls)
    rows = [{"mode": mode, "calls_each": len(samples[f"{mode}_after"]), "before_cpu_s": round(median[f"{mode}_before"], 4),
             "after_cpu_s": round(median[f"{mode}_after"], 4),
             "after_over_before": round(median[f"{mode}_after"] / median[f"{mode}_before"], 3)}
            for mode in ("prefill", "stepped")]
    stem = os.path.join(args.out, f"causal_cpu_layer_generate{args.tag}")
    common.write_csv(stem + ".csv", rows)
    text = "\n".join([
        "# Batch-1 MNIST completion before and after the fused CPU attention", "",
        f"Generated by `{env['command']}` on {env['date']}; {env['cpu']} ({env['logical_cpus']} logical CPUs), "
        f"{env['threads']} torch thread, torch {env['torch']}, kernel loops for {env['isa']}; load average "
        f"{env['load_start']} at the start (a shared machine: the timing thread's CPU time, not wall time).", "",
        "The bottom half of an MNIST image given the top (the paper's model: 8 layers, 8 heads, d_model 256, "
        "untrained), the prefix prefilled in one parallel pass (the causal layer, where the fused kernel runs) or "
        "stepped; before: `LINFORMER_LAB_KERNELS=causal_attention=pytorch`; calls alternating in one process, "
        "medians (s).", "",
        common.markdown_table(["mode", "calls each", "before s", "after s", "after / before"],
                              [[r["mode"], r["calls_each"], f"{r['before_cpu_s']:.3f}", f"{r['after_cpu_s']:.3f}",
                                f"{r['after_over_before']:.3f}"] for r in rows]), ""])
    Path(stem + ".md").write_text(text)
    return text


def copy_training_update(config: str):
    """One training update of the copy task of ``configs/<config>`` (forward, backward, clipping at 1,
    RAdam) on one batch of its data module, under bf16 autocast where the config trains in
    ``bf16-mixed``: ``(update, batch)``."""
    import torch
    import yaml

    from linformer_lab.data.copy import CopyDataModule
    from linformer_lab.tasks.copy_task import CopyTask

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / config).read_text())
    torch.manual_seed(0)
    task = CopyTask(**spec["model"]["init_args"])
    data = CopyDataModule(**spec["data"]["init_args"])
    data.setup("fit")
    tokens, target_mask = next(iter(data.train_dataloader()))
    optimizer = torch.optim.RAdam(task.parameters(), lr=1e-4)
    autocast = spec["trainer"].get("precision") == "bf16-mixed"

    def update():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _, count = task.copy_loss(tokens, target_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), 1.0)
        optimizer.step()

    return update, tokens.shape[0]


def _switched_update(update, value="causal_attention=pytorch"):
    with switched(value):
        update()


def summary(rows, key: str) -> str:
    values = sorted(r[key] for r in rows if key in r)
    if not values:
        return "—"
    return f"min {values[0]:.2f}, median {values[len(values) // 2]:.2f}, max {values[-1]:.2f}"


def write_report(args, rows, skipped, env, path_md) -> str:
    lines = [
        "# Causal linear-attention layer on CPU: fused kernel vs the path before it vs the bare kernel vs "
        "fast-transformers' layer",
        "",
        f"Generated by `{env['command']}` on {env['date']}.",
        "",
        f"- Machine: {env['cpu']} ({env['logical_cpus']} logical CPUs), {env['threads']} torch threads, "
        f"Python {env['python']}, torch {env['torch']}, fast-transformers {env['fast_transformers']}, kernel loops "
        f"for {env['isa']}.",
        f"- Load average at the start {env['load_start']}, at the end {env['load_end']} (1 / 5 / 15 min): the "
        "machine was shared; the implementations are timed interleaved (rounds A B C D, D C B A, ...), so the "
        "ratios hold where the absolute times drift.",
        f"- Forward+backward, fp32, D = M, median ms of {env['clock']} time"
        + (" (the timing thread's CPU time: at one thread, what the call computed, not the time other processes "
           "held the core; the csv also has wall times)" if env["clock"] == "cpu" else "")
        + f". Layer after: `LinearAttention(causal=True, feature_map={args.feature_map!r})` on the "
        "fused C++ kernel (elu inside it; any other map applied by PyTorch first); layer before: the same layer "
        "with `LINFORMER_LAB_KERNELS=causal_attention=pytorch` "
        "(the map, the numerator, the normaliser in PyTorch); kernel: the fused kernel alone (numerator and "
        "normaliser) on feature-mapped q, k; FT layer: fast-transformers' `CausalLinearAttention` (its elu map and normaliser, "
        "layout B N H D).",
        "",
    ]
    header = ["B", "H", "N", "D", "kernel ms", "layer after ms", "layer before ms", "FT layer ms", "after / kernel",
              "before / kernel", "before / after", "FT / after", "load"]
    table = [[r["B"], r["H"], r["N"], r["D"], common.fmt(r.get("kernel_ms"), 2), common.fmt(r.get("layer_after_ms"), 2),
              common.fmt(r.get("layer_before_ms"), 2), common.fmt(r.get("ft_layer_ms"), 2),
              common.fmt(r.get("after_over_kernel"), 2), common.fmt(r.get("before_over_kernel"), 2),
              common.fmt(r.get("before_over_after"), 2), common.fmt(r.get("ft_over_after"), 2), r["loadavg_1min"]]
             for r in rows]
    lines.append(common.markdown_table(header, table))
    lines += ["", f"Layer after / kernel: {summary(rows, 'after_over_kernel')} over {len(rows)} shapes "
                  f"(the issue's bound: 1.3); above 1.3: "
                  + (", ".join(f"{r['B']}x{r['H']}x{r['N']}x{r['D']} ({r['after_over_kernel']:.2f})"
                               for r in rows if r["after_over_kernel"] > 1.3) or "none") + ".",
              "", f"Layer before / kernel: {summary(rows, 'before_over_kernel')}.",
              "", f"Layer before / layer after (the fused kernel's gain): {summary(rows, 'before_over_after')}.",
              "", f"FT layer / layer after: {summary(rows, 'ft_over_after')}; FT layer / layer before: "
                  f"{summary(rows, 'ft_over_before')}."]
    if args.bf16:
        lines += ["", "bf16 inputs (`--bf16`), the layer's fwd+bwd on the fused kernel (as float32) over the "
                      f"float32 layer after: {summary(rows, 'bf16_as_fp32_over_after')}."]
    if skipped:
        shapes = ", ".join("x".join(map(str, s)) for s in skipped)
        lines += ["", f"Not run (B x H x N x D; over {args.max_elements:,} numbers per input tensor): {shapes}."]
    Path(path_md).write_text("\n".join(lines) + "\n")
    return Path(path_md).read_text()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick grid of causal_cpu_grid.py: the issue's six shapes "
                   "and eight of D = 16, 64 x B*H = 1, 64 x N = 256, 4096")
    p.add_argument("--shapes", nargs="+", type=shape_argument, default=None, metavar="BxHxNxD", help="only these shapes")
    p.add_argument("--max-elements", type=int, default=1 << 22, help="numbers per input tensor above which a shape "
                   "is not run (default 2^22: at one thread the larger ones take minutes each)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="what the tables and ratios use: this thread's CPU time (one thread: what the call computed, "
                        "whatever else the machine runs) or wall time; the csv has both")
    p.add_argument("--repeats", type=int, default=7, help="most timed rounds per shape")
    p.add_argument("--budget", type=float, default=4.0, help="seconds of timed rounds per shape (3 rounds at least)")
    p.add_argument("--train", default=None, metavar="CONFIG", help="instead of the layers: one training update of "
                   "configs/CONFIG's image model (mnist_cpu_linear.yaml, say) before and after, --updates each")
    p.add_argument("--updates", type=int, default=40, help="timed updates per variant with --train")
    p.add_argument("--generate", action="store_true", help="instead of the layers: batch-1 MNIST completion before "
                   "and after, --calls each")
    p.add_argument("--calls", type=int, default=5, help="timed completions per variant and mode with --generate")
    p.add_argument("--bf16", action="store_true", help="also the layer on bf16 inputs, on the fused kernel running "
                   "them as float32")
    p.add_argument("--feature-map", default="elu", help="the layer's feature map (a registered name); another "
                   "than elu: its layer on the fused kernel (the map applied first) against the path before")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from linformer_lab.ops import cpu

    torch.set_num_threads(args.threads)
    machine = common.machine_info()
    env = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cpu": machine["cpu"], "logical_cpus": machine["logical_cpus"],
           "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "fast_transformers": ft_version(), "isa": cpu.CAUSAL_RECURRENCE.load().instruction_set(),
           "load_start": " / ".join(f"{x:.2f}" for x in os.getloadavg()), "clock": args.clock}
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures the calling thread: use it with --threads 1")
    os.makedirs(args.out, exist_ok=True)
    if args.train or args.generate:
        print(train(args, env) if args.train else generate(args, env))
        return
    shapes, skipped = shapes_to_run(args)
    rows = []
    for shape in shapes:
        row = measure(torch, shape, args)
        rows.append(row)
        print(row, flush=True)
    env["load_end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    suffix = ("_quick" if args.quick else "") + ("" if args.feature_map == "elu" else f"_{args.feature_map}") + args.tag
    os.makedirs(args.out, exist_ok=True)
    common.write_csv(os.path.join(args.out, f"causal_cpu_layer{suffix}.csv"), rows)
    print(write_report(args, rows, skipped, env, os.path.join(args.out, f"causal_cpu_layer{suffix}.md")))


if __name__ == "__main__":
    main()
