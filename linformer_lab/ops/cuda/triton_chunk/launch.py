"""Compiling and launching the Triton kernels of ``forward.py`` and ``backward.py``.

The kernels are wrapped with ``triton.jit`` on first use, once per mode: under
``TRITON_INTERPRET=1`` Triton's interpreter runs them on CPU tensors in numpy (fp32, fp16), which
is how CI tests them. The variable must be set before triton is first imported: triton.language's
own functions (``tl.sum``) take their mode then (``tests/conftest.py`` sets it). On a GPU the three kernels that are parallel
over chunks carry a small autotuning space (their value-tile width and warps, keyed by C, M, the
chunk and the dtypes); the two state walks take their tiles from the grid size: tiles of 64,
halved while the grid has fewer programs than two per multiprocessor, so that short batches
still fill the chip.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch
import triton

from linformer_lab.ops.cuda.triton_chunk import backward, forward

_HALF = (torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """Triton's precision for the products with an fp32 operand (states, scores, gradients of
    the numerator): for fp16/bf16 inputs three tf32 products (``tf32x3``), as exact as fp32 (the
    backward subtracts nearly equal terms built from them; see ``backward.py``); for fp32 inputs
    what ``torch.set_float32_matmul_precision`` asks: tf32, or for "highest" ``tf32x3`` too (the
    plain fp32 product compiles to a register-hungry loop of scalar fused multiply-adds)."""
    if dtype in _HALF or torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def tiny(dtype: torch.dtype) -> float:
    """The floor of phi: the smallest normal number for half dtypes (as the elu feature map
    clamps them), 0 for fp32 (phi >= 0 already)."""
    return float(torch.finfo(dtype).tiny) if dtype in _HALF else 0.0


def pow2(n: int, cap: int = 128) -> int:
    """The tile covering n: a power of two, at least 16 (the smallest ``tl.dot`` side), at most cap."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def tile(dtype: torch.dtype, half: int = 64) -> int:
    """The widest feature/value tile for an input dtype: ``half`` for fp16/bf16, half of it
    (at least 32) for fp32, whose tiles and three-product tf32 take twice the registers."""
    return half if dtype in _HALF else max(32, half // 2)


def _prune(configs, named_args, **kwargs):
    """Keep the configs whose value tile is at most the padded M and what the dtype allows (wider
    ones repeat work or spill registers) and at least min(M, 64); where states are fp32 (fp16 and
    fp32 inputs), drop the dq/dk kernel's 4-warp configs (its fp32 operands spill there). None
    left (a small M): one config of that M's width."""
    dtype = named_args["Q"].dtype
    widest = min(pow2(kwargs["M"]), tile(dtype, 128))
    kept = [cfg for cfg in configs if min(widest, 64) <= cfg.kwargs["BV"] <= widest]
    if dtype != torch.bfloat16 and "R" in named_args and "DQ" in named_args:
        kept = [cfg for cfg in kept if cfg.num_warps >= 8]
    return kept or [triton.Config({"BV": min(widest, tile(dtype))}, num_warps=8, num_stages=2)]


def _tuned(kernel, configs):
    return triton.autotune(configs, key=["C", "M", "BT"], prune_configs_by={"early_config_prune": _prune})(kernel)


@functools.cache
def kernels(interpret: bool) -> SimpleNamespace:
    """The kernels compiled for one mode (the interpreter or the GPU)."""
    jit = {name: triton.jit(getattr(module, name)) for module, name in (
        (forward, "chunk_states_forward"), (forward, "chunk_output_forward"), (backward, "backward_prepare"),
        (backward, "chunk_numerator_backward"), (backward, "chunk_states_backward"),
        (backward, "chunk_dq_dk_backward"), (backward, "chunk_dv_backward"))}
    if interpret:  # one fixed config: timing configs means nothing in numpy
        return SimpleNamespace(tuned=False, **jit)
    out_cfg = [triton.Config({"BV": 64}, num_warps=4, num_stages=2), triton.Config({"BV": 64}, num_warps=8, num_stages=2),
               triton.Config({"BV": 128}, num_warps=8, num_stages=2), triton.Config({"BV": 32}, num_warps=4, num_stages=2)]
    grad_cfg = [triton.Config({"BV": 64}, num_warps=8, num_stages=2), triton.Config({"BV": 64}, num_warps=4, num_stages=2)]
    return SimpleNamespace(
        tuned=True, **{**jit, "chunk_output_forward": _tuned(jit["chunk_output_forward"], out_cfg),
                       "chunk_dq_dk_backward": _tuned(jit["chunk_dq_dk_backward"], grad_cfg),
                       "chunk_dv_backward": _tuned(jit["chunk_dv_backward"], grad_cfg)})


def _state_tiles(c: int, m: int, rows: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(BK, BV) of the state walks: 64 (fp32: 32) or the padded size, halved down to 32 while the
    grid ``cdiv(C, BK) cdiv(M, BV) rows`` has fewer programs than two per multiprocessor."""
    bk, bv = pow2(c, tile(dtype)), pow2(m, tile(dtype))
    if device.type != "cuda":
        return bk, bv
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    while triton.cdiv(c, bk) * triton.cdiv(m, bv) * rows < target and max(bk, bv) > 32:
        if bv >= bk:
            bv //= 2
        else:
            bk //= 2
    return bk, bv


class Layout(SimpleNamespace):
    """What every launch shares: the sequences, the chunking and the strides.

    ``q, k`` ``(B, H, T, C)`` or ``(B, T, H, C)``, ``v`` likewise with M; ``sequences`` S (B, or
    len(cu_seqlens) - 1); ``chunks`` the state rows per head (all chunks of all sequences);
    ``table``/``offsets`` (VARLEN only): int32 (chunk -> (sequence, chunk in it)) and the first
    chunk of each sequence."""


def layout(q, v, cu_seqlens, chunk: int, head_first: bool) -> Layout:
    if head_first:
        b, h, t, c = q.shape
    else:
        b, t, h, c = q.shape
    m = v.shape[-1]
    qs, vs = q.stride(), v.stride()
    hd, td = (1, 2) if head_first else (2, 1)
    strides = (qs[0], qs[hd], qs[td], vs[0], vs[hd], vs[td])
    varlen = cu_seqlens is not None
    table = offsets = cu = None
    if varlen:
        lengths = [int(n) for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()]
        counts = [triton.cdiv(n, chunk) for n in lengths]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        pairs = [(i, j) for i, n in enumerate(counts) for j in range(n)]
        table = torch.tensor(pairs or [(0, 0)], dtype=torch.int32, device=q.device)
        offsets = torch.tensor(starts, dtype=torch.int32, device=q.device)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        sequences, chunks, max_chunks = len(lengths), starts[-1], max(counts, default=0)
    else:
        sequences, chunks, max_chunks = b, b * triton.cdiv(t, chunk), triton.cdiv(t, chunk)
    return Layout(batch=b, heads=h, time=t, c=c, m=m, chunk=chunk, strides=strides, varlen=varlen, table=table,
                  offsets=offsets, cu=cu, sequences=sequences, chunks=chunks, max_chunks=max_chunks, dtype=q.dtype)


def _common(lay: Layout, elu: bool):
    return dict(C=lay.c, M=lay.m, BT=lay.chunk, ELU=elu, VARLEN=lay.varlen, PREC=dot_precision(lay.dtype))


def _walk(lay: Layout):
    """The loop bound of the state walks: under the interpreter the most chunks of any sequence
    as a constant (see ``forward.chunk_states_forward``), on a GPU each sequence's own count."""
    if not interpreting():
        return dict(INTERPRET=False, MAX_CHUNKS=0)
    return dict(INTERPRET=True, MAX_CHUNKS=lay.max_chunks)


def _chunk_grid(lay: Layout, tiles):
    """Grid of the kernels parallel over chunks: (tiles, chunks, S H) or, packed, (tiles, all chunks, H)."""
    if lay.varlen:
        return lambda meta: (tiles(meta), lay.chunks, lay.heads)
    return lambda meta: (tiles(meta), triton.cdiv(lay.time, lay.chunk), lay.batch * lay.heads)


def _fixed(kern, lay, bv):
    """Meta-parameters for an untuned (interpreted) launch of a tuned kernel."""
    return {} if kern.tuned else {"BV": bv}


def run_states_forward(k, v, s0, z0, lay: Layout, elu: bool):
    """-> states ``(chunks, H, C, M)``, zstates ``(chunks, H, C)``, S_N ``(S, H, C, M)``, z_N ``(S, H, C)``."""
    kern = kernels(interpreting())
    dev = k.device
    states = torch.empty(lay.chunks, lay.heads, lay.c, lay.m, device=dev, dtype=torch.float32)
    zstates = torch.empty(lay.chunks, lay.heads, lay.c, device=dev, dtype=torch.float32)
    s_final = torch.empty(lay.sequences, lay.heads, lay.c, lay.m, device=dev, dtype=torch.float32)
    z_final = torch.empty(lay.sequences, lay.heads, lay.c, device=dev, dtype=torch.float32)
    bk, bv = _state_tiles(lay.c, lay.m, lay.sequences * lay.heads, dev, lay.dtype)
    grid = (triton.cdiv(lay.m, bv), triton.cdiv(lay.c, bk), lay.sequences * lay.heads)
    kern.chunk_states_forward[grid](
        k, v, s0 if s0 is not None else s_final, z0 if z0 is not None else z_final, states, zstates, s_final, z_final,
        lay.cu if lay.varlen else k, lay.offsets if lay.varlen else k, lay.time, lay.heads, *lay.strides,
        tiny(lay.dtype), BK=bk, BV=bv, HAS_INIT=s0 is not None, **_walk(lay), **_common(lay, elu))
    return states, zstates, s_final, z_final


def run_output_forward(q, k, v, states, zstates, lay: Layout, elu: bool, eps: float):
    """-> out (like v), den ``(B, H, T)`` fp32."""
    kern = kernels(interpreting())
    out = torch.empty_like(v)
    den = torch.empty(lay.batch, lay.heads, lay.time, device=q.device, dtype=torch.float32)
    grid = _chunk_grid(lay, lambda meta: triton.cdiv(lay.m, meta["BV"]))
    kern.chunk_output_forward[grid](
        q, k, v, out, den, states, zstates, lay.cu if lay.varlen else q, lay.offsets if lay.varlen else q,
        lay.table if lay.varlen else q, lay.time, lay.heads, *lay.strides, tiny(lay.dtype), eps,
        BK=pow2(lay.c, tile(lay.dtype, 128)), **_fixed(kern, lay, pow2(lay.m, tile(lay.dtype))), **_common(lay, elu))
    return out, den


def run_backward(q, k, v, out, den, grad_out, ds_final, dz_final, s0, z0, lay: Layout, elu: bool):
    """-> dq, dk, dv (like q, k, v), dS_0 ``(S, H, C, M)``, dz_0 ``(S, H, C)`` fp32."""
    kern = kernels(interpreting())
    dev = q.device
    states, zstates, _, _ = run_states_forward(k, v, s0, z0, lay, elu)
    r = torch.empty_like(den)
    bv = pow2(lay.m, tile(lay.dtype))
    if lay.dtype == torch.float32:  # the stored output is as exact as a recomputed one
        kern.backward_prepare[(triton.cdiv(lay.time, 64), lay.batch * lay.heads)](
            grad_out, out, den, r, lay.time, lay.heads, *lay.strides[3:], M=lay.m, BT=64, BV=bv)
    else:
        kern.chunk_numerator_backward[_chunk_grid(lay, lambda meta: 1)](
            q, k, v, grad_out, den, r, states, lay.cu if lay.varlen else q, lay.offsets if lay.varlen else q,
            lay.table if lay.varlen else q, lay.time, lay.heads, *lay.strides, tiny(lay.dtype),
            BK=pow2(lay.c, 64), BV=bv, **_common(lay, elu))
    dstates = torch.empty_like(states)
    dzstates = torch.empty_like(zstates)
    ds0 = torch.empty(lay.sequences, lay.heads, lay.c, lay.m, device=dev, dtype=torch.float32)
    dz0 = torch.empty(lay.sequences, lay.heads, lay.c, device=dev, dtype=torch.float32)
    bk, bvs = _state_tiles(lay.c, lay.m, lay.sequences * lay.heads, dev, lay.dtype)
    has_final = ds_final is not None
    kern.chunk_states_backward[(triton.cdiv(lay.m, bvs), triton.cdiv(lay.c, bk), lay.sequences * lay.heads)](
        q, grad_out, den, r, ds_final if has_final else ds0, dz_final if has_final else dz0, dstates, dzstates, ds0,
        dz0, lay.cu if lay.varlen else q, lay.offsets if lay.varlen else q, lay.time, lay.heads, *lay.strides,
        tiny(lay.dtype), BK=bk, BV=bvs, HAS_DFINAL=has_final, **_walk(lay), **_common(lay, elu))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    table = dict(CU=lay.cu if lay.varlen else q, CHUNK_OFF=lay.offsets if lay.varlen else q,
                 CHUNK_TABLE=lay.table if lay.varlen else q)
    bk = pow2(lay.c, tile(lay.dtype))
    kern.chunk_dq_dk_backward[_chunk_grid(lay, lambda meta: triton.cdiv(lay.c, bk))](
        q, k, v, grad_out, den, r, states, zstates, dstates, dzstates, dq, dk, **table, T=lay.time, H=lay.heads,
        sb_k=lay.strides[0], sh_k=lay.strides[1], st_k=lay.strides[2], sb_v=lay.strides[3], sh_v=lay.strides[4],
        st_v=lay.strides[5], tiny=tiny(lay.dtype), BK=bk, **_fixed(kern, lay, bv), **_common(lay, elu))
    kern.chunk_dv_backward[_chunk_grid(lay, lambda meta: triton.cdiv(lay.m, meta["BV"]))](
        q, k, grad_out, den, dstates, dv, **table, T=lay.time, H=lay.heads, sb_k=lay.strides[0],
        sb_v=lay.strides[3], sh_k=lay.strides[1], st_k=lay.strides[2], sh_v=lay.strides[4], st_v=lay.strides[5],
        tiny=tiny(lay.dtype), BK=bk, **_fixed(kern, lay, bv), **_common(lay, elu))
    return dq, dk, dv, ds0, dz0


def compile_for(capability: tuple[int, int], dtype: torch.dtype, c: int, m: int, chunk: int = 64, varlen: bool = False,
                elu: bool = True) -> dict:
    """Compile every kernel for a GPU of ``capability`` (e.g. ``(9, 0)``) without needing one
    (Triton's own ptxas): ``{kernel name: triton CompiledKernel}`` (``.asm["cubin"]``, ``["ptx"]``,
    ``.metadata.shared``), one config each, pointers and strides 16-divisible as a real launch of
    contiguous tensors sees them. For checking compilation, instructions and registers on a CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    dt, sd = name[dtype], "fp32"
    f32, i32 = "fp32", "i32"
    pointers = dict(Q=dt, K=dt, V=dt, O=dt, DO=dt, DQ=dt, DK=dt, DV=dt, STATES=sd, DSTATES=sd, CU=i32, CHUNK_OFF=i32,
                    CHUNK_TABLE=i32)
    base = dict(C=c, M=m, BT=chunk, ELU=elu, VARLEN=varlen, PREC=dot_precision(dtype))
    bk, bv = pow2(c, tile(dtype)), pow2(m, tile(dtype))
    walk = dict(BK=bk, BV=bv, INTERPRET=False, MAX_CHUNKS=0)
    # (constexprs, (warps, stages)): the state walks as launched, the others their first config
    kernels_meta = {
        (forward, "chunk_states_forward"): (dict(base, HAS_INIT=True, **walk), (4, 3)),
        (forward, "chunk_output_forward"): (dict(base, BK=pow2(c, tile(dtype, 128)), BV=bv), (4, 2)),
        (backward, "backward_prepare"): (dict(M=m, BT=64, BV=pow2(m, 64)), (4, 3)),
        (backward, "chunk_numerator_backward"): (dict(base, BK=pow2(c, 64), BV=bv), (8, 2)),
        (backward, "chunk_states_backward"): (dict(base, HAS_DFINAL=True, **walk), (4, 3)),
        (backward, "chunk_dq_dk_backward"): (dict(base, BK=bk, BV=bv), (8, 2)),
        (backward, "chunk_dv_backward"): (dict(base, BK=bk, BV=bv), (8, 2)),
    }
    compiled = {}
    for (module, kernel), (constexprs, (warps, stages)) in kernels_meta.items():
        fn = triton.jit(getattr(module, kernel))
        signature, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg in ("tiny", "eps"):
                signature[arg] = f32
            elif arg in ("T", "H"):
                signature[arg] = i32
            elif arg.startswith(("sb_", "sh_", "st_")):
                signature[arg], attrs[(i,)] = i32, [["tt.divisibility", 16]]
            else:  # a pointer: the tensors above, fp32 for states, normalisers and their gradients
                signature[arg], attrs[(i,)] = "*" + pointers.get(arg, f32), [["tt.divisibility", 16]]
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
        compiled[kernel] = triton.compile(source, target=target, options=dict(num_warps=warps, num_stages=stages))
    return compiled
