"""What context parallelism costs and saves on CPU: one sequence of T tokens split over P gloo
processes (``ll.context_parallel``), a training step (forward + backward) of a causal linear
Transformer, against T for P = 1, 2, 4.

    uv run python benchmarks/dev/context_parallel.py                        # T = 4K, 16K, 64K
    uv run python benchmarks/dev/context_parallel.py --lengths 1024 --processes 1 2 --repeats 1
    uv run python benchmarks/dev/context_parallel.py --lengths 1048576 --processes 1 4 --repeats 1 --name context_parallel_1m

Per (P, T), every process measures its own step: the bytes it hands to collectives per layer
(forward and backward; ``torch.distributed.all_gather`` / ``all_reduce`` counted by wrapping them:
the tensors each rank sends), the rise of its RSS peak over one step after a warm-up one
(``common.peak_rss_increase``: anonymous memory, the activations; glibc's mmap threshold fixed so
that freed activations go back to the system), and the median step time. The table shows the largest over
the ranks. P = 1 runs the same model without a process group: the one-process baseline.
On a machine with fewer cores than P the processes share cores, so the time is not a speed-up
measure there; the bytes and the memory are.

Results: ``benchmarks/dev/results/context_parallel.{csv,md}`` (``--name``: another file name).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402


def count_collectives(dist, sent: list[int]) -> None:
    """Wrap ``dist.all_gather`` and ``dist.all_reduce`` so that each adds the bytes this rank sends
    to ``sent`` (the library calls them through the module, so the wrappers see every call)."""
    gather, reduce = dist.all_gather, dist.all_reduce

    def all_gather(outputs, tensor, *args, **kwargs):
        sent.append(tensor.nbytes)
        return gather(outputs, tensor, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.nbytes)
        return reduce(tensor, *args, **kwargs)

    dist.all_gather, dist.all_reduce = all_gather, all_reduce


def worker(rank: int, size: int, args: dict, store: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import linformer_lab as ll

    torch.set_num_threads(args["threads"])
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    sent: list[int] = []
    count_collectives(dist, sent)
    torch.manual_seed(0)
    model = ll.Transformer(args["layers"], args["d_model"], args["heads"])
    if size > 1:
        ll.context_parallel(model)
    length = args["length"] // size
    x = torch.randn(args["batch"], length, args["d_model"])

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    step()  # warm-up: kernels built, allocator primed
    if size > 1:
        dist.barrier()
    sent.clear()
    memory = common.peak_rss_increase(step)
    bytes_per_layer = sum(sent) / args["layers"]
    if size > 1:
        dist.barrier()
    seconds = common.median_seconds(step, args["repeats"], warmup=0)
    result = {"rank": rank, "bytes_per_layer": bytes_per_layer, "peak_mib": memory["peak_increase"] / common.MIB,
              "seconds": seconds}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if size > 1:
        dist.destroy_process_group()


def measure(processes: int, length: int, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    settings = {"length": length, "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                "batch": args.batch, "threads": args.threads, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(processes, settings, str(Path(tmp) / "store"), tmp), nprocs=processes, join=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(processes)]
    return {"P": processes, "T": length, "tokens_per_process": length // processes,
            "bytes_per_layer": max(r["bytes_per_layer"] for r in ranks),
            "peak_mib": round(max(r["peak_mib"] for r in ranks), 1),
            "step_s": round(max(r["seconds"] for r in ranks), 4)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536], help="whole sequence lengths T")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="process counts P (each divides T)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=1, help="heads (per-head C = M = d_model / heads)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument("--out", default=str(common.results_dir(__file__)), help="folder of NAME.{csv,md}")
    p.add_argument("--name", default="context_parallel", help="file name of the results (without suffix)")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    bad = [(p, t) for p in args.processes for t in args.lengths if t % p]
    if bad:
        raise SystemExit(f"context_parallel.py: every T must divide by every P; got {bad} (P, T)")
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed and then keeps the
    # next step's activations in its heap, which hides them from the RSS peak of later steps.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned processes
    rows = []
    for length in args.lengths:
        for processes in args.processes:
            rows.append(measure(processes, length, args))
            print(rows[-1], flush=True)
    header = ["P", "T", "tokens/process", "bytes sent per layer per step", "peak RSS rise per process (MiB)",
              "step (s)"]
    table = common.markdown_table(header, [[r["P"], r["T"], r["tokens_per_process"], int(r["bytes_per_layer"]),
                                            r["peak_mib"], r["step_s"]] for r in rows])
    info = common.machine_info()
    lines = ["# Context parallelism on CPU: one sequence over P gloo processes", "",
             f"- command: `{common.command_line('benchmarks/dev/context_parallel.py', argv)}`",
             f"- machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, {info['mem_gib']} GiB; "
             f"{common.load_line()}",
             f"- date: {datetime.date.today().isoformat()}, commit {common.git_commit()}",
             f"- model: ll.Transformer({args.layers} layer, d_model {args.d_model}, {args.heads} head), causal linear "
             f"attention (elu), float32, batch {args.batch}, {args.threads} torch thread(s) per process", "",
             table, ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.write_csv(str(out / f"{args.name}.csv"), rows)
    (out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
