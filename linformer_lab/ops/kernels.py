"""Which kernel computes each op: the one place that decides (docs/ARCHITECTURE.md, "Where speed
code goes").

Every op has an ordered list of :class:`Candidate` s in :data:`CANDIDATES`; :func:`select` returns
the first one whose condition holds for the op's arguments. The last is always the PyTorch
reference, which runs anywhere; every kernel is tested equal to it.

====================  ====================================  =========================================
op                    candidates, first to last             called from
====================  ====================================  =========================================
``causal``            cuda, recurrence, reference           :func:`causal_dot_product` (the numerator
                                                            of eq. 9, ``ops.linear_attention``)
``lsh_window``        cpp, reference                        ``ops/lsh.py``'s ``window_attention``
``fused_step``        cpp, reference                        ``models/fused_step.py`` (generation)
``causal_attention``  triton, cpp, reference                ``attention/linear.py``: eq. 9-12 with
                                                            the feature map, numerator and normaliser
                                                            in one kernel (GPU: ``ops/cuda/triton_chunk``;
                                                            CPU: ``ops/cpu/causal_recurrence.cpp``),
                                                            packed sequences (``cu_seqlens``) included
====================  ====================================  =========================================

**The switch.** ``LINFORMER_LAB_KERNELS`` (read at every selection, parsed once per value):
unset or ``auto`` chooses by the conditions; ``reference`` forces every op's PyTorch reference;
``op=name`` forces one op's candidate, comma-separated for several (``causal=chunk``,
``causal=reference,lsh_window=reference``): the forced candidate runs wherever its condition holds,
the reference elsewhere. A value naming no op or candidate is a ValueError listing the valid ones.
A caller may force a candidate for one call the same way (``select(..., force=name)``, over the
switch): a backend's ``forced_kernels`` (``linear_cuda``'s GPU kernels).

**Adding a kernel** (a GPU one, say): write a function with the op's signature (the reference's
beside it in this file says it) and a condition on the op's arguments, and put a
:class:`Candidate` into the op's list in :data:`CANDIDATES`, before the candidates it should win
over; the reference stays last. Import the kernel's module inside the functions, as the others do:
building or importing a kernel costs only where it may run. ``describe()`` and
``cli.py plugins --check`` then name it, and the switch can force it by its name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CANDIDATES", "FUSED_MAX_BATCH", "REFERENCE", "SWITCH", "Candidate", "causal_dot_product", "cuda_kernel",
           "describe", "forced", "reference", "select", "switched"]

#: The environment variable that forces candidates (module docstring).
SWITCH = "LINFORMER_LAB_KERNELS"
#: The name of every op's last candidate, the PyTorch reference.
REFERENCE = "reference"
#: The fused C++ step runs batches of at most this many rows: its gain, the per-operation cost,
#: shrinks as a batch spreads it over more arithmetic, and its plain loops are not vectorized as
#: ATen's kernels are.
FUSED_MAX_BATCH = 16

_CPU_DTYPES = (torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The CUDA kernel's largest C and M (its shared-memory tiles).
_CUDA_MAX_DIM = 256


@dataclass
class Candidate:
    """One way to compute an op.

    ``name``: what the switch calls it; ``description``: what it is, for people; ``condition``:
    when it applies, for people; ``accepts(*args)``: that condition on the op's arguments (device,
    dtype, autocast, shapes); ``available()``: whether its build can be had on this machine (may
    build it on the first call; False, with one warning, where it cannot); ``run``: the op itself;
    ``detail()``: what :func:`describe` adds (the instruction set in use), or None.
    """

    name: str
    description: str
    condition: str
    accepts: Callable[..., bool]
    available: Callable[[], bool]
    run: Callable
    detail: Callable[[], str] | None = None

    def applies(self, *args) -> bool:
        return self.accepts(*args) and self.available()


# ---------------------------------------------------------------- conditions


def _cpu_inputs(*tensors) -> bool:
    """All on CPU (Nones skipped), the first one float32 or float64, CPU autocast off: what the lsh and
    fused-step C++ kernels take (the callers check that the inputs share the first one's dtype)."""
    present = [t for t in tensors if t is not None]
    dtype = present[0].dtype
    return (dtype in _CPU_DTYPES and not torch.is_autocast_enabled("cpu")
            and all(t.device.type == "cpu" for t in present))


def _causal_cpu(q, k, v, initial_state=None) -> bool:
    """CPU tensors, q, k, v of one dtype, under CPU autocast too: the recurrence runs float16 and
    bfloat16 as float32, as the reference does (``ops/linear_attention/cpu_kernel.py``)."""
    tensors = [t for t in (q, k, v, initial_state) if t is not None]
    return (q.dtype == k.dtype == v.dtype and q.dtype in _CPU_DTYPES + _HALF_DTYPES
            and all(t.device.type == "cpu" for t in tensors))


def _causal_cuda(q, k, v, initial_state=None) -> bool:
    tensors = [t for t in (q, k, v, initial_state) if t is not None]
    return (q.device.type == "cuda" and all(t.device == q.device for t in tensors)
            and q.dtype == k.dtype == v.dtype and q.dtype in _CUDA_DTYPES and q.numel() > 0
            and 1 <= q.shape[-1] <= _CUDA_MAX_DIM and 1 <= v.shape[-1] <= _CUDA_MAX_DIM)


def _lsh_cpu(q, k, v) -> bool:
    return q.dtype == k.dtype == v.dtype and _cpu_inputs(q, k, v)


def _fused_cpu(x_t) -> bool:
    return x_t.shape[0] <= FUSED_MAX_BATCH and _cpu_inputs(x_t)


def _everywhere(*args) -> bool:
    return True


# ---------------------------------------------------------------- builds


def _cpu_module(name: str):
    """The C++ extension ``linformer_lab.ops.cpu.<name>``'s module, None where it cannot be built."""
    from linformer_lab.ops import cpu

    return getattr(cpu, name).module()


def _cpu_available(name: str) -> Callable[[], bool]:
    # torch.compile traces the call as its value: whether the build can be had is settled once per process
    return torch.compiler.assume_constant_result(lambda: _cpu_module(name) is not None)


def _cpu_isa(name: str) -> Callable[[], str]:
    return lambda: _cpu_module(name).instruction_set()


@functools.cache
def cuda_kernel():
    """``linformer_lab.ops.cuda`` where its kernel runs here (a CUDA GPU, the extension cached or
    built now), else None; tried once per process, a failed build warned once."""
    from linformer_lab.ops import cuda

    if not cuda.is_available():
        return None
    try:
        cuda.load()
    except RuntimeError as error:
        warnings.warn(f"{error}; the causal linear-attention numerator on CUDA keeps to the PyTorch reference",
                      RuntimeWarning, stacklevel=2)
        return None
    return cuda


# ---------------------------------------------------------------- the ops' implementations


def _causal_reference(q, k, v, chunk_size=None, initial_state=None, return_final_state=False):
    """The op's signature: ``(B, H, N, C), (B, H, N, C), (B, H, N, M)`` -> ``(B, H, N, M)`` (and
    S_N with ``return_final_state``); :mod:`linformer_lab.ops.linear_attention.chunk`."""
    from linformer_lab.ops.linear_attention.chunk import CausalDotProduct

    return CausalDotProduct.apply(q, k, v, chunk_size, initial_state, return_final_state)


def _causal_recurrence(q, k, v, chunk_size=None, initial_state=None, return_final_state=False):
    from linformer_lab.ops.linear_attention import cpu_kernel

    return cpu_kernel.causal_dot_product(q, k, v, chunk_size, initial_state, return_final_state)


def _causal_cuda_run(q, k, v, chunk_size=None, initial_state=None, return_final_state=False):
    from linformer_lab.ops import cuda  # loaded: the candidate applies only where cuda_kernel() loaded it

    return cuda.causal_dot_product(q, k, v, initial_state, return_final_state)


def _lsh_window(implementation: str) -> Callable:
    """``(q, k, v, positions, valid, chunks, causal) -> (out, lse)``: ``ops/lsh.py``'s ``window_attention``."""
    def run(*args):
        from linformer_lab.ops import lsh

        return getattr(lsh, implementation)(*args)

    return run


def _fused_stack(*args):
    """``(weights, norm eps, heads, query dim, value dim, eps, GELU approximate)`` -> the C++
    ``FusedStack`` (``models/fused_step.py``); the reference has none: ``fast_step``'s Python path."""
    return _cpu_module("FUSED_STEP").FusedStack(*args)


def _causal_attention_reference(feature_map, q, k, v, key_lengths, eps, dot_product, initial_state=None,
                                return_state=False, cu_seqlens=None):
    """The op's signature: causal eq. 9-12 from the unmapped ``q, k (B, H, N, D)``, ``v (B, H, N, M)``
    with the backend's ``feature_map`` and numerator ``dot_product``: the feature map, then
    :func:`~linformer_lab.ops.linear_attention.causal_linear_attention`; with ``cu_seqlens`` (packed
    sequences, B = 1) :func:`~linformer_lab.ops.linear_attention.packed_linear_attention` instead, in
    one pass. A fused candidate computes the same in one kernel for the maps it knows (its
    ``accepts(feature_map, q, k, v)`` says which)."""
    from linformer_lab.ops.linear_attention import causal_linear_attention, packed_linear_attention

    phi_q, phi_k = feature_map.forward_queries(q), feature_map.forward_keys(k)
    if cu_seqlens is not None:
        return packed_linear_attention(phi_q, phi_k, v, cu_seqlens, True, eps, initial_state, return_state)
    return causal_linear_attention(phi_q, phi_k, v, key_lengths, eps, dot_product, initial_state, return_state)


def _causal_attention_triton(feature_map, q, k, v) -> bool:
    from linformer_lab.ops.cuda.triton_chunk import backend

    return backend.accepts(feature_map, q, k, v)


def _causal_attention_triton_run(*args):
    """The reference's arguments on the Triton chunk kernel (``ops/cuda/triton_chunk/backend.py``)."""
    from linformer_lab.ops.cuda.triton_chunk import backend

    return backend.causal_attention(*args)


def _causal_attention_cpu(feature_map, q, k, v) -> bool:
    from linformer_lab.ops.linear_attention import cpu_kernel

    return cpu_kernel.accepts_attention(feature_map, q, k, v)


def _causal_attention_cpu_run(*args, **kwargs):
    """The reference's arguments on the fused C++ kernel (``ops/linear_attention/cpu_kernel.py``)."""
    from linformer_lab.ops.linear_attention import cpu_kernel

    return cpu_kernel.causal_attention(*args, **kwargs)


def _bf16_accepts(feature_map, q, k, v) -> bool:
    """The bf16 path's inputs, and unforced only where it pays (``ops/cpu/bf16_chunk.py``)."""
    from linformer_lab.ops.cpu import bf16_chunk

    return bf16_chunk.accepts(feature_map, q, k, v) and (bf16_chunk.pays_here() or _forced_name("causal_attention") == "bf16")


def _bf16_available() -> bool:
    from linformer_lab.ops.cpu import bf16_chunk

    return bf16_chunk.available()


def _bf16_run(*args, **kwargs):
    from linformer_lab.ops.cpu import bf16_chunk

    return bf16_chunk.causal_attention(*args, **kwargs)


def _bf16_units() -> str:
    from linformer_lab.ops.cpu import bf16_chunk

    return f"matrix units: {bf16_chunk.matrix_units()}"


def _triton_available() -> bool:
    from linformer_lab.ops.cuda import triton_chunk

    return triton_chunk.is_available()


_ALWAYS = "always"

#: op -> its candidates, first to last; the reference is last (module docstring: adding a kernel).
CANDIDATES: dict[str, list[Candidate]] = {
    "causal": [
        Candidate("cuda", "CUDA kernel (ops/cuda/causal_linear_attention.cu)",
                  "CUDA tensors of one dtype (float32, float16, bfloat16), 1 <= C, M <= 256, the extension built",
                  _causal_cuda, torch.compiler.assume_constant_result(lambda: cuda_kernel() is not None), _causal_cuda_run),
        Candidate("recurrence", "C++ recurrence (ops/cpu/causal_recurrence.cpp)",
                  "CPU tensors of one dtype (float16, bfloat16 run as float32; CPU autocast too), C, M "
                  "zero-padded to whole registers",
                  _causal_cpu, _cpu_available("CAUSAL_RECURRENCE"), _causal_recurrence, _cpu_isa("CAUSAL_RECURRENCE")),
        Candidate(REFERENCE, "PyTorch chunked reference (ops/linear_attention/chunk.py)", _ALWAYS,
                  _everywhere, lambda: True, _causal_reference),
    ],
    "lsh_window": [
        Candidate("cpp", "C++ window kernel (ops/cpu/lsh_window.cpp)",
                  "CPU tensors, float32 or float64, CPU autocast off",
                  _lsh_cpu, _cpu_available("LSH_WINDOW"), _lsh_window("window_attention_cpp"), _cpu_isa("LSH_WINDOW")),
        Candidate(REFERENCE, "PyTorch window step (ops/lsh.py: window_attention_torch)", _ALWAYS,
                  _everywhere, lambda: True, _lsh_window("window_attention_torch")),
    ],
    "fused_step": [
        Candidate("cpp", "C++ fused step (ops/cpu/fused_step.cpp)",
                  f"CPU, float32 or float64, CPU autocast off, at most {FUSED_MAX_BATCH} rows "
                  "(and a stack of the form models/fused_step.py checks)",
                  _fused_cpu, _cpu_available("FUSED_STEP"), _fused_stack),
        Candidate(REFERENCE, "Python step (models/generation.py: fast_step)", _ALWAYS,
                  _everywhere, lambda: True, lambda *args: None),
    ],
    "causal_attention": [
        Candidate("triton", "Triton chunk kernel, elu and the normaliser fused (ops/cuda/triton_chunk)",
                  "CUDA tensors, v float32, float16 or bfloat16, Triton and compute capability >= 8.0 (the elu "
                  "map runs inside the kernel; other maps, and elu with key_lengths, are applied first)",
                  _causal_attention_triton, _triton_available, _causal_attention_triton_run),
        Candidate("bf16", "bf16 chunked form, oneDNN GEMMs, float32 state (ops/cpu/bf16_chunk.py)",
                  "bfloat16 CPU tensors, the elu map, a CPU with AMX (AVX-512-BF16 alone: forced only)",
                  _bf16_accepts, _bf16_available, _bf16_run, _bf16_units),
        Candidate("cpp", "C++ recurrence, elu and the normaliser fused (ops/cpu/causal_recurrence.cpp)",
                  "CPU tensors of one dtype (float16, bfloat16 run as float32; CPU autocast too), the elu map "
                  "(other maps are applied first and take the causal op), C, M zero-padded to whole registers",
                  _causal_attention_cpu, _cpu_available("CAUSAL_RECURRENCE"), _causal_attention_cpu_run,
                  _cpu_isa("CAUSAL_RECURRENCE")),
        Candidate(REFERENCE, "feature map, then the causal op and the normaliser in PyTorch", _ALWAYS,
                  _everywhere, lambda: True, _causal_attention_reference),
    ],
}


# ---------------------------------------------------------------- the switch and the choice


@contextlib.contextmanager
def switched(value: str):
    """``LINFORMER_LAB_KERNELS=value`` within the block, as it was after (read at every selection)."""
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = before


def forced() -> dict[str, str]:
    """op -> the candidate ``LINFORMER_LAB_KERNELS`` forces (empty: every op by its conditions)."""
    return _parse_switch(os.environ.get(SWITCH, ""))


@functools.lru_cache(maxsize=16)
def _parse_switch(value: str) -> dict[str, str]:
    choice: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if item in ("", "auto"):
            continue
        if item == REFERENCE:
            choice.update({op: REFERENCE for op in CANDIDATES})
            continue
        op, equals, name = (part.strip() for part in item.partition("="))
        if not equals or op not in CANDIDATES:
            raise ValueError(f"{SWITCH}={value!r}: {item!r} is not 'auto', 'reference' or op=kernel with an op among "
                             f"{', '.join(CANDIDATES)}")
        names = [candidate.name for candidate in CANDIDATES[op]]
        if name not in names:
            raise ValueError(f"{SWITCH}={value!r}: op {op!r} has no kernel {name!r}; its kernels: {', '.join(names)}")
        choice[op] = name
    return choice


@torch.compiler.assume_constant_result  # torch.compile reads the switch when it traces, as its value
def _forced_name(op: str) -> str | None:
    return forced().get(op)


def select(op: str, *args, force: str | None = None) -> Candidate:
    """The candidate that computes ``op`` for these arguments (those of its candidates' ``accepts``):
    the first that applies, or under the switch the forced one where it applies; the reference
    otherwise. ``force`` names a candidate as the switch would, for this call only, over the
    switch (``linear_cuda`` forces the GPU kernels this way)."""
    if op not in CANDIDATES:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(CANDIDATES)}")
    if force is not None and force not in (names := [candidate.name for candidate in CANDIDATES[op]]):
        raise ValueError(f"op {op!r} has no kernel {force!r} to force; its kernels: {', '.join(names)}")
    want = force or _forced_name(op)
    for candidate in CANDIDATES[op]:
        if (want is None or candidate.name in (want, REFERENCE)) and candidate.applies(*args):
            return candidate
    raise AssertionError(f"{op}: the reference must apply everywhere")  # the list's last entry


def reference(op: str) -> Candidate:
    """``op``'s PyTorch reference (its last candidate)."""
    return CANDIDATES[op][-1]


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None,
                       initial_state: torch.Tensor | None = None, return_final_state: bool = False,
                       force: str | None = None):
    """out_i = q_i^T (S_0 + sum_{j <= i} k_j v_j^T): ``(B,H,N,C), (B,H,N,C), (B,H,N,M) -> (B,H,N,M)``
    on the candidate :func:`select` picks, ``force`` as there (``ops.linear_attention.causal_dot_product``,
    where the contract is written out)."""
    return select("causal", q, k, v, initial_state, force=force).run(q, k, v, chunk_size, initial_state,
                                                                     return_final_state)


# ---------------------------------------------------------------- describe


_PROBES = {  # op -> (what the line says the probe is, its arguments on a device)
    "causal": ("float32, C = M = 32", lambda d: (torch.zeros(1, 1, 1, 32, device=d),) * 3),
    "lsh_window": ("float32", lambda d: (torch.zeros(1, 1, 1, 1, 32, device=d),) * 3),
    "fused_step": ("float32, batch 1", lambda d: (torch.zeros(1, 256, device=d),)),
    # the elu map by its registered name: ops sits below feature_maps (docs/ARCHITECTURE.md)
    "causal_attention": ("float32, elu map", lambda d: ("elu", *(torch.zeros(1, 1, 1, 32, device=d),) * 3)),
}
#: probes of a second dtype: (op, (what the line says, its arguments)); bf16 has a CPU path of its own
_DTYPE_PROBES = [("causal_attention", ("bfloat16, elu map",
                                       lambda d: ("elu", *(torch.zeros(1, 1, 1, 32, device=d, dtype=torch.bfloat16),) * 3)))]


def describe() -> list[str]:
    """One line per op and device (the CPU; CUDA where a GPU is visible): the candidate that runs
    it here, e.g. ``causal op on cpu (float32, C = M = 32): C++ recurrence (...), avx512``; then
    the switch. Builds the C++ extensions that are not built yet."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lines = []
    for op, (probe, make) in [*_PROBES.items(), *_DTYPE_PROBES]:
        for device in devices:
            chosen = select(op, *make(device))
            detail = f", {chosen.detail()}" if chosen.detail is not None else ""
            lines.append(f"{op} op on {device} ({probe}): {chosen.description}{detail}")
    value = os.environ.get(SWITCH, "").strip()
    lines.append(f"{SWITCH}={value}: forced {forced()}" if value
                 else f"{SWITCH} unset: each op takes its first candidate that applies")
    return lines
