"""Causal linear attention on CPU against N (§3.3, eq. 13-15: gradients in constant memory): the
causal ``linear`` backend beside ``softmax`` (both built with ``linformer_lab.build_attention``),
forward+backward time and peak-RSS increase for N = 2^9 ... 2^16, B=1, H=8, D=M=32, each
configuration's memory measured in its own spawned child process.

    uv run python benchmarks/paper/causal_linear_cpu.py [--quick]

The numerator's C++ kernel against fast-transformers' is ``benchmarks/dev/causal_cpu_grid.py``.
Results: ``benchmarks/paper/results/causal_linear_cpu.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path
import common  # noqa: E402

RESULTS = str(common.results_dir(__file__))
#: before a memory measurement, one fwd+bwd at this N loads code pages and starts thread
#: pools (~40 MB of RSS on the first call of any size), which are not the cost of the N measured
WARMUP_N = 256


# ---------------------------------------------------------------- child processes
def _setup_torch(threads: int):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)
    return torch


def _layer_case(torch, method: str, b: int, h: int, n: int, d: int, m: int):
    """A zero-argument fwd+bwd closure for an attention backend built by name."""
    import linformer_lab as ll

    attn = ll.build_attention(method, causal=True, query_dim=d)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, x, generator=gen).requires_grad_() for x in (d, d, m))
    grad = torch.randn(b, h, n, m, generator=gen)

    def step():
        q.grad = k.grad = v.grad = None
        attn(q, k, v).backward(grad)

    return step


def child_layer_memory(method, b, h, n, d, m, threads, cap_bytes):
    """One fwd+bwd of one backend; peak RSS increase over the RSS after setup."""
    common.limit_data_segment(cap_bytes)
    torch = _setup_torch(threads)
    _layer_case(torch, method, 1, h, WARMUP_N, d, m)()  # code pages, thread pools: not this N's cost
    step = _layer_case(torch, method, b, h, n, d, m)
    t0 = time.perf_counter()
    mem = common.peak_rss_increase(step)
    mem["first_call_s"] = time.perf_counter() - t0
    return mem


def child_layer_times(methods, b, h, n, d, m, threads, repeats, budget_s):
    """Median fwd+bwd time of several backends, interleaved A, B, A, B, ..."""
    torch = _setup_torch(threads)
    cases = {meth: _layer_case(torch, meth, b, h, n, d, m) for meth in methods}
    res = common.interleaved_medians(cases, repeats=repeats, warmup=1, budget_s=budget_s)
    return {"times": res, "loadavg": os.getloadavg(), **common.torch_info()}


# ---------------------------------------------------------------- driver
def run_scaling(args, log) -> list[dict]:
    rows = []
    b, h, d, m = 1, 8, 32, 32
    active = {"linear": True, "softmax": True}
    for n in args.lengths:
        first_call = {}
        for method in active:
            if not active[method]:
                rows.append(dict(part="scaling", method=method, B=b, H=h, N=n, D=d, M=m, status="skipped"))
                continue
            kwargs = dict(method=method, b=b, h=h, n=n, d=d, m=m, threads=args.threads, cap_bytes=int(args.mem_cap_gb * 1024**3))
            status, res = common.run_in_child(child_layer_memory, kwargs, timeout_s=args.time_cap * 4 + 60,
                                              env=common.FIXED_MALLOC)
            row = dict(part="scaling", method=method, B=b, H=h, N=n, D=d, M=m, status=status)
            if status == "ok":
                row.update(peak_rss_increase_mb=res["peak_increase"] / common.MIB, rss_before_mb=res["rss_before"] / common.MIB,
                           first_call_s=res["first_call_s"], hwm_reset=res["hwm_reset"])
                if method == "linear":  # the same with glibc's default (adaptive) malloc settings
                    s2, r2 = common.run_in_child(child_layer_memory, kwargs, timeout_s=args.time_cap * 4 + 60)
                    row["peak_rss_increase_default_malloc_mb"] = r2["peak_increase"] / common.MIB if s2 == "ok" else None
                first_call[method] = res["first_call_s"]
                if res["first_call_s"] > args.time_cap:
                    # too slow to repeat: report the one (cold) call, stop this method here
                    row.update(time_ms=res["first_call_s"] * 1e3, time_min_ms=res["first_call_s"] * 1e3, repeats=1,
                               loadavg_1m=round(os.getloadavg()[0], 2))
                    active[method] = False
            else:
                active[method] = False
                row["error"] = str(res)[:200]
            rows.append(row)
            log(f"N={n} {method}: {status} {row.get('peak_rss_increase_mb', float('nan')):.1f} MB")
        timed = [meth for meth, t in first_call.items() if t <= args.time_cap]
        if timed:
            status, res = common.run_in_child(
                child_layer_times, dict(methods=timed, b=b, h=h, n=n, d=d, m=m, threads=args.threads,
                                        repeats=args.repeats, budget_s=args.time_budget),
                timeout_s=args.time_cap * (args.repeats + 2) * len(timed) + 60,
            )
            for row in rows:
                if row["part"] == "scaling" and row["N"] == n and row["method"] in timed:
                    if status == "ok":
                        t = res["times"][row["method"]]
                        row.update(time_ms=t["median"] * 1e3, time_min_ms=t["min"] * 1e3, repeats=len(t["samples"]),
                                   loadavg_1m=round(res["loadavg"][0], 2), torch=res["torch"])
                    else:
                        row["time_error"] = f"{status}: {str(res)[:200]}"
            times = " ".join(f"{k}={v['median']*1e3:.1f}ms" for k, v in res["times"].items()) if status == "ok" else ""
            log(f"N={n} times: {status} " + times)
        # a method that did not run for this N stops here (the rest is marked "—")
        for method in active:
            if method not in first_call:
                active[method] = False
    return rows


def project_torch_version() -> str | None:
    """The torch version of the project's own venv (uv), when it is beside this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for sp in (os.path.join(root, ".venv", "lib"),):
        if os.path.isdir(sp):
            for py in os.listdir(sp):
                site = os.path.join(sp, py, "site-packages")
                for entry in os.listdir(site) if os.path.isdir(site) else []:
                    if entry.startswith("torch-") and entry.endswith(".dist-info"):
                        return entry[len("torch-"):-len(".dist-info")]
    return None


def write_report(args, rows, env, path_md):
    lines = ["# Causal linear attention on CPU", ""]
    lines += [f"- machine: {env['cpu']}, {env['logical_cpus']} logical CPUs, {env['mem_gib']} GiB; kernel {env['kernel']}",
              f"- torch (this run): {env.get('torch')}, threads: {args.threads}; project venv torch: {env.get('project_torch')}",
              f"- {env['load_start']} at start, {env['load_end']} at end; "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
              f"- times: median of up to {args.repeats} fwd+bwd calls after one "
              "warm-up, methods interleaved in one process; memory: peak RSS increase of one fwd+bwd in a fresh child process "
              f"per configuration, after one warm-up call at N={WARMUP_N}",
              ""]
    scaling = [r for r in rows if r["part"] == "scaling"]
    if scaling:
        lines += ["## Scaling (B=1, H=8, D=M=32, causal, fwd+bwd)", ""]
        table = []
        lin_mem, lin_mem_default = {}, {}
        for n in args.lengths:
            cells = [f"2^{n.bit_length() - 1} = {n}"]
            for method in ("linear", "softmax"):
                r = next((r for r in scaling if r["N"] == n and r["method"] == method), None)
                ok = r is not None and r.get("status") == "ok"
                cells += [common.fmt(r.get("time_ms") if ok else None), common.fmt(r.get("time_min_ms") if ok else None),
                          common.fmt(r.get("peak_rss_increase_mb") if ok else None)]
                if method == "linear":
                    cells.append(common.fmt(r.get("peak_rss_increase_default_malloc_mb") if ok else None))
                if method == "linear" and ok:
                    lin_mem[n] = r["peak_rss_increase_mb"]
                    if r.get("peak_rss_increase_default_malloc_mb"):
                        lin_mem_default[n] = r["peak_rss_increase_default_malloc_mb"]
            load = next((r.get("loadavg_1m") for r in scaling if r["N"] == n and r.get("loadavg_1m") is not None), None)
            cells.append(common.fmt(load, 2))
            table.append(cells)
        lines.append(common.markdown_table(["N", "linear ms", "linear min ms", "linear MB", "linear MB (default malloc)",
                                            "softmax ms", "softmax min ms", "softmax MB", "load 1m"], table))
        lines += ["", "ms = median fwd+bwd (min beside it). MB = peak RSS increase of one fwd+bwd over the RSS after "
                  "building the inputs (inputs excluded; grads, activations and temporaries included), measured with glibc's "
                  "mmap threshold fixed at 128 KiB (reproducible to < 1 %); 'default malloc' = the same with glibc's adaptive "
                  "defaults (what a plain process gets; varies ±20 % between runs). — = not run (a smaller N was over the "
                  "time cap or memory cap); a time with min = median is a single cold call over the time cap.", ""]
        for label, mem in (("", lin_mem), (" (default malloc)", lin_mem_default)):
            ratios = [(n, mem[n] / mem[n // 2]) for n in sorted(mem) if n // 2 in mem and mem[n // 2] > 0]
            if ratios:
                worst = max(r for _, r in ratios)
                lines.append(f"- linear{label}: memory ratio when N doubles: "
                             + ", ".join(f"{n // 2}→{n}: {r:.2f}×" for n, r in ratios)
                             + f"; target ≤ 2.1×: worst {worst:.2f}× → {'met' if worst <= 2.1 else 'not met'}")
            if 32768 in mem:
                mb = mem[32768]
                lines.append(f"- linear{label}: target < 600 MB added at N=32768: {mb:.0f} MB → "
                             f"{'met' if mb < 600 else 'not met'} ({mb / 600:.2f}× of the limit)")
        lines.append("")
    with open(path_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="timed fwd+bwd calls per method (scaling)")
    p.add_argument("--min-log2n", type=int, default=9)
    p.add_argument("--max-log2n", type=int, default=16)
    p.add_argument("--time-cap", type=float, default=20.0, help="s; a method whose one fwd+bwd took longer stops there")
    p.add_argument("--time-budget", type=float, default=20.0, help="s of timing per configuration before stopping early")
    p.add_argument("--mem-cap-gb", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="smoke run: N up to 2^11, 3 repeats")
    common.add_omp_wait_policy_argument(p)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    common.apply_omp_wait_policy(args.omp_wait_policy)
    if args.quick:
        args.max_log2n, args.repeats, args.time_budget = min(args.max_log2n, 11), 3, 5.0
    args.lengths = [2**i for i in range(args.min_log2n, args.max_log2n + 1)]
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg} ({common.load_line()})", flush=True)

    env = common.machine_info()
    env["load_start"] = common.load_line()
    env["project_torch"] = project_torch_version()
    rows = run_scaling(args, log)
    env["torch"] = next((r["torch"] for r in rows if r.get("torch")), None)  # as the children saw it
    env["load_end"] = common.load_line()
    suffix = ("_quick" if args.quick else "") + args.tag
    common.write_csv(os.path.join(args.out, f"causal_linear_cpu{suffix}.csv"), rows)
    print(write_report(args, rows, env, os.path.join(args.out, f"causal_linear_cpu{suffix}.md")))


if __name__ == "__main__":
    main()
