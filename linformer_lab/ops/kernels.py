"""Which kernel computes each op: the one place that decides (docs/ARCHITECTURE.md, "Where speed
code goes").

Every op has an ordered list of :class:`Candidate` s in :data:`CANDIDATES`; :func:`select` returns
the first one whose condition holds for the op's arguments. The last is always ``pytorch``, the
op in PyTorch (Python for ``fused_step``), which runs anywhere. Every candidate, ``pytorch`` too, is
tested against the op's float64 reference: the naive O(N^2) forms
(``ops/linear_attention/naive.py``, ``ops/lsh.py: lsh_attention_naive``, ``ops/reference.py``) or
the ``pytorch`` candidate run in float64.

This module is the router: it imports the implementations (their Python; a C++ or CUDA
extension is built or loaded only where a candidate may run, Triton only when its kernel runs), and
they never import it back; an op that needs another (the ``pytorch`` candidate of
``causal_attention`` needs the numerator) gets it as an argument from the layer.

====================  ====================================  =========================================
op                    candidates, first to last             called from
====================  ====================================  =========================================
``causal``            cuda, pytorch                         :func:`causal_dot_product` (the numerator
                                                            of eq. 9), which the layers pass to
                                                            ``ops.linear_attention`` as its argument
``lsh_window``        cpp, pytorch                          :func:`lsh_window` (``attention/lsh.py``)
``fused_step``        cpp, pytorch                          ``models/generation/cpu_step.py``
``causal_attention``  triton, cpp, pytorch                  ``attention/linear.py``: eq. 9-12 with
                                                            the feature map, numerator and normaliser
                                                            in one kernel (GPU: ``ops/cuda/triton_chunk``;
                                                            CPU: ``ops/cpu/causal_recurrence.cpp``),
                                                            packed sequences (``cu_seqlens``) included
====================  ====================================  =========================================

**The switch.** ``LINFORMER_LAB_KERNELS`` (read at every selection, parsed once per value):
unset or ``auto`` chooses by the conditions; ``pytorch`` forces every op's PyTorch candidate;
``op=name`` forces one op's candidate, comma-separated for several (``causal_attention=cpp``,
``causal=pytorch,lsh_window=pytorch``): the forced candidate runs wherever its condition holds,
``pytorch`` elsewhere. A value naming no op or candidate is a ValueError listing the valid ones.
A caller may force a candidate for one call the same way (``select(..., force=name)``, over the
switch): a layer's ``forced_kernels`` (``linear_cuda``'s GPU kernels).

**Adding a kernel** (a GPU one, say): a function with the op's signature (the comment over the
op's list in :data:`CANDIDATES` says it) and a condition on the op's arguments, both in the kernel's
module (imported above, looked up at the call: :func:`_late`), as a :class:`Candidate` in the op's list in
:data:`CANDIDATES` before the candidates it should win over; ``pytorch`` stays last.
``ops/kernel_check.py`` (``describe()``, ``cli.py plugins --check``) and the switch then know it by
its name. A GPU kernel has more places that must know it: docs/ARCHITECTURE.md, "Where to add",
lists them all.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from linformer_lab.ops import cpu, cuda, linear_attention, lsh
from linformer_lab.ops.cpu import causal_recurrence
from linformer_lab.ops.cuda import triton_chunk
from linformer_lab.ops.cuda.triton_chunk import backend as triton_backend
from linformer_lab.ops.linear_attention import chunk

__all__ = ["CANDIDATES", "FUSED_MAX_BATCH", "PYTORCH", "SWITCH", "Candidate", "causal_dot_product",
           "cuda_kernel", "fallback", "forced", "lsh_window", "select", "switched"]

#: The environment variable that forces candidates (module docstring).
SWITCH = "LINFORMER_LAB_KERNELS"
#: The name of every op's last candidate, the op in PyTorch, which runs anywhere.
PYTORCH = "pytorch"
#: The fused C++ step runs batches of at most this many rows: its gain, the per-operation cost,
#: shrinks as a batch spreads it over more arithmetic, and its plain loops are not vectorized as
#: ATen's kernels are.
FUSED_MAX_BATCH = 16

_CPU_DTYPES = (torch.float32, torch.float64)
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
    ``detail()``: what ``kernel_check.describe`` adds (the instruction set in use), or None.
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


def _causal_cuda(q, k, v, initial_state=None) -> bool:
    tensors = [t for t in (q, k, v, initial_state) if t is not None]
    return (q.device.type == "cuda" and all(t.device == q.device for t in tensors)
            and q.dtype == k.dtype == v.dtype and q.dtype in _CUDA_DTYPES and q.numel() > 0
            and 1 <= q.shape[-1] <= _CUDA_MAX_DIM and 1 <= v.shape[-1] <= _CUDA_MAX_DIM)


def _lsh_cpu(q, k, v) -> bool:
    return q.dtype == k.dtype == v.dtype and _cpu_inputs(q, k, v)


def _fused_cpu(x_t) -> bool:
    return x_t.shape[0] <= FUSED_MAX_BATCH and _cpu_inputs(x_t)


# ---------------------------------------------------------------- builds


def _cpu_module(name: str):
    """The C++ extension ``linformer_lab.ops.cpu.<name>``'s module, None where it cannot be built."""
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
    if not cuda.is_available():
        return None
    try:
        cuda.load()
    except RuntimeError as error:
        warnings.warn(f"{error}; the causal linear-attention numerator on CUDA keeps to PyTorch",
                      RuntimeWarning, stacklevel=2)
        return None
    return cuda


# ---------------------------------------------------------------- the ops' implementations


def _late(module: ModuleType, function: str) -> Callable:
    """``module.function``, looked up at each call: what a test patches there is what runs."""
    return lambda *args, **kwargs: getattr(module, function)(*args, **kwargs)


def _causal_cuda_run(q, k, v, chunk_size=None, initial_state=None, return_final_state=False):
    # the extension is loaded: the candidate applies only where cuda_kernel() loaded it
    return cuda.causal_dot_product(q, k, v, initial_state, return_final_state)


def _fused_stack(*args):
    """``(weights, norm eps, heads, query dim, value dim, eps, GELU approximate)`` -> the C++
    ``FusedStack`` (``models/generation/cpu_step.py``); the ``pytorch`` candidate has none: ``fast_step``'s Python path."""
    return _cpu_module("FUSED_STEP").FusedStack(*args)


def _pytorch(description: str, run: Callable) -> Candidate:
    """An op's last candidate, the op in PyTorch: it applies to every argument, and is always available."""
    return Candidate(PYTORCH, description, "always", lambda *args: True, lambda: True, run)


#: op -> its candidates, first to last; ``pytorch`` is last (module docstring: adding a kernel).
CANDIDATES: dict[str, list[Candidate]] = {
    # (q, k, v, chunk_size=None, initial_state=None, return_final_state=False): causal_dot_product below
    "causal": [
        Candidate("cuda", "CUDA kernel (ops/cuda/causal_linear_attention.cu)",
                  "CUDA tensors of one dtype (float32, float16, bfloat16), 1 <= C, M <= 256, the extension built",
                  _causal_cuda, torch.compiler.assume_constant_result(lambda: cuda_kernel() is not None), _causal_cuda_run),
        _pytorch("PyTorch chunked numerator (ops/linear_attention/chunk.py)", _late(chunk, "causal_dot_product")),
    ],
    # (q, k, v, positions, valid, chunks, causal) -> (out, lse): ops/lsh.py's window_attention_torch
    "lsh_window": [
        Candidate("cpp", "C++ window kernel (ops/cpu/lsh_window.cpp)",
                  "CPU tensors, float32 or float64, CPU autocast off",
                  _lsh_cpu, _cpu_available("LSH_WINDOW"), _late(lsh, "window_attention_cpp"), _cpu_isa("LSH_WINDOW")),
        _pytorch("PyTorch window step (ops/lsh.py: window_attention_torch)", _late(lsh, "window_attention_torch")),
    ],
    # (weights, norm eps, heads, query dim, value dim, eps, GELU approximate) -> a FusedStack: _fused_stack
    "fused_step": [
        Candidate("cpp", "C++ fused step (ops/cpu/fused_step.cpp)",
                  f"CPU, float32 or float64, CPU autocast off, at most {FUSED_MAX_BATCH} rows "
                  "(and a stack of the form models/generation/form.py checks)",
                  _fused_cpu, _cpu_available("FUSED_STEP"), _fused_stack),
        _pytorch("Python step (models/generation/dynamic_step.py: fast_step)", lambda *args: None),
    ],
    # causal eq. 9-12 from the unmapped q, k (B, H, N, D), v (B, H, N, M) with the layer's feature map and
    # numerator (the layers pass causal_dot_product), packed sequences (cu_seqlens, B = 1) included:
    # (feature_map, q, k, v, key_lengths, eps, dot_product, initial_state=None, return_state=False,
    # cu_seqlens=None), ops/linear_attention: causal_attention. A fused candidate computes the same in one
    # kernel for the maps it knows (its accepts(feature_map, q, k, v) says which).
    "causal_attention": [
        Candidate("triton", "Triton chunk kernel, elu and the normaliser fused (ops/cuda/triton_chunk)",
                  "CUDA tensors, v float32, float16 or bfloat16, the map's features and the values at most 256, "
                  "Triton and compute capability >= 8.0 (the elu map runs inside the kernel; other maps, and elu "
                  "with key_lengths, are applied first)",
                  _late(triton_backend, "accepts"), _late(triton_chunk, "is_available"),
                  _late(triton_backend, "causal_attention")),
        Candidate("cpp", "C++ recurrence, the normaliser fused, and elu (ops/cpu/causal_recurrence.cpp)",
                  "CPU tensors of one dtype (float16, bfloat16 run as float32; CPU autocast too), any map (elu "
                  "runs inside the kernel, the others are applied first), C, M zero-padded to whole registers",
                  _late(causal_recurrence, "accepts_attention"), _cpu_available("CAUSAL_RECURRENCE"),
                  _late(causal_recurrence, "causal_attention"), _cpu_isa("CAUSAL_RECURRENCE")),
        _pytorch("feature map, then the causal op and the normaliser in PyTorch (ops/linear_attention: causal_attention)",
                 _late(linear_attention, "causal_attention")),
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
        if item == PYTORCH:
            choice.update({op: PYTORCH for op in CANDIDATES})
            continue
        op, equals, name = (part.strip() for part in item.partition("="))
        if not equals or op not in CANDIDATES:
            raise ValueError(f"{SWITCH}={value!r}: {item!r} is not 'auto', {PYTORCH!r} or op=kernel with an op among "
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
    the first that applies, or under the switch the forced one where it applies; ``pytorch``
    otherwise. ``force`` names a candidate as the switch would, for this call only, over the
    switch (``linear_cuda`` forces the GPU kernels this way)."""
    if op not in CANDIDATES:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(CANDIDATES)}")
    if force is not None and force not in (names := [candidate.name for candidate in CANDIDATES[op]]):
        raise ValueError(f"op {op!r} has no kernel {force!r} to force; its kernels: {', '.join(names)}")
    want = force or _forced_name(op)
    for candidate in CANDIDATES[op]:
        if (want is None or candidate.name in (want, PYTORCH)) and candidate.applies(*args):
            return candidate
    raise AssertionError(f"{op}: the {PYTORCH} candidate must apply everywhere")  # the list's last entry


def fallback(op: str) -> Candidate:
    """``op``'s ``pytorch`` candidate (its last), which runs anywhere."""
    return CANDIDATES[op][-1]


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None,
                       initial_state: torch.Tensor | None = None, return_final_state: bool = False,
                       force: str | None = None):
    """The causal numerator of eq. 9 on the candidate :func:`select` picks, ``force`` as there:
    out_i = q_i^T (S_0 + sum_{j <= i} k_j v_j^T), ``(B,H,N,C), (B,H,N,C), (B,H,N,M) -> (B,H,N,M)``;
    ``initial_state`` S_0 ``(B, H, C, M)`` or None, with ``return_final_state`` also S_N (gradients
    into S_0 and out of S_N); fp32 accumulation for half inputs, the output in the input dtype;
    ``chunk_size``: the chunk length of the PyTorch candidate (None: chosen from C and M)."""
    return select("causal", q, k, v, initial_state, force=force).run(q, k, v, chunk_size, initial_state,
                                                                     return_final_state)


def lsh_window(q, k, v, positions, valid, chunks, causal: bool):
    """lsh attention's window step (``ops/lsh.py``'s ``window_attention_torch`` says its contract)
    on the candidate :func:`select` picks: what ``attention/lsh.py`` gives ``lsh_attention``."""
    return select("lsh_window", q, k, v).run(q, k, v, positions, valid, chunks, causal)
