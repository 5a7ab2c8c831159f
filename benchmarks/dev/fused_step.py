"""The fused C++ CPU step (``linformer_lab.models.generation.cpu_step``) against the Python ``fast_step`` and
the weight-product floor, interleaved in one process.

    uv run python benchmarks/dev/fused_step.py                     # batch 1
    uv run python benchmarks/dev/fused_step.py --batches 1 64 --rounds 15
    uv run python benchmarks/dev/fused_step.py --feature-map hedgehog   # a learned map (t2r, hedgehog)

The paper's MNIST model (8 layers, 8 heads, d_model 256, d_ff 1024, 10 logistics, linear
attention with the elu map or ``--feature-map``, seed 0; untrained: the cost does not depend on the weights), CPU,
fp32, under the kernels and ``"model"`` weight copies ``generate`` steps with:

* **step**: ``--steps`` consecutive ``fast_step`` calls continuing a state (made once, before),
  fused (the default) and Python (``LINFORMER_LAB_KERNELS=fused_step=pytorch``), beside the floor: only the four weight
  products of every layer (``step_linear``, as ``benchmarks/paper/generation.py``'s
  ``matvec_floor``), the same number of times. Reported per step.
* **image**: a whole ``generate`` call (784 sub-pixels, temperature 1), fused and Python.

Above ``FUSED_MAX_BATCH`` (16) rows ``fast_step`` keeps to the Python path, so there "fused"
times the Python step too. Rounds alternate the variants, so a change of machine load hits all alike; reported are the
medians over rounds and the ratios. Results: ``benchmarks/dev/results/fused_step.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import interleaved_medians, machine_info, markdown_table, results_dir, write_csv  # noqa: E402

OUT = results_dir(__file__) / "fused_step"


def measure(batch: int, steps: int, rounds: int, threads: int | None, feature_map: str = "elu") -> list[dict]:
    import torch

    from linformer_lab.attention.config import AttentionConfig
    from linformer_lab.models.generation import fast_step, generation_kernels, step_linear, weight_copies_for_steps
    from linformer_lab.models.pixel_transformer import PixelTransformer
    from linformer_lab.ops import cpu, kernels

    if threads:
        torch.set_num_threads(threads)
    if cpu.fused_module() is None:
        raise SystemExit("the fused CPU step extension is unavailable here (see the warning above)")
    torch.manual_seed(0)
    attention = AttentionConfig("linear", feature_map=feature_map)
    model = PixelTransformer(attention, n_layers=8, n_heads=8, d_model=256, d_ff=1024, num_mixtures=10).eval()
    transformer = model.transformer
    inputs = torch.randn(batch, steps, 256) * 0.5
    hidden = torch.randn(batch, 1024)
    linears = [(layer.attention.qkv, layer.attention.out, layer.feedforward[0], layer.feedforward[3])
               for layer in transformer.layers]

    def switch(on: bool):
        os.environ[kernels.SWITCH] = "" if on else "fused_step=pytorch"

    def stepping(on: bool):
        with torch.inference_mode():
            states = [fast_step(transformer, inputs[:, 0])[1]]  # made once (a first step is always Python)

        def run():
            switch(on)
            with torch.inference_mode():
                state = states[0]
                for t in range(steps):
                    _, state = fast_step(transformer, inputs[:, t], state)
        return run

    def floor():
        with torch.inference_mode():
            for t in range(steps):
                x = inputs[:, t]
                for qkv, out, up, down in linears:
                    step_linear(x, qkv), step_linear(x, out), step_linear(x, up), step_linear(hidden, down)

    def image(on: bool):
        def run():
            switch(on)
            model.generate(batch, generator=torch.Generator().manual_seed(0))
        return run

    rows = []
    with generation_kernels(torch.device("cpu"), batch), weight_copies_for_steps(transformer, "model"):
        steps_timed = interleaved_medians({"fused": stepping(True), "python": stepping(False), "floor": floor}, rounds)
    images = interleaved_medians({"fused": image(True), "python": image(False)}, max(3, rounds // 3))
    switch(True)
    floor_s = steps_timed["floor"]["median"] / steps
    for name, res in steps_timed.items():
        per_step = res["median"] / steps
        rows.append(dict(feature_map=feature_map, batch=batch, what="step", variant=name, seconds=per_step,
                         min_seconds=res["min"] / steps, rounds=len(res["samples"]), vs_floor=per_step / floor_s,
                         vs_python=res["median"] / steps_timed["python"]["median"]))
    for name, res in images.items():
        rows.append(dict(feature_map=feature_map, batch=batch, what="image (784 steps)", variant=name, seconds=res["median"],
                         min_seconds=res["min"], rounds=len(res["samples"]), vs_floor=float("nan"),
                         vs_python=res["median"] / images["python"]["median"]))
    return rows


def report(rows: list[dict], args, machine: dict, torch_version: str) -> str:
    table = markdown_table(
        ["map", "batch", "what", "variant", "median s", "min s", "rounds", "/ floor", "/ python"],
        [[r["feature_map"], r["batch"], r["what"], r["variant"], f"{r['seconds']:.3e}", f"{r['min_seconds']:.3e}", r["rounds"],
          "" if r["vs_floor"] != r["vs_floor"] else f"{r['vs_floor']:.2f}", f"{r['vs_python']:.3f}"] for r in rows])
    options = (f"--feature-map {args.feature_map} --batches {' '.join(map(str, args.batches))} --steps {args.steps} "
               f"--rounds {args.rounds}")
    return (f"# Fused CPU step\n\n`benchmarks/dev/fused_step.py {options}`; {machine['cpu']}, "
            f"{machine['logical_cpus']} logical CPUs, torch {torch_version}, load average before "
            f"{machine['loadavg']}, after {tuple(round(x, 2) for x in os.getloadavg())}.\n\n"
            "step: seconds per `fast_step` (floor: the four weight products per layer only); image: seconds per "
            "`generate` call.\n\n" + table + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=100, help="steps per timed call of the step part")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--feature-map", default="elu", choices=("elu", "t2r", "hedgehog"),
                   help="the map of every layer (the ones the fused step computes)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as set)")
    p.add_argument("--out", default=str(OUT), help="prefix of the .csv and .md results")
    args = p.parse_args(argv)
    import torch

    machine = machine_info()
    rows = [row for batch in args.batches
            for row in measure(batch, args.steps, args.rounds, args.threads, args.feature_map)]
    text = report(rows, args, machine, torch.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out + ".csv", rows)
    Path(args.out + ".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
