"""Compiling and launching the Triton kernels of ``forward.py`` and ``backward.py``.

The kernels are wrapped with ``triton.jit`` on first use, once per mode: under
``TRITON_INTERPRET=1`` Triton's interpreter runs them on CPU tensors in numpy (fp32, fp16), which
is how CI tests them. The variable must be set before triton is first imported: triton.language's
own functions (``tl.sum``) and the kernels' jitted helpers take their mode then
(``tests/conftest.py`` sets it). On a GPU every kernel but ``backward_prepare`` carries a small
autotuning space keyed by C, M, the chunk and the dtypes: the value-tile width and warps of the
kernels parallel over chunks, the tiles, warps and stages of the two state walks;
:func:`tuning_report` lists what each tuning chose and the seconds it took (compiling included).
The interpreter runs one fixed config.

Nothing here reads a device tensor on the host: grids come from shapes alone (packed sequences
get an upper bound on their chunks), so a launch never waits for the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import re
from types import SimpleNamespace

import torch
import triton

from linformer_lab.ops.cuda.triton_chunk import backward, forward

_HALF = (torch.float16, torch.bfloat16)
#: CUDA's limit on a grid's x dimension; the kernels' grids are one-dimensional (y and z stop at 65,535)
MAX_PROGRAMS = 2**31 - 1


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


def tile(widest: int = 64) -> int:
    """The widest feature/value tile: on a GPU half of ``widest`` (at least 32), because the
    products with a state take fp32 operands in three tf32 products, twice the registers of a
    half-precision tile; under the interpreter ``widest`` itself (fewer programs to run)."""
    return widest if interpreting() else max(32, widest // 2)


def _prune(configs, named_args, **kwargs):
    """Keep the configs whose value tile is at most the padded M and what the dtype allows (wider
    ones repeat work or spill registers) and at least min(M, 64); drop the dq/dk kernel's 4-warp
    configs (its fp32 operands spill there). None left (a small M): one config of that M's width."""
    widest = min(pow2(kwargs["M"]), tile(128))
    kept = [cfg for cfg in configs if min(widest, 64) <= cfg.kwargs["BV"] <= widest]
    if "DQ" in named_args:
        kept = [cfg for cfg in kept if cfg.num_warps >= 8]
    return kept or [triton.Config({"BV": min(widest, tile())}, num_warps=8, num_stages=2)]


def _prune_walk(configs, named_args, **kwargs):
    """State walks: keep the tiles no wider than the padded C and M (a wider one is idle work);
    one config of the padded sizes if none is left."""
    c, m = pow2(kwargs["C"], 64), pow2(kwargs["M"], 64)
    kept = [cfg for cfg in configs if cfg.kwargs["BK"] <= c and cfg.kwargs["BV"] <= m]
    return kept or [triton.Config({"BK": c, "BV": m}, num_warps=4, num_stages=2)]


def _tuned(kernel, configs, prune=_prune):
    pruning = {"early_config_prune": prune} if prune is not None else None
    return triton.autotune(configs, key=["C", "M", "BT"], prune_configs_by=pruning)(kernel)


#: (kernel, key, chosen config, seconds) of every autotuning this process ran
_TUNINGS: list[dict] = []


def tuning_report() -> list[dict]:
    """Every autotuning so far: ``{"kernel", "key" (C, M, chunk, dtypes), "config", "seconds"}``,
    the seconds those of compiling and timing all its configs. Empty under the interpreter."""
    return list(_TUNINGS)


def _launch(kern, name: str, grid, *args, **kwargs):
    """Launch, recording the autotuning a new key set off."""
    cache = getattr(kern, "cache", None)
    seen = set(cache) if cache is not None else set()
    kern[grid](*args, **kwargs)
    for key in set(cache or ()) - seen:
        _TUNINGS.append(dict(kernel=name, key=key, config=str(cache[key]), seconds=getattr(kern, "bench_time", 0.0)))


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
    # r's kernel holds two chunk x chunk products: 32-wide value tiles keep it in registers
    numerator_cfg = [triton.Config({"BV": 32}, num_warps=8, num_stages=2), triton.Config({"BV": 32}, num_warps=4, num_stages=2)]
    # the walks' grid is cdiv(M, BV) cdiv(C, BK) S H programs, each serial over the chunks: small
    # tiles fill the chip when S H is small, large ones read q (or k) fewer times
    walk_cfg = [triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=3),
                triton.Config({"BK": 32, "BV": 64}, num_warps=4, num_stages=3),
                triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2),
                triton.Config({"BK": 64, "BV": 64}, num_warps=8, num_stages=2)]
    return SimpleNamespace(
        tuned=True, **{**jit, "chunk_output_forward": _tuned(jit["chunk_output_forward"], out_cfg),
                       "chunk_numerator_backward": _tuned(jit["chunk_numerator_backward"], numerator_cfg, None),
                       "chunk_dq_dk_backward": _tuned(jit["chunk_dq_dk_backward"], grad_cfg),
                       "chunk_dv_backward": _tuned(jit["chunk_dv_backward"], grad_cfg),
                       "chunk_states_forward": _tuned(jit["chunk_states_forward"], walk_cfg, _prune_walk),
                       "chunk_states_backward": _tuned(jit["chunk_states_backward"], walk_cfg, _prune_walk)})


def programs(*counts: int) -> tuple[int]:
    """The one-dimensional grid of ``counts`` folded together (each kernel unfolds its program
    index); one launch holds at most 2^31 - 1 programs, far more than any tensor that fits a GPU."""
    total = 1
    for n in counts:
        total *= n
    if total > MAX_PROGRAMS:
        raise ValueError(f"chunk_linear_attention: {total} programs ({' x '.join(map(str, counts))}) exceed one "
                         f"launch's {MAX_PROGRAMS}; split the batch")
    return (total,)


def strides(x: torch.Tensor, head_first: bool) -> tuple[int, int, int, int]:
    """(batch, head, position, feature) strides of a ``(B, H, T, D)`` or ``(B, T, H, D)`` tensor."""
    sb, s1, s2, sd = x.stride()
    return (sb, s1, s2, sd) if head_first else (sb, s2, s1, sd)


class Layout(SimpleNamespace):
    """What every launch shares: the sequences and the chunking.

    ``sequences`` S (B, or len(cu_seqlens) - 1); ``nt`` the chunks per grid row: cdiv(T, chunk),
    packed an upper bound on all sequences' chunks, cdiv(T, chunk) + S; ``rows`` the grid rows (S
    H, packed H); ``state_chunks`` the state rows per head; ``max_chunks`` the bound of the
    interpreter's walk. Packed (VARLEN): ``cu`` the offsets as given, ``offsets`` ``(S + 1,)``
    the first global chunk of each sequence, ``table`` ``(nt, 2)`` global chunk -> (sequence,
    chunk in it), all built on the device."""


def layout(q, v, cu_seqlens, chunk: int, head_first: bool) -> Layout:
    b, t = q.shape[0], q.shape[2] if head_first else q.shape[1]
    h, c, m = q.shape[1] if head_first else q.shape[2], q.shape[-1], v.shape[-1]
    per_sequence = triton.cdiv(t, chunk)
    if cu_seqlens is None:
        return Layout(batch=b, heads=h, time=t, c=c, m=m, chunk=chunk, head_first=head_first, varlen=False, cu=None,
                      offsets=None, table=None, sequences=b, nt=per_sequence, rows=b * h, state_chunks=b * per_sequence,
                      max_chunks=per_sequence, dtype=q.dtype)
    sequences = cu_seqlens.shape[0] - 1
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    nt = per_sequence + sequences  # each sequence adds at most one partial chunk
    chunk_ids = torch.arange(nt, device=cu_seqlens.device, dtype=offsets.dtype)
    # the sequence of each chunk (empty sequences skipped); past the last chunk the last sequence,
    # at a chunk past its end: those programs find every position masked
    owner = torch.searchsorted(offsets[1:], chunk_ids, right=True).clamp_(max=sequences - 1)
    table = torch.stack([owner, chunk_ids - offsets[owner]], dim=1)
    return Layout(batch=b, heads=h, time=t, c=c, m=m, chunk=chunk, head_first=head_first, varlen=True, cu=cu_seqlens,
                  offsets=offsets, table=table, sequences=sequences, nt=nt, rows=h, state_chunks=nt,
                  max_chunks=per_sequence, dtype=q.dtype)


def _common(lay: Layout, elu: bool):
    return dict(C=lay.c, M=lay.m, BT=lay.chunk, ELU=elu, VARLEN=lay.varlen, PREC=dot_precision(lay.dtype))


def _walk(lay: Layout, kern):
    """The state walks' loop bound (under the interpreter a constant, see
    ``forward.chunk_states_forward``; on a GPU each sequence's own count) and fixed tiles where
    nothing is tuned."""
    if not interpreting():
        return dict(INTERPRET=False, MAX_CHUNKS=0)
    fixed = {} if kern.tuned else dict(BK=pow2(lay.c, tile()), BV=pow2(lay.m, tile()))
    return dict(INTERPRET=True, MAX_CHUNKS=lay.max_chunks, **fixed)


def walk_grid(lay: Layout):
    """Programs of the state walks: value tiles x feature tiles x sequences x heads."""
    return lambda meta: programs(triton.cdiv(lay.m, meta["BV"]), triton.cdiv(lay.c, meta["BK"]), lay.sequences * lay.heads)


def chunk_grid(lay: Layout, tiles):
    """Programs of the kernels parallel over chunks: tiles x nt chunks x rows."""
    return lambda meta: programs(tiles(meta), lay.nt, lay.rows)


def _fixed(kern, bv):
    """Meta-parameters for an untuned (interpreted) launch of a tuned kernel."""
    return {} if kern.tuned else {"BV": bv}


def _packing(lay: Layout, anchor: torch.Tensor, table: bool = True):
    """CU, CHUNK_OFF (and CHUNK_TABLE) arguments: the packing's tensors, or any pointer unpacked."""
    names = (lay.cu, lay.offsets, lay.table) if lay.varlen else (anchor, anchor, anchor)
    return names if table else names[:2]


def run_states_forward(k, v, s0, z0, lay: Layout, elu: bool):
    """-> states ``(state chunks, H, C, M)``, zstates ``(state chunks, H, C)``, S_N ``(S, H, C, M)``,
    z_N ``(S, H, C)``, all fp32."""
    kern = kernels(interpreting())
    dev, f32 = k.device, torch.float32
    # packed: the rows past the last chunk are read (and discarded) by the programs of the chunk
    # bound's slack; zeros keep them finite
    alloc = torch.zeros if lay.varlen else torch.empty
    states = alloc(lay.state_chunks, lay.heads, lay.c, lay.m, device=dev, dtype=f32)
    zstates = alloc(lay.state_chunks, lay.heads, lay.c, device=dev, dtype=f32)
    s_final = torch.empty(lay.sequences, lay.heads, lay.c, lay.m, device=dev, dtype=f32)
    z_final = torch.empty(lay.sequences, lay.heads, lay.c, device=dev, dtype=f32)
    _launch(kern.chunk_states_forward, "chunk_states_forward", walk_grid(lay),
            k, v, s0 if s0 is not None else s_final, z0 if z0 is not None else z_final, states, zstates, s_final,
            z_final, *_packing(lay, k, table=False), lay.time, lay.heads, *strides(k, lay.head_first),
            *strides(v, lay.head_first), tiny(lay.dtype), HAS_INIT=s0 is not None, **_walk(lay, kern),
            **_common(lay, elu))
    return states, zstates, s_final, z_final


def run_output_forward(q, k, v, states, zstates, lay: Layout, elu: bool, eps: float):
    """-> out (like v: ``empty_like`` keeps v's memory order, so a ``(B, H, N, M)`` view of a
    ``(B, N, H, M)`` tensor gets an output laid out the same way), den ``(B, H, T)`` fp32."""
    kern = kernels(interpreting())
    out = torch.empty_like(v)
    den = torch.empty(lay.batch, lay.heads, lay.time, device=q.device, dtype=torch.float32)
    hf = lay.head_first
    _launch(kern.chunk_output_forward, "chunk_output_forward", chunk_grid(lay, lambda meta: triton.cdiv(lay.m, meta["BV"])),
            q, k, v, out, den, states, zstates, *_packing(lay, q), lay.time, lay.heads, lay.nt, *strides(q, hf),
            *strides(k, hf), *strides(v, hf), *strides(out, hf), tiny(lay.dtype), eps,
            BK=pow2(lay.c, tile(128)), **_fixed(kern, pow2(lay.m, tile())), **_common(lay, elu))
    return out, den


def run_backward(q, k, v, out, den, grad_out, ds_final, dz_final, s0, z0, lay: Layout, elu: bool):
    """-> dq, dk, dv (like q, k, v), dS_0 ``(S, H, C, M)``, dz_0 ``(S, H, C)`` fp32."""
    kern = kernels(interpreting())
    dev, hf = q.device, lay.head_first
    states, zstates, _, _ = run_states_forward(k, v, s0, z0, lay, elu)
    r = torch.empty_like(den)
    bv = pow2(lay.m, tile())
    if lay.dtype == torch.float32:  # the stored output is as exact as a recomputed one
        kern.backward_prepare[programs(triton.cdiv(lay.time, 64), lay.batch * lay.heads)](
            grad_out, out, den, r, lay.time, lay.heads, *strides(grad_out, hf), *strides(out, hf), M=lay.m, BT=64, BV=bv)
    else:
        _launch(kern.chunk_numerator_backward, "chunk_numerator_backward", chunk_grid(lay, lambda meta: 1),
                q, k, v, grad_out, den, r, states, *_packing(lay, q), lay.time, lay.heads, lay.nt, *strides(q, hf),
                *strides(k, hf), *strides(v, hf), *strides(grad_out, hf), tiny(lay.dtype), BK=pow2(lay.c, tile()),
                **_fixed(kern, bv), **_common(lay, elu))
    dstates = torch.zeros_like(states) if lay.varlen else torch.empty_like(states)
    dzstates = torch.zeros_like(zstates) if lay.varlen else torch.empty_like(zstates)
    ds0 = torch.empty(lay.sequences, lay.heads, lay.c, lay.m, device=dev, dtype=torch.float32)
    dz0 = torch.empty(lay.sequences, lay.heads, lay.c, device=dev, dtype=torch.float32)
    has_final = ds_final is not None
    _launch(kern.chunk_states_backward, "chunk_states_backward", walk_grid(lay),
            q, grad_out, den, r, ds_final if has_final else ds0, dz_final if has_final else dz0, dstates, dzstates,
            ds0, dz0, *_packing(lay, q, table=False), lay.time, lay.heads, *strides(q, hf), *strides(grad_out, hf),
            tiny(lay.dtype), HAS_DFINAL=has_final, **_walk(lay, kern), **_common(lay, elu))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bk = pow2(lay.c, tile())
    _launch(kern.chunk_dq_dk_backward, "chunk_dq_dk_backward", chunk_grid(lay, lambda meta: triton.cdiv(lay.c, bk)),
            q, k, v, grad_out, den, r, states, zstates, dstates, dzstates, dq, dk, *_packing(lay, q), lay.time,
            lay.heads, lay.nt, *strides(q, hf), *strides(k, hf), *strides(v, hf), *strides(grad_out, hf),
            *strides(dq, hf), *strides(dk, hf), tiny(lay.dtype), BK=bk, **_fixed(kern, bv), **_common(lay, elu))
    _launch(kern.chunk_dv_backward, "chunk_dv_backward", chunk_grid(lay, lambda meta: triton.cdiv(lay.m, meta["BV"])),
            q, k, grad_out, den, dstates, dv, *_packing(lay, q), lay.time, lay.heads, lay.nt, *strides(q, hf),
            *strides(k, hf), *strides(grad_out, hf), *strides(dv, hf), tiny(lay.dtype), BK=bk, **_fixed(kern, bv),
            **_common(lay, elu))
    return dq, dk, dv, ds0, dz0


def compile_for(capability: tuple[int, int], dtype: torch.dtype, c: int, m: int, chunk: int = 64, varlen: bool = False,
                elu: bool = True) -> dict:
    """Compile every kernel for a GPU of ``capability`` (e.g. ``(9, 0)``) without needing one
    (Triton's own ptxas): ``{kernel name: triton CompiledKernel}`` (``.asm["cubin"]``, ``["ptx"]``,
    ``.metadata.shared``), one config each, pointers and strides 16-divisible as a real launch of
    contiguous tensors sees them (feature strides 1, the others 16-divisible). For checking
    compilation, instructions and registers on a CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    dt, sd = name[dtype], "fp32"
    f32, i32 = "fp32", "i32"
    pointers = dict(Q=dt, K=dt, V=dt, O=dt, DO=dt, DQ=dt, DK=dt, DV=dt, STATES=sd, DSTATES=sd, CU=i32, CHUNK_OFF="i64",
                    CHUNK_TABLE="i64")
    base = dict(C=c, M=m, BT=chunk, ELU=elu, VARLEN=varlen, PREC=dot_precision(dtype))
    bk, bv = pow2(c, tile()), pow2(m, tile())
    walk = dict(BK=pow2(c, 64), BV=pow2(m, 64), INTERPRET=False, MAX_CHUNKS=0)  # the first walk config
    # (constexprs, (warps, stages)): each kernel in the first config of its autotuning space
    kernels_meta = {
        (forward, "chunk_states_forward"): (dict(base, HAS_INIT=True, **walk), (4, 3)),
        (forward, "chunk_output_forward"): (dict(base, BK=pow2(c, tile(128)), BV=bv), (4, 2)),
        (backward, "backward_prepare"): (dict(M=m, BT=64, BV=pow2(m, 64)), (4, 3)),
        (backward, "chunk_numerator_backward"): (dict(base, BK=bk, BV=bv), (8, 2)),
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
            elif arg in ("T", "H", "NT"):
                signature[arg] = i32
            elif re.fullmatch(r"s[a-z]+_d", arg):  # a feature stride: 1, which Triton makes a constant
                signature[arg], constexprs = "constexpr", {**constexprs, arg: 1}
            elif re.fullmatch(r"s[a-z]+_[bht]", arg):
                signature[arg], attrs[(i,)] = i32, [["tt.divisibility", 16]]
            else:  # a pointer: the tensors above, fp32 for states, normalisers and their gradients
                signature[arg], attrs[(i,)] = "*" + pointers.get(arg, f32), [["tt.divisibility", 16]]
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
        compiled[kernel] = triton.compile(source, target=target, options=dict(num_warps=warps, num_stages=stages))
    return compiled
