"""Compiling and launching the Triton kernels of ``forward.py`` and ``backward.py``.

The kernels are wrapped with ``triton.jit`` on first use, once per mode: under
``TRITON_INTERPRET=1`` (set before triton is first imported, when triton.language and the jitted
helpers take their mode; ``tests/conftest.py`` does) Triton's interpreter runs them on CPU tensors.

One forward is ``superchunk_deltas`` (more than one super-chunk per sequence) and
``superchunk_forward``; one backward ``superchunk_backward_prepare``, ``superchunk_dq`` and
``superchunk_dk_dv``: at most 2 + 3 launches, 1 + 3 when one super-chunk per sequence fills the GPU.
Each kernel has one config chosen from the shape (``config``), not autotuned: nothing is timed on
a first call, and a run is the same on every GPU of a kind.

The first launch of a kernel at a specialisation (constexprs, dtypes, the 16-alignments Triton
specialises on) goes through ``JITFunction.run``, which compiles; later launches call the compiled
kernel directly, without Triton's per-call argument binding and cache-key hashing
(``LINFORMER_LAB_TRITON_LAUNCH=jit`` turns that off). :func:`compile_report` lists the compilations.

Nothing here reads a device tensor on the host: grids come from shapes alone (packed sequences
get an upper bound on their super-chunks), so a launch never waits for the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import time
from types import SimpleNamespace

import torch
import triton

from linformer_lab.ops.cuda.triton_chunk import backward, forward, step_kernel

_HALF = (torch.float16, torch.bfloat16)
#: CUDA's limit on a grid's x dimension; the kernels' grids are one-dimensional (y and z stop at 65,535)
MAX_PROGRAMS = 2**31 - 1
#: Programs per SM the super-chunk walks aim for: two keep an SM busy while one waits on memory.
PROGRAMS_PER_SM = 2
#: Under the interpreter (no SMs): programs wanted, small so that tests walk several super-chunks.
INTERPRETER_PROGRAMS = 4
#: bf16 parts of an fp32 operand (``forward.dot_exact_fp32``): three keep fp32's 24 bits, which
#: the cancelling terms of dq and dk need (``backward.py``)
BF16_PARTS = 3
#: Every Triton kernel (name -> its module): :func:`kernels` jits these and :func:`compile_for` compiles
#: them for a GPU without one (docs/ARCHITECTURE.md, "Where to add": a GPU kernel)
KERNELS = {"superchunk_deltas": forward, "superchunk_forward": forward, "superchunk_backward_prepare": backward,
           "superchunk_dq": backward, "superchunk_dk_dv": backward, "linear_attention_step": step_kernel}


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """Triton's precision for the products with an fp32 operand not split into bf16 parts: for fp16
    ``tf32x3``, as exact as fp32 (the backward subtracts nearly equal terms; ``backward.py``); for
    fp32 what ``torch.set_float32_matmul_precision`` asks: tf32, or ``tf32x3`` for "highest"."""
    if dtype in _HALF or torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def bf16_parts(dtype: torch.dtype) -> int:
    """bf16 parts per fp32 operand: bf16 inputs only (the other operand is then bf16-exact)."""
    return BF16_PARTS if dtype == torch.bfloat16 else 0


def tiny(dtype: torch.dtype) -> float:
    """The floor of phi: the smallest normal number for half dtypes (as the elu feature map
    clamps them), 0 for fp32 (phi >= 0 already)."""
    return float(torch.finfo(dtype).tiny) if dtype in _HALF else 0.0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (``triton.cdiv`` is a jitted function: a slow call on the host)."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The tile covering n: a power of two, at least 16 (the smallest ``tl.dot`` side). Whole
    widths are read by one program (up to ``op.MAX_WIDTH``)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def programs(*counts: int) -> tuple[int]:
    """The one-dimensional grid of ``counts`` folded together (each kernel unfolds its program
    index); at most :data:`MAX_PROGRAMS`, far more than any tensor that fits a GPU needs."""
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


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_wanted(device: torch.device) -> int:
    """How many programs a walk should have: PROGRAMS_PER_SM per SM on a GPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def superchunk_length(chunks: int, rows: int, chunk: int, wanted: int) -> int:
    """Positions per super-chunk: a whole number of chunks, as long as it can be while rows x
    super-chunks reaches ``wanted`` programs (each walk is serial over its chunks, so more
    super-chunks only pay until the GPU is full); the super-chunks a power of two per sequence."""
    split = 1
    while split * rows < wanted and split < chunks:
        split *= 2
    return cdiv(max(chunks, 1), split) * chunk


class Layout(SimpleNamespace):
    """What every launch shares: the sequences, the chunking and the super-chunks.

    ``sequences`` S (B, or len(cu_seqlens) - 1); ``ls`` positions per super-chunk; ``nsc`` the
    super-chunk slots per grid row: cdiv(T, ls), packed an upper bound on all sequences'
    super-chunks, cdiv(T, ls) + S; ``rows`` the grid rows (S H, packed H); ``slots`` the delta rows
    per head; ``ns_max`` a bound on any sequence's super-chunks (the interpreter's loops).
    Packed (VARLEN): ``cu`` the offsets as given, ``offsets`` ``(S + 1,)`` the first global
    super-chunk of each sequence, ``table`` ``(nsc, 2)`` global super-chunk -> (sequence,
    super-chunk in it), all built on the device."""


def layout(q, v, cu_seqlens, chunk: int, head_first: bool, ls: int | None = None) -> Layout:
    b, t = q.shape[0], q.shape[2] if head_first else q.shape[1]
    h, c, m = q.shape[1] if head_first else q.shape[2], q.shape[-1], v.shape[-1]
    sequences = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    rows = b * h if cu_seqlens is None else h
    if ls is None:
        ls = superchunk_length(cdiv(t, chunk), rows, chunk, programs_wanted(q.device))
    per_sequence = cdiv(t, ls)
    common = dict(batch=b, heads=h, time=t, c=c, m=m, chunk=chunk, ls=ls, head_first=head_first, sequences=sequences,
                  rows=rows, ns_max=max(per_sequence, 1), dtype=q.dtype)
    if cu_seqlens is None:
        return Layout(varlen=False, cu=None, offsets=None, table=None, nsc=per_sequence, slots=b * per_sequence,
                      **common)
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + ls - 1) // ls
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    nsc = per_sequence + sequences  # each sequence adds at most one partial super-chunk
    ids = torch.arange(nsc, device=cu_seqlens.device, dtype=offsets.dtype)
    # the sequence of each super-chunk (empty sequences skipped); past the last one the last
    # sequence, at a super-chunk past its end: those programs find every position masked
    owner = torch.searchsorted(offsets[1:], ids, right=True).clamp_(max=sequences - 1)
    table = torch.stack([owner, ids - offsets[owner]], dim=1)
    return Layout(varlen=True, cu=cu_seqlens, offsets=offsets, table=table, nsc=nsc, slots=nsc, **common)


@functools.cache
def config(name: str, c: int, m: int) -> dict:
    """The launch config of kernel ``name`` at a layout. Feature and value tiles (BK, BV) of at most
    64 x 64 per program's state tile, so that the fp32 state and its bf16 parts stay in registers
    (at C = M = 128 wider tiles spill: ``tests/ops/test_triton_chunk_gpu.py`` compiles for Hopper
    and checks); KF, MF the full padded widths a tile's program reads; warps by tile size."""
    kf, mf = pow2(c), pow2(m)
    if name == "linear_attention_step":  # whole C x M tiles, in the warps step.py launches with (Triton's default)
        return dict(BC=kf, BM=mf, num_warps=4, num_stages=3)
    if name == "superchunk_dq":  # rows of the state: a feature tile x all of M
        bk, bv = min(kf, max(16, 2048 // mf)), mf
    elif name == "superchunk_dk_dv":  # feature tiles x all of M (dk), all of C x value tiles (dv)
        bk, bv = min(kf, max(16, 2048 // mf)), min(mf, max(16, 2048 // kf))
    else:  # all of C x value tiles
        bk, bv = kf, min(mf, max(16, 4096 // kf))
    return dict(BK=bk, BV=bv, KF=kf, MF=mf, num_warps=8 if max(kf, mf) >= 128 else 4, num_stages=2)


#: ``LINFORMER_LAB_TRITON_LAUNCH=jit``: every launch through Triton's JITFunction.run (read once)
_DIRECT = os.environ.get("LINFORMER_LAB_TRITON_LAUNCH", "direct") != "jit"


@functools.cache
def kernels(interpret: bool) -> SimpleNamespace:
    """The kernels compiled for one mode (the interpreter or the GPU), the generation step's included."""
    return SimpleNamespace(**{name: triton.jit(getattr(module, name)) for name, module in KERNELS.items()})


#: (kernel, key, config, seconds) of every compilation this process ran through ``_launch``
_COMPILES: list[dict] = []
#: specialisation -> compiled kernel of the direct launch path
_COMPILED: dict[tuple, object] = {}


def compile_report() -> list[dict]:
    """Every compilation so far: ``{"kernel", "key" (C, M, chunk, dtype, ...), "config", "seconds"}``."""
    return list(_COMPILES)


def _specialisation(args) -> tuple:
    """What Triton specialises a launch on, for the runtime arguments: each tensor's dtype and
    16-byte alignment, each integer's 1 / 16-divisibility / 32-bit range (floats: nothing)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(None)
        else:
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
    return tuple(key)


def _launch(name: str, launch: tuple, args: tuple, interpret: bool):
    """Launch kernel ``name`` with the runtime ``args`` in its order and its ``plan`` entry
    ``(grid, constexprs, meta)``."""
    grid, constexprs, meta = launch
    kern = getattr(kernels(interpret), name)
    if interpret or not _DIRECT:
        kern[grid](*args, **constexprs, **({} if interpret else meta))
        return
    key = (name, tuple(constexprs.items()), tuple(meta.items()), _specialisation(args))
    compiled = _COMPILED.get(key)
    if compiled is None:
        # the direct call passes the constexprs by position: they must come in the kernel's order
        order = [arg for arg in kern.arg_names if arg in constexprs]
        if order != list(constexprs):
            raise RuntimeError(f"{name}: constexprs {list(constexprs)} not in the kernel's order {order}")
        began = time.perf_counter()
        compiled = kern[grid](*args, **constexprs, **meta)
        _COMPILED[key] = compiled
        _COMPILES.append(dict(kernel=name, key=key[1], config=str(meta), seconds=time.perf_counter() - began))
        return
    compiled[grid](*args, *constexprs.values())


def _packing(lay: Layout, anchor: torch.Tensor):
    """CU, SC_OFF, SC_TABLE arguments: the packing's tensors, or any pointer unpacked."""
    return (lay.cu, lay.offsets, lay.table) if lay.varlen else (anchor, anchor, anchor)


def _sequence_state(lay: Layout, like: torch.Tensor, initial: torch.Tensor | None, vector: bool):
    """A per-sequence state buffer ``(S, H, C, M)`` (or ``(S, H, C)``) fp32 that the kernels fill:
    packed, the empty sequences' rows (no program visits them) start as ``initial`` (or 0)."""
    shape = (lay.sequences, lay.heads, lay.c) if vector else (lay.sequences, lay.heads, lay.c, lay.m)
    if not lay.varlen:
        return like.new_empty(shape, dtype=torch.float32)
    return initial.clone() if initial is not None else like.new_zeros(shape, dtype=torch.float32)


def _meta(cfg: dict) -> dict:
    return dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


#: Programs per (super-chunk, row) of each kernel of a forward and backward, from its config
_TILES = {
    "superchunk_deltas": lambda c, m, cfg: cdiv(m, cfg["BV"]),
    "superchunk_forward": lambda c, m, cfg: cdiv(m, cfg["BV"]),
    "superchunk_backward_prepare": lambda c, m, cfg: cdiv(m, cfg["BV"]),
    "superchunk_dq": lambda c, m, cfg: cdiv(c, cfg["BK"]),
    "superchunk_dk_dv": lambda c, m, cfg: cdiv(c, cfg["BK"]) + cdiv(m, cfg["BV"]),  # dk's tiles, then dv's
}


@functools.cache
def _constexpr_names(name: str) -> tuple[str, ...]:
    """Kernel ``name``'s constexpr parameters, in its order (the direct launch passes them by position)."""
    parameters = inspect.signature(getattr(KERNELS[name], name)).parameters.values()
    return tuple(p.name for p in parameters if getattr(p.annotation, "__name__", None) == "constexpr")


def constexprs(name: str, values: dict) -> dict:
    """The constexprs of kernel ``name`` taken from ``values`` (a config and flags), in its order."""
    return {arg: values[arg] for arg in _constexpr_names(name)}


@functools.lru_cache(maxsize=1024)
def plan(lay_key: tuple, elu: bool, with_state: bool, prec: str, interpret: bool) -> dict:
    """Every launch decision of a shape, made once: ``{kernel: (grid, constexprs, meta)}`` of the
    forward's and the backward's kernels. ``lay_key``: :func:`plan_key`; ``with_state``: an initial
    state (forward and the dq walk) or a final state's gradient (the dk/dv walk)."""
    c, m, chunk, ls, nsc, rows, ns_max, dtype, varlen = lay_key
    flags = dict(C=c, M=m, BT=chunk, LS=ls, ELU=elu, VARLEN=varlen, PREC=prec, PARTS=bf16_parts(dtype),
                 HAS_INIT=with_state, HAS_DFINAL=with_state, NS_MAX=ns_max, INTERPRET=interpret,
                 STORE_F32=dtype in _HALF, DELTAS=ns_max > 1)
    launches = {}
    for name, tiles in _TILES.items():
        cfg = config(name, c, m)
        launches[name] = (programs(tiles(c, m, cfg), nsc, rows), constexprs(name, dict(flags, **cfg)), _meta(cfg))
    return launches


def plan_key(lay: Layout) -> tuple:
    """What of a layout its launches depend on (not its tensors)."""
    return (lay.c, lay.m, lay.chunk, lay.ls, lay.nsc, lay.rows, lay.ns_max, lay.dtype, lay.varlen)


def run_forward(q, k, v, s0, z0, lay: Layout, elu: bool, eps: float):
    """-> out (like v: ``empty_like`` keeps v's memory order), den ``(B, H, T)`` fp32, S_N
    ``(S, H, C, M)``, z_N ``(S, H, C)`` fp32, the super-chunk deltas ``(slots H, C, M)``,
    ``(slots H, C)`` fp32 the backward starts its walks from (0 rows with one super-chunk per
    sequence), and for half inputs the output before rounding ``(B, H, T, M)`` fp32 (else 0 rows)."""
    hf, f32, dev = lay.head_first, torch.float32, q.device
    interpret = interpreting()
    launches = plan(plan_key(lay), elu, s0 is not None, dot_precision(lay.dtype), interpret)
    slots = lay.slots if lay.ns_max > 1 else 0
    ds = torch.empty(slots * lay.heads, lay.c, lay.m, device=dev, dtype=f32)
    dz = torch.empty(slots * lay.heads, lay.c, device=dev, dtype=f32)
    packing, small = _packing(lay, q), tiny(lay.dtype)
    if slots:
        _launch("superchunk_deltas", launches["superchunk_deltas"],
                (k, v, ds, dz, *packing, lay.time, lay.heads, lay.nsc, *strides(k, hf), *strides(v, hf), small),
                interpret)
    out = torch.empty_like(v)
    out32 = torch.empty(lay.batch if lay.dtype in _HALF else 0, lay.heads, lay.time, lay.m, device=dev, dtype=f32)
    den = torch.empty(lay.batch, lay.heads, lay.time, device=dev, dtype=f32)
    s_n = _sequence_state(lay, q, s0, vector=False)
    z_n = _sequence_state(lay, q, z0, vector=True)
    _launch("superchunk_forward", launches["superchunk_forward"],
            (q, k, v, out, out32, den, s0 if s0 is not None else s_n, z0 if z0 is not None else z_n, ds, dz, s_n, z_n,
             *packing, lay.time, lay.heads, lay.nsc, *strides(q, hf), *strides(k, hf), *strides(v, hf),
             *strides(out, hf), small, eps), interpret)
    return out, den, s_n, z_n, ds, dz, out32


def run_backward(q, k, v, out, den, grad_out, ds_final, dz_final, s0, z0, ds, dz, out32, lay: Layout, elu: bool):
    """-> dq, dk, dv (like q, k, v), dS_0 ``(S, H, C, M)``, dz_0 ``(S, H, C)`` fp32. From the forward:
    ``out`` and ``den``, the super-chunk deltas ``ds``, ``dz``, ``out32`` (half inputs: the output
    before rounding, which r is taken from; fp32: ``out`` is)."""
    hf, f32, dev = lay.head_first, torch.float32, q.device
    interpret = interpreting()
    key, prec = plan_key(lay), dot_precision(lay.dtype)
    packing, small = _packing(lay, q), tiny(lay.dtype)
    exact_out = (out32, strides(out32, True)) if lay.dtype in _HALF else (out, strides(out, hf))
    r = torch.empty_like(den)
    dh = torch.empty(ds.shape, device=dev, dtype=f32)
    dhz = torch.empty(lay.slots * lay.heads, lay.c, device=dev, dtype=f32)
    _launch("superchunk_backward_prepare", plan(key, elu, False, prec, interpret)["superchunk_backward_prepare"],
            (q, grad_out, exact_out[0], den, r, dh, dhz, *packing, lay.time, lay.heads, lay.nsc, *strides(q, hf),
             *strides(grad_out, hf), *exact_out[1], small), interpret)
    dq = torch.empty_like(q)
    _launch("superchunk_dq", plan(key, elu, s0 is not None, prec, interpret)["superchunk_dq"],
            (q, k, v, grad_out, den, r, s0 if s0 is not None else dhz, z0 if z0 is not None else dhz, ds, dz, dq,
             *packing, lay.time, lay.heads, lay.nsc, *strides(q, hf), *strides(k, hf), *strides(v, hf),
             *strides(grad_out, hf), *strides(dq, hf), small), interpret)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    ds0 = _sequence_state(lay, q, ds_final, vector=False)
    dz0 = _sequence_state(lay, q, dz_final, vector=True)
    has_final = ds_final is not None
    _launch("superchunk_dk_dv", plan(key, elu, has_final, prec, interpret)["superchunk_dk_dv"],
            (q, k, v, grad_out, den, r, ds_final if has_final else ds0, dz_final if has_final else dz0, dh, dhz, dk, dv,
             ds0, dz0, *packing, lay.time, lay.heads, lay.nsc, *strides(q, hf), *strides(k, hf), *strides(v, hf),
             *strides(grad_out, hf), *strides(dk, hf), *strides(dv, hf), small), interpret)
    return dq, dk, dv, ds0, dz0


def compile_for(capability: tuple[int, int], dtype: torch.dtype, c: int, m: int, chunk: int = 64, varlen: bool = False,
                elu: bool = True, ls: int = 1024) -> dict:
    """Compile every kernel for a GPU of ``capability`` (e.g. ``(9, 0)``) without needing one
    (Triton's own ptxas): ``{kernel name: triton CompiledKernel}`` (``.asm["cubin"]``, ``["ptx"]``,
    ``.metadata.shared``), each in the config ``config`` gives it, pointers and strides 16-divisible
    as a real launch of contiguous tensors sees them (feature strides 1, the others 16-divisible).
    For checking compilation, instructions and registers on a CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    dt = name[dtype]
    flags = dict(C=c, M=m, BT=chunk, LS=ls, ELU=elu, VARLEN=varlen, PREC=dot_precision(dtype), PARTS=bf16_parts(dtype),
                 HAS_INIT=True, HAS_DFINAL=True, NS_MAX=0, INTERPRET=False, STORE_F32=dtype in _HALF, DELTAS=True)
    pointers = dict(Q=dt, K=dt, V=dt, O=dt, OUT=dt, DO=dt, O32="fp32", DQ=dt, DK=dt, DV=dt, CU="i32", SC_OFF="i64",
                    SC_TABLE="i64")
    compiled = {}
    for kernel, module in KERNELS.items():
        fn = triton.jit(getattr(module, kernel))
        cfg = config(kernel, c, m)
        kernel_constexprs = constexprs(kernel, dict(flags, **cfg))  # a new kernel's own config keys included
        signature, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in kernel_constexprs:
                signature[arg] = "constexpr"
            elif arg in ("tiny", "eps"):
                signature[arg] = "fp32"
            elif arg in ("T", "H", "NSC"):
                signature[arg] = "i32"
            elif re.fullmatch(r"s[a-z]+_d", arg):  # a feature stride: 1, which Triton makes a constant
                signature[arg], kernel_constexprs = "constexpr", {**kernel_constexprs, arg: 1}
            elif re.fullmatch(r"s[a-z]+_[bht]", arg):
                signature[arg], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
            else:  # a pointer: the tensors above, fp32 for states, normalisers and their gradients
                signature[arg], attrs[(i,)] = "*" + pointers.get(arg, "fp32"), [["tt.divisibility", 16]]
        source = ASTSource(fn=fn, signature=signature, constexprs=kernel_constexprs, attrs=attrs)
        target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
        compiled[kernel] = triton.compile(source, target=target, options=_meta(cfg))
    return compiled
