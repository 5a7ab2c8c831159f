"""The causal numerator on CPU through the C++ kernels in ``linformer_lab/ops/cpu/``.

Same contract as :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct` (initial
state in, final state out, gradients into both). :class:`CausalDotProductCPU` is the single
entry point; it runs one of two C++ algorithms (:func:`path`):

* ``"recurrence"`` (``causal_recurrence.cpp``): the plain recurrence S_t = S_{t-1} + k_t v_t^T
  with a tile of the state held in SIMD registers while the positions stream past; 16 C M
  flops per position (fwd+bwd), all of them broadcast FMAs. Taken whenever C and M are both
  multiples of a register width (4 floats / 2 doubles or more: every D the benchmarks use).
  Why no other rule: on a quiet 2-vCPU AMD EPYC Zen 5 (fwd+bwd, fp32, 2 threads, medians of
  interleaved calls, ``benchmarks/paper/results/causal_linear_cpu_grid_passive_pool.md``) it was
  1.5-3.9x the chunk kernel over 42 shapes (median 2.1x) and 2.3-8.3x fast-transformers' CPU
  kernel (median 3.4x); 3-6x the chunk kernel at D = 12, 24, 40 (whole registers of 4 or 8
  floats, where the chunk kernel's column tails are scalar). Its outputs of 4 MiB and more
  come from a pool of reused buffers (``ops/cpu/output_pool.h``): fresh ones cost a page fault
  per 4 KiB, which at the largest shapes took more time than the arithmetic.
  fp32 error at N = 65536 (D = 16, against float64) as the chunk kernel's: 2e-6 to 5e-6 of the
  largest entry. The chunk length is unused here.
* ``"chunk"`` (``causal_dot.cpp``): the chunked algorithm of
  :mod:`~linformer_lab.ops.linear_attention.chunk` (per chunk an L x L masked product plus the
  product with the state) in cache-resident C++ loops; for the other C, M (odd ones, D = 7),
  or every shape with ``LINFORMER_LAB_CPU_CAUSAL_RECURRENCE=0`` (before/after comparisons).

Both use AVX2 / AVX-512 where the CPU has them. :func:`causal_dot_product` in
:mod:`linformer_lab.ops.linear_attention.chunk` takes this module when all of these hold, and
otherwise keeps to the pure-PyTorch chunk path (the reference;
``tests/ops/test_causal_cpu_kernel.py`` holds both kernels to a float64 O(N^2) reference):

* the environment variable ``LINFORMER_LAB_CPU_CAUSAL`` is not ``0``;
* q, k, v are CPU tensors of one dtype, float32 or float64, CPU autocast off;
* the extension of the path that applies is built or can be built (:data:`linformer_lab.ops.cpu.CAUSAL_RECURRENCE`,
  :data:`linformer_lab.ops.cpu.CAUSAL_DOT`; where one cannot, one RuntimeWarning per process
  says so, and the other takes over where it can).
"""

from __future__ import annotations

import os

import torch

from linformer_lab.ops import cpu

__all__ = ["ENV_VARIABLE", "RECURRENCE_VARIABLE", "CausalDotProductCPU", "applies", "default_chunk_size", "enabled",
           "path"]

#: ``LINFORMER_LAB_CPU_CAUSAL=0`` keeps the causal numerator on the pure-PyTorch chunk path.
ENV_VARIABLE = "LINFORMER_LAB_CPU_CAUSAL"
#: ``LINFORMER_LAB_CPU_CAUSAL_RECURRENCE=0`` runs every shape on the chunk kernel (causal_dot.cpp).
RECURRENCE_VARIABLE = "LINFORMER_LAB_CPU_CAUSAL_RECURRENCE"
_DTYPES = (torch.float32, torch.float64)


def enabled() -> bool:
    """False when ``LINFORMER_LAB_CPU_CAUSAL=0`` turns the kernel off."""
    return os.environ.get(ENV_VARIABLE, "1").strip() != "0"


def path(feature_dim: int, value_dim: int, dtype: torch.dtype) -> str | None:
    """The C++ algorithm :class:`CausalDotProductCPU` runs for (C, M) in ``dtype``:
    ``"recurrence"``, ``"chunk"``, or None where neither extension can be had (module
    docstring); builds the extensions on the first call that needs them."""
    if os.environ.get(RECURRENCE_VARIABLE, "1").strip() != "0":
        recurrence = cpu.CAUSAL_RECURRENCE.module()
        if recurrence is not None and recurrence.fits(feature_dim, value_dim, torch.empty(0, dtype=dtype)):
            return "recurrence"
    return "chunk" if cpu.CAUSAL_DOT.module() is not None else None


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None) -> bool:
    """Whether the kernel can run these inputs (module docstring); builds the extension on the
    first call that needs it."""
    tensors = (q, k, v) if initial_state is None else (q, k, v, initial_state)
    if not enabled() or any(t.device.type != "cpu" for t in tensors) or torch.is_autocast_enabled("cpu"):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        return False
    return path(q.shape[-1], v.shape[-1], q.dtype) is not None


def default_chunk_size(feature_dim: int, value_dim: int) -> int:
    """The chunk kernel's chunk length: 32 up to D = 32, else 64 (the fastest or within 10 % of it
    from D = 16 to 128 as measured: benchmarks/NOTES.md, "the causal numerator's C++ CPU
    kernel"). At least min(C, M) up to D = 64 keeps the (N / L, C, M) chunk states that the
    backward recomputes (one row's per thread) no larger than an input row; at C = M = 128 they
    are twice its size, still O(N)."""
    return 32 if min(feature_dim, value_dim) <= 32 else 64


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, X) -> (B H, N, X)``, contiguous (the kernel reads raw rows)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]).contiguous()


class CausalDotProductCPU(torch.autograd.Function):
    """``apply(q, k, v, chunk_size, initial_state=None, return_final_state=False)``: as
    :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct`, on the path
    :func:`path` picks (the chunk length is the chunk kernel's; the recurrence ignores it).
    Saved for backward: the inputs and states. The recurrence keeps the state at every block
    start ((B H, N / 256, C, M), at most half an input for M <= 128); the chunk kernel keeps S_0
    and recomputes the chunk-boundary states, one K^T V per chunk, except where the forward ran
    chunks in parallel and has them anyway (chunk.py keeps them)."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_size: int, initial_state=None, return_final_state: bool = False):
        b, h, _, c = q.shape
        m = v.shape[-1]
        ctx.path = path(c, m, q.dtype)
        # contiguous: the C++ kernels index raw rows, and causal_dot.cpp's clone of S_0 keeps a transposed one's strides
        initial = None if initial_state is None else initial_state.reshape(b * h, c, m).contiguous()
        qr, kr, vr = _rows(q), _rows(k), _rows(v)
        if ctx.path == "recurrence":
            out, final, states = cpu.CAUSAL_RECURRENCE.load().forward(qr, kr, vr, initial)
            initial = None  # states[:, 0] is S_0
        else:
            out, final, states = cpu.CAUSAL_DOT.load().forward(qr, kr, vr, initial, chunk_size)
        ctx.chunk, ctx.shape4 = chunk_size, (b, h, q.shape[2])
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)  # an unused final state sends None, not a zero tensor
        ctx.save_for_backward(qr, kr, vr, initial, states)  # chunk kernel: states empty unless chunks ran in parallel
        out = out.view(b, h, q.shape[2], m)
        if not return_final_state:
            return out
        return out, final.view(b, h, c, m)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the C++ backward is not differentiable: say so, not wrong
    def backward(ctx, grad_out, grad_final=None):
        qr, kr, vr, initial, states = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(vr)
        grad_out = _rows(grad_out.to(qr.dtype)) if grad_out.dim() == 4 else grad_out.contiguous()
        final = None if grad_final is None else grad_final.reshape(qr.shape[0], qr.shape[2], vr.shape[2]).contiguous()
        if ctx.path == "recurrence":
            gq, gk, gv, grad_initial = cpu.CAUSAL_RECURRENCE.load().backward(qr, kr, vr, grad_out, states, final)
        else:
            gq, gk, gv, grad_initial = cpu.CAUSAL_DOT.load().backward(qr, kr, vr, grad_out, initial, states, final,
                                                                       ctx.chunk)
        shape = ctx.shape4
        grad_initial = None if ctx.initial_dtype is None else grad_initial.view(*shape[:2], *grad_initial.shape[1:])
        if grad_initial is not None:
            grad_initial = grad_initial.to(ctx.initial_dtype)
        return (gq.view(*shape, gq.shape[-1]), gk.view(*shape, gk.shape[-1]), gv.view(*shape, gv.shape[-1]),
                None, grad_initial, None)
