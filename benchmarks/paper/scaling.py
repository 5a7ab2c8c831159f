"""Paper Fig. 1 (§4.1.2): forward+backward time and peak memory per sample against the
sequence length, for softmax, linear (and linear_cuda on GPU) and Reformer's lsh-1/4/8, and
beyond the paper linear attention with each other built-in feature map (``linear/<map>``:
relu, t2r, hedgehog, taylor, ...), whose cost against elu + 1 the figure then shows.

N = 2^9 ... 2^16 with the batch size inversely proportional to N: B = max(1, tokens / N)
(``--tokens``, default 2^13 on CPU, 2^16 on GPU; past N = tokens, B stays 1). The paper
does not state D or H for this figure: we use H=8 heads of D=M=32 (its image models' head
size), causal attention (the constant-memory gradient of eq. 13-15 is the point of the
figure; ``--non-causal`` for the other), lsh with 64 buckets and chunks of 32 (its §4.2).

Every method runs up to the largest N that fits: a method stops after the first N whose
one fwd+bwd exceeds ``--time-cap`` seconds or whose memory exceeds ``--mem-cap-gb`` (the
child process then fails to allocate), and the rest of its row is "—".

Memory: on CPU, the peak-RSS increase of one fwd+bwd in a fresh child process per
configuration; on GPU, ``torch.cuda.max_memory_allocated`` minus the memory allocated before
the call. Time: median over interleaved rounds (method A, B, C, A, B, C, ...) in one child
per N, after one warm-up call.

    uv run python benchmarks/paper/scaling.py            # full CPU run (paper methods ~15-18 min on 2 cores; maps add)
    uv run python benchmarks/paper/scaling.py --quick    # smoke run (< 1 min)

Writes ``benchmarks/paper/results/scaling_<device>.{csv,md,png}``.
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
H, D, M = 8, 32, 32
#: the feature maps beyond elu + 1 in the default methods, as ``linear/<map>``
FEATURE_MAPS = ("relu", "squared_relu", "sigmoid", "dpfp", "taylor", "rebased", "t2r", "hedgehog", "poly2", "favor",
                "random_fourier")
#: one fwd+bwd at this N precedes each memory measurement: the first call of any size adds
#: ~40 MB of RSS on CPU (code pages, thread pools) that is no cost of the N measured
WARMUP_N = 256


def _spec(method: str) -> tuple[str, dict]:
    """'lsh-4' -> ('lsh', {'n_hashes': 4, ...}); 'linear/t2r' -> ('linear', {'feature_map': 't2r'});
    other names are backends as is."""
    if method.startswith("lsh-"):
        return "lsh", {"n_hashes": int(method[4:]), "bucket_size": 32, "n_buckets": 64}
    backend, _, feature_map = method.partition("/")
    return backend, ({"feature_map": feature_map} if feature_map else {})


def _case(method: str, b: int, n: int, device: str, causal: bool):
    """A zero-argument fwd+bwd closure for one configuration."""
    import torch

    import linformer_lab as ll

    name, kwargs = _spec(method)
    attn = ll.build_attention(name, causal=causal, query_dim=D, **kwargs).to(device)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, H, n, D, generator=gen).to(device).requires_grad_()
    k = q if attn.shares_query_key else torch.randn(b, H, n, D, generator=gen).to(device).requires_grad_()
    v = torch.randn(b, H, n, M, generator=gen).to(device).requires_grad_()
    grad = torch.randn(b, H, n, M, generator=gen).to(device)

    def step():
        q.grad = k.grad = v.grad = None
        attn(q, k, v).backward(grad)

    return step


def child_memory(method, b, n, device, causal, threads, cap_bytes):
    import torch

    torch.set_num_threads(threads)
    if device == "cpu":
        common.limit_data_segment(cap_bytes)
    _case(method, 1, WARMUP_N, device, causal)()  # code pages, thread pools, CUDA context: not this N's cost
    step = _case(method, b, n, device, causal)
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        if peak > cap_bytes:
            raise MemoryError(f"peak {peak / 2**30:.1f} GiB over the cap")
    else:
        peak = common.peak_rss_increase(step)["peak_increase"]
    return {"peak_bytes": peak, "first_call_s": time.perf_counter() - t0}


def child_times(methods, b, n, device, causal, threads, repeats, budget_s):
    import torch

    torch.set_num_threads(threads)
    cases = {m: _case(m, b, n, device, causal) for m in methods}
    res = common.interleaved_medians(cases, repeats=repeats, warmup=1, budget_s=budget_s, device=device)
    return {"times": res, "loadavg": os.getloadavg()}


def child_env(device):
    import torch

    info = common.torch_info()
    info["device_name"] = torch.cuda.get_device_name() if device == "cuda" else common.machine_info()["cpu"]
    return info


def _progress(total):
    from tqdm import tqdm

    return tqdm(total=total, unit="cfg", dynamic_ncols=True)


def run(args):
    device = args.device
    methods = [m for m in args.methods.split(",") if m != "linear_cuda" or device == "cuda"]
    cap = int(args.mem_cap_gb * 1024**3)
    lengths = [2**i for i in range(args.min_log2n, args.max_log2n + 1)]
    active = dict.fromkeys(methods, True)
    rows = []
    bar = _progress(len(lengths) * len(methods))
    for n in lengths:
        b = max(1, args.tokens // n)
        ran = {}
        for method in methods:
            row = dict(method=method, N=n, B=b, H=H, D=D, M=M, causal=args.causal, device=device)
            rows.append(row)
            bar.set_postfix_str(f"{method} N={n} B={b}")
            if not active[method]:
                row["status"] = "stopped"
                bar.update()
                continue
            status, res = common.run_in_child(
                child_memory, dict(method=method, b=b, n=n, device=device, causal=args.causal,
                                   threads=args.threads, cap_bytes=cap),
                timeout_s=args.time_cap * 6 + 120, env=common.FIXED_MALLOC,
            )
            row["status"] = status
            if status == "ok":
                row.update(peak_mb=res["peak_bytes"] / common.MIB, peak_mb_per_sample=res["peak_bytes"] / common.MIB / b,
                           first_call_s=res["first_call_s"])
                ran[method] = res["first_call_s"]
                if res["first_call_s"] > args.time_cap:
                    row.update(time_ms=res["first_call_s"] * 1e3, time_ms_per_sample=res["first_call_s"] * 1e3 / b,
                               repeats=1, loadavg_1m=round(os.getloadavg()[0], 2))
                    active[method] = False  # the next N would only be slower
            else:
                row["error"] = str(res)[:300]
                active[method] = False
            bar.update()
        timed = [m for m, t in ran.items() if t <= args.time_cap]
        if timed:
            bar.set_postfix_str(f"timing N={n}: {','.join(timed)}")
            status, res = common.run_in_child(
                child_times, dict(methods=timed, b=b, n=n, device=device, causal=args.causal, threads=args.threads,
                                  repeats=args.repeats, budget_s=args.time_budget),
                timeout_s=args.time_cap * (args.repeats + 1) * len(timed) + 120,
            )
            for row in rows:
                if row["N"] == n and row["method"] in timed:
                    if status == "ok":
                        t = res["times"][row["method"]]
                        row.update(time_ms=t["median"] * 1e3, time_ms_per_sample=t["median"] * 1e3 / b,
                                   time_min_ms=t["min"] * 1e3, repeats=len(t["samples"]), loadavg_1m=round(res["loadavg"][0], 2))
                    else:
                        row["time_error"] = f"{status}: {str(res)[:300]}"
    bar.close()
    return rows, methods, lengths


def plot(path, rows, methods, lengths, title):
    plt = common.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "time_ms_per_sample", "time per sample (ms)"),
                           (axes[1], "peak_mb_per_sample", "peak memory per sample (MB)")):
        for method in methods:
            pts = [(r["N"], r[key]) for r in rows if r["method"] == method and r.get(key)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(rows, methods, lengths, header_lines):
    def cell(method, n, key, digits):
        r = next(r for r in rows if r["method"] == method and r["N"] == n)
        return common.fmt(r.get(key) if r.get("status") == "ok" else None, digits)

    out = header_lines + ["", "### Time per sample (ms, fwd+bwd)", ""]
    out.append(common.markdown_table(["N", "B"] + methods, [
        [n, next(r["B"] for r in rows if r["N"] == n)] + [cell(m, n, "time_ms_per_sample", 2) for m in methods]
        for n in lengths]))
    out += ["", "### Peak memory per sample (MB)", ""]
    out.append(common.markdown_table(["N", "B"] + methods, [
        [n, next(r["B"] for r in rows if r["N"] == n)] + [cell(m, n, "peak_mb_per_sample", 2) for m in methods]
        for n in lengths]))
    stopped = [f"{r['method']} at N={r['N']}: {r.get('error', '')[:120]}" for r in rows
               if r.get("status") not in ("ok", "stopped")]
    slow = [f"{r['method']} at N={r['N']} ({r['first_call_s']:.0f} s for one call)" for r in rows
            if r.get("status") == "ok" and r.get("repeats") == 1]
    out += ["", "— = not run: the method exceeded a cap at a smaller N."]
    if slow:
        out.append("Stopped by the time cap after: " + "; ".join(slow) + " (that one cold call is reported).")
    if stopped:
        out.append("Failed (memory cap / error): " + "; ".join(stopped))
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--methods", default=",".join(["softmax", "linear", "linear_cuda", "lsh-1", "lsh-4", "lsh-8"]
                                                 + [f"linear/{m}" for m in FEATURE_MAPS]))
    p.add_argument("--tokens", type=int, default=None, help="B * N (default 2^13 on CPU, 2^16 on GPU)")
    p.add_argument("--min-log2n", type=int, default=9)
    p.add_argument("--max-log2n", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-budget", type=float, default=20.0, help="s of timing per N before stopping early (>= 3 rounds)")
    p.add_argument("--time-cap", type=float, default=30.0, help="s; a method stops after one fwd+bwd slower than this")
    p.add_argument("--mem-cap-gb", type=float, default=8.0)
    p.add_argument("--non-causal", dest="causal", action="store_false")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 2^9..2^11, tokens 2^11, 2 repeats")
    common.add_omp_wait_policy_argument(p)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    common.apply_omp_wait_policy(args.omp_wait_policy)
    if args.device is None:
        status, info = common.run_in_child(common.torch_info, {}, 120)
        args.device = "cuda" if status == "ok" and info["cuda"] else "cpu"
    if args.tokens is None:
        args.tokens = 2**16 if args.device == "cuda" else 2**13
    if args.quick:
        args.max_log2n, args.tokens, args.repeats, args.time_budget = min(args.max_log2n, 11), 2**11, 2, 5.0
    os.makedirs(args.out, exist_ok=True)
    load_start = common.load_line()
    t0 = time.perf_counter()
    rows, methods, lengths = run(args)
    wall = time.perf_counter() - t0
    status, env = common.run_in_child(child_env, {"device": args.device}, 120)
    env = env if status == "ok" else {}
    mach = common.machine_info()
    tag = args.device + ("_quick" if args.quick else "") + args.tag
    header = [
        f"# Scaling of fwd+bwd with N ({args.device}, paper Fig. 1)", "",
        f"- device: {env.get('device_name')}; {mach['logical_cpus']} logical CPUs, {mach['mem_gib']} GiB; "
        f"torch {env.get('torch')}, {args.threads} threads",
        f"- H={H}, D=M={D}, {'causal' if args.causal else 'non-causal'}, fp32; B = max(1, {args.tokens} / N); "
        f"linear: elu+1 feature map (linear/<map>: that map), default chunk; lsh: 64 buckets, chunks of 32 (shared QK)",
        f"- time: median of up to {args.repeats} interleaved fwd+bwd calls after a warm-up; memory: "
        + (f"peak-RSS increase of one fwd+bwd in a fresh child process, after a warm-up call at N={WARMUP_N}"
           if args.device == "cpu" else "torch.cuda.max_memory_allocated increase")
        + "; both divided by B",
        f"- caps: {args.time_cap:.0f} s per fwd+bwd call, {args.mem_cap_gb:.0f} GB; total wall time {wall / 60:.1f} min",
        f"- {load_start} at start, {common.load_line()} at end; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
    ]
    common.write_csv(os.path.join(args.out, f"scaling_{tag}.csv"), rows)
    md = markdown(rows, methods, lengths, header)
    png = os.path.join(args.out, f"scaling_{tag}.png")
    title = f"fwd+bwd per sample, {env.get('device_name')}, H={H}, D=M={D}, B=max(1,{args.tokens}/N)"
    if plot(png, rows, methods, lengths, title):
        md += f"\n![scaling](scaling_{tag}.png)\n"
    with open(os.path.join(args.out, f"scaling_{tag}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
