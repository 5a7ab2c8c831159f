"""What state in and out of the parallel form buys: prefill, segmented training, packed speech.

    uv run python benchmarks/dev/state_benchmarks.py                      # all three parts
    uv run python benchmarks/dev/state_benchmarks.py --parts completion --batches 1

1. **completion**: MNIST completion of the bottom half given the top half (392 known sub-pixels),
   the paper's MNIST model (8 layers, 8 heads, d_model 256, 10 logistics; untrained weights:
   the cost does not depend on them), linear attention, CPU, batch 1 and 64. ``generate(prefix,
   prefill=True)`` (one parallel pass over the prefix, then 392 steps) against
   ``prefill=False`` (all 784 positions stepped, the only way before state out of the parallel
   form). Reported: the prefix part alone and the whole completion, interleaved.
2. **segments**: one training step (forward + backward) of a causal linear transformer LM at
   N = 2^16 tokens, batch 1, as one segment and as segments of 4,096 with the state carried
   (``segmented_forward``: checkpointed, gradient through the state); peak RSS increase of the
   step, each configuration in its own process, and time per token.
3. **speech**: a training epoch of the CPU speech recipe (``configs/speech_cpu_{linear,softmax}``,
   the natural-length synthetic corpus, length-bucketed batches of 8) with the padded batches
   and with the utterances packed (``packed=True``, cu_seqlens), timed interleaved batch by batch.

Results: ``benchmarks/dev/results/state_benchmarks.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
from common import (  # noqa: E402
    Timer,
    interleaved_medians,
    machine_info,
    markdown_table,
    peak_rss_increase,
    results_dir,
    run_in_child,
    write_csv,
)

# ------------------------------------------------------------------ 1. completion


def completion(batch: int, repeats: int, threads: int, device: str = "cpu") -> list[dict]:
    import torch

    from linformer_lab.models.generation import fast_step, generation_kernels, weight_copies_for_steps
    from linformer_lab.models.pixel_transformer import PixelTransformer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = PixelTransformer("linear", n_layers=8, n_heads=8, d_model=256, d_ff=1024, num_mixtures=10).to(device).eval()
    prefix = torch.randint(0, 256, (batch, 1, 14, 28), dtype=torch.uint8).to(device)
    known = 14 * 28
    sequence = model.to_sequence(torch.cat([prefix, prefix], dim=2))

    @torch.inference_mode()
    def prefix_parallel():
        # as generate(prefill=True) runs it: with the process's threads, before the steps
        model.transformer(model.embed(sequence[:, :known]), return_state=True)

    @torch.inference_mode()
    def prefix_stepped():
        # as generate(prefill=False) steps: its fast step, kernels and transposed weight copies
        with generation_kernels(sequence.device, batch, True), weight_copies_for_steps(model.transformer, "model"):
            inputs, state = model.embed(sequence[:, :known]), None  # the step inputs, made in one go
            for position in range(known):
                _, state = fast_step(model.transformer, inputs[:, position], state)

    def whole(prefill):
        return lambda: model.generate(batch, 1.0, prefix=prefix, prefill=prefill,
                                      generator=torch.Generator(device=device).manual_seed(0))

    parts = interleaved_medians({"prefix: parallel": prefix_parallel, "prefix: stepped": prefix_stepped}, repeats,
                                device=device)
    wholes = interleaved_medians({"whole: prefill": whole(True), "whole: stepped": whole(False)}, repeats, device=device)
    t = {k: v["median"] for k, v in {**parts, **wholes}.items()}
    # Roofline: stepping and the parallel pass do the same matmul work (linear attention is O(N)
    # either way), so no prefill can beat that work at this device's best GEMM rate.
    gflop = batch * known * matmul_flops_per_position(model) / 1e9
    floor_s = gflop / peak_gemm_gflops(model, batch * known, device)
    after_prefix_s = t["whole: prefill"] - t["prefix: parallel"]  # the 392 sampled steps
    return [
        {"part": "completion", "device": device, "batch": batch, "what": "prefix (392 positions)",
         "stepped_s": t["prefix: stepped"], "prefill_s": t["prefix: parallel"],
         "speedup": t["prefix: stepped"] / t["prefix: parallel"],
         "gflop": gflop, "floor_s": floor_s, "speedup_bound": t["prefix: stepped"] / floor_s},
        {"part": "completion", "device": device, "batch": batch, "what": "whole completion (784 positions)",
         "stepped_s": t["whole: stepped"], "prefill_s": t["whole: prefill"],
         "speedup": t["whole: stepped"] / t["whole: prefill"],
         "gflop": 2 * gflop, "floor_s": floor_s + after_prefix_s,
         "speedup_bound": t["whole: stepped"] / (floor_s + after_prefix_s)},
    ]


def matmul_flops_per_position(model) -> int:
    """Multiply-adds x 2 of every linear layer for one position (the attention's own state
    updates, 2 x 2 x C x M per head, add well under 1 % for the paper model and are left out,
    so the floor below is a lower bound)."""
    import torch

    return sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))


def peak_gemm_gflops(model, rows: int, device: str) -> float:
    """The best rate of the model's own linear-layer shapes at ``rows`` positions,
    ``(rows, in) x (in, out)`` for each distinct (in, out), best of 5 calls each after 2 warm-ups."""
    import torch

    best = 0.0
    for inner, outer in sorted({(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}):
        x, w = torch.randn(rows, inner, device=device), torch.randn(inner, outer, device=device)
        for _ in range(2):
            x @ w
        timer = Timer(device)
        seconds = min(timer(lambda: x @ w) for _ in range(5))
        best = max(best, 2 * rows * inner * outer / seconds / 1e9)
    return best


# ------------------------------------------------------------------ 2. segments


def segment_step(n: int, segment: int | None, d_model: int, layers: int, threads: int) -> dict:
    """One forward + backward of a causal linear LM over n tokens (run in a child process)."""
    import torch
    from torch import nn

    from linformer_lab.attention.config import AttentionConfig
    from linformer_lab.models.transformer import Transformer, segmented_forward

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    vocab = 256
    embed, head = nn.Embedding(vocab, d_model), nn.Linear(d_model, vocab)
    model = Transformer(layers, d_model, d_model // 32, attention=AttentionConfig("linear"), causal=True)
    tokens = torch.randint(0, vocab, (1, n + 1))

    def run(start, stop, state):
        hidden, state = model(embed(tokens[:, start:stop]), state=state, return_state=True)
        loss = nn.functional.cross_entropy(head(hidden).flatten(0, 1), tokens[0, start + 1 : stop + 1], reduction="sum")
        return loss, state

    def step(length=n):
        if segment is None:
            loss, _ = run(0, length, None)
        else:
            loss = sum(segmented_forward(run, length, min(segment, length)))
        (loss / length).backward()

    # Warm-up at a tiny length: code pages and thread pools are not the cost of this N, and a
    # full-size warm-up would leave its memory in the allocator's free lists (no RSS increase then)
    step(256)
    memory = peak_rss_increase(step)
    start = time.perf_counter()
    step()  # timed on a second call: the first one also paid the page faults of fresh memory
    return {"peak_mb": memory["peak_increase"] / 2**20, "seconds": time.perf_counter() - start}


def segments(args) -> list[dict]:
    rows = []
    for segment in (None, args.segment):
        kwargs = dict(n=args.n, segment=segment, d_model=args.d_model, layers=args.layers, threads=args.threads)
        # Memory with a fixed mmap threshold: glibc otherwise raises the threshold as memory is
        # freed, serves the next segment's tensors from the heap and keeps freed pages resident,
        # so RSS would count memory no tensor holds any more. Time with the default allocator
        # (the fixed threshold makes every large allocation fault its pages in anew).
        status, memory = run_in_child(segment_step, kwargs, timeout_s=1800, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
        status_t, timing = run_in_child(segment_step, kwargs, timeout_s=1800)
        if status != "ok" or status_t != "ok":
            print(f"segments {segment}: {status} {memory} / {status_t} {timing}", flush=True)
            continue
        what = f"N = {args.n}, " + ("one segment" if segment is None else f"segments of {segment}")
        rows.append({"part": "segments", "what": what,
                     "segment": segment or args.n, "peak_mb": memory["peak_mb"], "seconds": timing["seconds"],
                     "us_per_token": 1e6 * timing["seconds"] / args.n})
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------ 3. speech


def speech(args) -> list[dict]:
    import torch
    import yaml

    from linformer_lab.data.speech import SpeechDataModule

    torch.set_num_threads(args.threads)
    rows = []
    config = yaml.safe_load((REPO / "configs" / "speech_cpu_linear.yaml").read_text())
    data = config["data"]["init_args"]
    dm = SpeechDataModule(hours=data["hours"], seed=data["seed"], batch_size=data["batch_size"], progress=False)
    dm.setup()
    from linformer_lab.data.speech import collate_speech

    bucketed = list(dm.train_dataloader())[: args.speech_batches]
    # the same number of batches of utterances drawn at random, without length bucketing:
    # what a data path without bucketing pads
    order = torch.randperm(len(dm.datasets["train"]), generator=torch.Generator().manual_seed(0)).tolist()
    size = data["batch_size"]
    unbucketed = [collate_speech([dm.datasets["train"][j] for j in order[i * size : (i + 1) * size]])
                  for i in range(len(bucketed))]
    for label, batches in (("length-bucketed batches (the data path)", bucketed), ("random batches", unbucketed)):
        rows += _speech_rows(args, batches, label)
    return rows


def _speech_rows(args, batches, label) -> list[dict]:
    import torch
    import yaml

    from linformer_lab.attention.config import AttentionConfig
    from linformer_lab.tasks.speech import SpeechRecognitionTask

    rows = []
    real = sum(int(b["feature_lengths"].sum()) for b in batches)
    computed = sum(b["features"].shape[0] * b["features"].shape[1] for b in batches)
    for backend in ("linear", "softmax"):
        kwargs = dict(yaml.safe_load((REPO / "configs" / f"speech_cpu_{backend}.yaml").read_text())["model"]["init_args"])
        kwargs["attention"] = AttentionConfig(**kwargs["attention"])
        models = {}
        for packed in (False, True):
            torch.manual_seed(0)
            models[packed] = SpeechRecognitionTask(**kwargs, packed=packed)
        optimizers = {k: torch.optim.Adam(m.parameters(), lr=1e-4) for k, m in models.items()}
        totals = {False: 0.0, True: 0.0}
        for i, batch in enumerate(batches):
            for packed in ((False, True) if i % 2 == 0 else (True, False)):
                start = time.process_time()
                loss = models[packed].ctc_loss(batch)[0]
                optimizers[packed].zero_grad()
                loss.backward()
                optimizers[packed].step()
                totals[packed] += time.process_time() - start
        what = f"{backend}, {label}: {len(batches)} batches, padding {100 * (1 - real / computed):.1f}% of frames"
        rows.append({"part": "speech", "what": what,
                     "padded_cpu_s": totals[False], "packed_cpu_s": totals[True], "speedup": totals[False] / totals[True]})
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["completion", "segments", "speech"]
    p.add_argument("--parts", nargs="+", default=parts, choices=parts)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64], help="completion batch sizes")
    p.add_argument("--device", default="cpu", help="device of the completion part (cuda on a GPU node)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=2**16, help="tokens of the segmented training step")
    p.add_argument("--segment", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--speech-batches", type=int, default=60, help="training batches timed per model (0 = a whole epoch)")
    p.add_argument("--out", default=str(results_dir(__file__) / "state_benchmarks"))
    args = p.parse_args()
    if args.speech_batches == 0:
        args.speech_batches = None
    rows: list[dict] = []
    if "segments" in args.parts:
        # first: its peak-RSS figures came out 8x higher (~900 MB) when the children were started
        # after the completion part than when they ran first (~120 MB), cause not found
        rows += segments(args)
    if "completion" in args.parts:
        for batch in args.batches:
            rows += completion(batch, args.repeats, args.threads, args.device)
            print(rows[-2:], flush=True)
    if "speech" in args.parts:
        rows += speech(args)
    info = machine_info()
    import torch

    out = Path(args.out)
    write_csv(str(out.with_suffix(".csv")), rows)
    lines = [
        "# State in and out of the parallel form: prefill, segments, packed speech", "",
        "Reading: benchmarks/NOTES.md (\"Prefill the known prefix in one pass?\", \"Segments and packed speech batches?\").", "",
        f"`benchmarks/dev/state_benchmarks.py --parts {' '.join(args.parts)}` ({time.strftime('%Y-%m-%d')}); {info['cpu']}, "
        f"{os.cpu_count()} cores, {args.threads} torch threads, torch {torch.__version__}.", "",
    ]
    sections = [  # (part, title, header, cells of a row)
        ("completion", f"MNIST completion of the bottom half (paper model, linear, untrained weights, {args.device})",
         ["batch", "what", "stepped s", "prefill s", "speedup", "GFLOP", "floor s", "speedup bound"],
         lambda r: [r["batch"], r["what"], f"{r['stepped_s']:.3f}", f"{r['prefill_s']:.3f}", f"{r['speedup']:.2f}x",
                    f"{r['gflop']:.1f}", f"{r['floor_s']:.3f}", f"{r['speedup_bound']:.2f}x"]),
        ("segments",
         f"One training step at N = {args.n}, causal linear LM ({args.layers} layers, d_model {args.d_model}, batch 1)",
         ["what", "peak RSS increase MB", "s", "us / token"],
         lambda r: [r["what"], f"{r['peak_mb']:.0f}", f"{r['seconds']:.1f}", f"{r['us_per_token']:.1f}"]),
        ("speech", "Speech training steps, padded vs packed (CPU recipe, process CPU time)",
         ["what", "padded CPU s", "packed CPU s", "padded / packed"],
         lambda r: [r["what"], f"{r['padded_cpu_s']:.1f}", f"{r['packed_cpu_s']:.1f}", f"{r['speedup']:.2f}"]),
    ]
    for part, title, header, cells in sections:
        picked = [r for r in rows if r["part"] == part]
        if picked:
            lines += [f"## {title}", "", markdown_table(header, [cells(r) for r in picked]), ""]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
