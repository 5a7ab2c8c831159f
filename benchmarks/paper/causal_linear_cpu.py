"""Causal linear attention on CPU: scaling with N, head-to-head with fast-transformers, and
the chunk size of ``CausalDotProduct``.

Three parts (each configuration's memory is measured in its own spawned child process):

1. scaling: the causal ``linear`` backend beside ``softmax`` (both built with
   ``linformer_lab.build_attention``), forward+backward time and peak-RSS increase for
   N = 2^9 ... 2^16, B=1, H=8, D=M=32;
2. head-to-head: the numerator only, ``linformer_lab.ops.linear_attention.causal_dot_product``
   against fast-transformers' ``causal_dot_product`` (C++/OpenMP CPU kernel), fp32,
   forward+backward, at B=4,H=8,N=4096,D=M=64 and B=1,H=8,N=16384,D=M=32;
3. chunk sizes: our Function with chunk_size 32, 64, 128, 256 at the same two shapes,
   timed in the same interleaved loop as part 2.

Part 2 needs ``fast_transformers`` importable; it lives in a separate venv, never in the
project's dependencies (see benchmarks/README.md, "fast-transformers baseline venv")::

    PYTHONPATH=. .bench_env/bin/python benchmarks/paper/causal_linear_cpu.py

Without it, parts 1 and 3 still run (``uv run python benchmarks/paper/causal_linear_cpu.py``).
Results: ``benchmarks/paper/results/causal_linear_cpu.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
H2H_SHAPES = [(4, 8, 4096, 64, 64), (1, 8, 16384, 32, 32)]  # (B, H, N, D, M)
CHUNKS = [32, 64, 128, 256]
#: fast-transformers' kernel, 2 threads, fwd+bwd, measured earlier on this machine (ms)
#: before a memory measurement, one fwd+bwd at this N loads code pages and starts thread
#: pools (~40 MB of RSS on the first call of any size), which are not the cost of the N measured
WARMUP_N = 256
FT_PREVIOUS_MS = {H2H_SHAPES[0]: 315.0, H2H_SHAPES[1]: 80.0}


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


def _numerator_impls(torch, chunks):
    """name -> callable(q, k, v) for the numerator of eq. 9."""
    from linformer_lab.ops.linear_attention import causal_dot_product as ours

    impls = {}
    try:
        from fast_transformers.causal_product import causal_dot_product as ft

        impls["fast_transformers"] = ft
    except ImportError:
        pass
    impls["ours_default"] = ours
    for c in chunks:
        impls[f"ours_chunk{c}"] = lambda q, k, v, c=c: ours(q, k, v, c)
    return impls


def _numerator_inputs(torch, b, h, n, d, m):
    gen = torch.Generator().manual_seed(0)
    # feature-mapped (elu + 1, positive) queries and keys, as the numerator sees them
    q = (torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen)) + 1).requires_grad_()
    k = (torch.nn.functional.elu(torch.randn(b, h, n, d, generator=gen)) + 1).requires_grad_()
    v = torch.randn(b, h, n, m, generator=gen).requires_grad_()
    grad = torch.randn(b, h, n, m, generator=gen)
    return q, k, v, grad


def child_numerator_memory(impl, b, h, n, d, m, threads):
    torch = _setup_torch(threads)
    fn = _numerator_impls(torch, CHUNKS)[impl]
    q, k, v, grad = _numerator_inputs(torch, 1, h, WARMUP_N, d, m)
    fn(q, k, v).backward(grad)  # warm-up at a small N: code pages, thread pools
    q, k, v, grad = _numerator_inputs(torch, b, h, n, d, m)
    return common.peak_rss_increase(lambda: fn(q, k, v).backward(grad))


def child_head_to_head(shape, threads, repeats, chunks, budget_s):
    """fwd+bwd and fwd-only times of every numerator implementation, interleaved, plus the
    largest deviation of ours from fast-transformers (a correctness check)."""
    torch = _setup_torch(threads)
    b, h, n, d, m = shape
    impls = _numerator_impls(torch, chunks)
    q, k, v, grad = _numerator_inputs(torch, b, h, n, d, m)

    def fwd_bwd(fn):
        return common.forward_backward(lambda: fn(q, k, v), (q, k, v), grad)

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    out = {"loadavg_before": os.getloadavg(), **common.torch_info()}
    out["fwd_bwd"] = common.interleaved_medians({k_: fwd_bwd(f) for k_, f in impls.items()}, repeats, 1, budget_s)
    out["fwd"] = common.interleaved_medians({k_: fwd(f) for k_, f in impls.items()}, repeats, 1, budget_s / 3)
    out["loadavg_after"] = os.getloadavg()
    if "fast_transformers" in impls:
        reference = {}
        for name in ("fast_transformers", "ours_default"):
            q.grad = k.grad = v.grad = None
            o = impls[name](q, k, v)
            o.backward(grad)
            reference[name] = [o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
        out["max_rel_err"] = max(
            float((a - r).abs().max() / r.abs().max())
            for a, r in zip(reference["ours_default"], reference["fast_transformers"])
        )
    from linformer_lab.ops.linear_attention import default_chunk_size

    out["default_chunk"] = default_chunk_size(d, m)
    try:
        from importlib.metadata import version

        import fast_transformers  # noqa: F401

        out["fast_transformers"] = version("pytorch-fast-transformers")
    except Exception:
        out["fast_transformers"] = None
    return out


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


def run_head_to_head(args, log) -> list[dict]:
    rows = []
    for shape in H2H_SHAPES:
        b, h, n, d, m = shape
        status, res = common.run_in_child(
            child_head_to_head, dict(shape=shape, threads=args.threads, repeats=args.h2h_repeats, chunks=CHUNKS,
                                     budget_s=args.time_budget * 3),
            timeout_s=900,
        )
        if status != "ok":
            log(f"head-to-head {shape}: {status} {res}")
            continue
        mems = {}
        for impl in res["fwd_bwd"]:
            s, mres = common.run_in_child(child_numerator_memory, dict(impl=impl, b=b, h=h, n=n, d=d, m=m, threads=args.threads),
                                          600, env=common.FIXED_MALLOC)
            mems[impl] = mres["peak_increase"] / common.MIB if s == "ok" else None
        for impl, t in res["fwd_bwd"].items():
            chunk = (res["default_chunk"] if impl == "ours_default"
                     else int(impl[len("ours_chunk"):]) if impl.startswith("ours_chunk") else None)
            rows.append(dict(
                part="head_to_head", method=impl, B=b, H=h, N=n, D=d, M=m, chunk=chunk, status="ok",
                time_ms=t["median"] * 1e3, time_min_ms=t["min"] * 1e3, repeats=len(t["samples"]),
                fwd_ms=res["fwd"][impl]["median"] * 1e3,
                peak_rss_increase_mb=mems.get(impl),
                loadavg_1m=round(res["loadavg_before"][0], 2), loadavg_1m_after=round(res["loadavg_after"][0], 2),
                torch=res["torch"], fast_transformers=res["fast_transformers"], max_rel_err_vs_ft=res.get("max_rel_err"),
            ))
        log(f"head-to-head {shape}: " + " ".join(f"{k}={v['median']*1e3:.1f}ms" for k, v in res["fwd_bwd"].items()))
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
              f"- torch (this run): {env.get('torch')}, threads: {args.threads}; project venv torch: {env.get('project_torch')}; "
              f"fast-transformers: {env.get('fast_transformers')}",
              f"- {env['load_start']} at start, {env['load_end']} at end; "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
              f"- times: median of up to {args.repeats} (scaling) / {args.h2h_repeats} (head-to-head) fwd+bwd calls after one "
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
    h2h = [r for r in rows if r["part"] == "head_to_head"]
    if h2h:
        lines += [f"## Numerator head-to-head vs fast-transformers (fp32, {args.threads} threads, fwd+bwd)", ""]
        table = []
        for r in h2h:
            ft = next((x for x in h2h if x["method"] == "fast_transformers" and x["N"] == r["N"] and x["B"] == r["B"]), None)
            speed = ft["time_ms"] / r["time_ms"] if ft else None
            table.append([f"B={r['B']} H={r['H']} N={r['N']} D=M={r['D']}", r["method"], common.fmt(r["time_ms"]),
                          common.fmt(r["time_min_ms"]), common.fmt(r["fwd_ms"]), common.fmt(r.get("peak_rss_increase_mb")),
                          common.fmt(speed, 2), common.fmt(r["loadavg_1m"], 2)])
        lines.append(common.markdown_table(["shape", "implementation", "fwd+bwd ms (median)", "min ms", "fwd ms", "peak MB",
                                            "speed-up vs FT", "load 1m"], table))
        lines.append("")
        for shape, need, kind in ((H2H_SHAPES[0], 1.5, "≥ 1.5× faster"), (H2H_SHAPES[1], 1 / 1.5, "within 1.5×")):
            b, h, n, d, m = shape
            ft = next((x for x in h2h if x["method"] == "fast_transformers" and x["N"] == n and x["B"] == b), None)
            ours = next((x for x in h2h if x["method"] == "ours_default" and x["N"] == n and x["B"] == b), None)
            if ft and ours:
                sp = ft["time_ms"] / ours["time_ms"]
                lines.append(f"- B={b} N={n} D=M={d}: ours {ours['time_ms']:.1f} ms vs FT {ft['time_ms']:.1f} ms "
                             f"(FT earlier: {FT_PREVIOUS_MS[shape]:.0f} ms) → speed-up {sp:.2f}×, target {kind} → "
                             f"{'met' if sp >= need else 'not met'}; max rel. deviation from FT {ours['max_rel_err_vs_ft']:.1e}")
            chunks = [x for x in h2h if x["N"] == n and x["B"] == b and x["method"].startswith("ours_chunk")]
            if chunks:
                best = min(chunks, key=lambda x: x["time_ms"])
                lines.append(f"  - best chunk_size: {best['chunk']} ({best['time_ms']:.1f} ms); default "
                             f"{ours['chunk'] if ours else '?'}: "
                             + ", ".join(f"{x['chunk']}: {x['time_ms']:.1f}" for x in chunks))
        lines.append("")
    with open(path_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="timed fwd+bwd calls per method (scaling)")
    p.add_argument("--h2h-repeats", type=int, default=11, help="timed fwd+bwd calls per implementation (head-to-head)")
    p.add_argument("--min-log2n", type=int, default=9)
    p.add_argument("--max-log2n", type=int, default=16)
    p.add_argument("--time-cap", type=float, default=20.0, help="s; a method whose one fwd+bwd took longer stops there")
    p.add_argument("--time-budget", type=float, default=20.0, help="s of timing per configuration before stopping early")
    p.add_argument("--mem-cap-gb", type=float, default=8.0)
    p.add_argument("--parts", default="scaling,h2h")
    p.add_argument("--quick", action="store_true", help="smoke run: N up to 2^11, 3 repeats, short head-to-head")
    common.add_omp_wait_policy_argument(p)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    common.apply_omp_wait_policy(args.omp_wait_policy)
    if args.quick:
        args.max_log2n, args.repeats, args.h2h_repeats, args.time_budget = min(args.max_log2n, 11), 3, 3, 5.0
    args.lengths = [2**i for i in range(args.min_log2n, args.max_log2n + 1)]
    parts = set(args.parts.split(","))
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg} ({common.load_line()})", flush=True)

    env = common.machine_info()
    env["load_start"] = common.load_line()
    env["project_torch"] = project_torch_version()
    rows = []
    if "scaling" in parts:
        rows += run_scaling(args, log)
    if "h2h" in parts:
        rows += run_head_to_head(args, log)
    env["load_end"] = common.load_line()
    status, info = common.run_in_child(_versions, {}, 120)
    env.update(info if status == "ok" else {})
    suffix = ("_quick" if args.quick else "") + args.tag
    common.write_csv(os.path.join(args.out, f"causal_linear_cpu{suffix}.csv"), rows)
    print(write_report(args, rows, env, os.path.join(args.out, f"causal_linear_cpu{suffix}.md")))


def _versions():
    info = common.torch_info()
    try:
        from importlib.metadata import version

        info["fast_transformers"] = version("pytorch-fast-transformers")
    except Exception:
        info["fast_transformers"] = "not installed"
    return info


if __name__ == "__main__":
    main()
