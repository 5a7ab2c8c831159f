"""The causal numerator on CPU through the C++ kernel ``linformer_lab/ops/cpu/causal_dot.cpp``.

Same contract as :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct` (initial
state in, final state out, gradients into both), same chunked algorithm, but each chunk's
products are cache-resident C++ loops (AVX2 / AVX-512 where the CPU has them) and the threads
split rows or, for fewer rows than threads, chunks. :func:`causal_dot_product` in
:mod:`linformer_lab.ops.linear_attention.chunk` takes it when all of these hold, and otherwise
keeps to the pure-PyTorch chunk path (the reference; ``tests/test_causal_cpu_kernel.py`` holds
the kernel to a float64 O(N^2) reference):

* the environment variable ``LINFORMER_LAB_CPU_CAUSAL`` is not ``0``;
* q, k, v are CPU tensors of one dtype, float32 or float64, CPU autocast off;
* the extension is built or can be built (:data:`linformer_lab.ops.cpu.CAUSAL_DOT`; where it
  cannot, one RuntimeWarning per process says so).
"""

from __future__ import annotations

import os

import torch

from linformer_lab.ops import cpu

__all__ = ["ENV_VARIABLE", "CausalDotProductCPU", "applies", "default_chunk_size", "enabled"]

#: ``LINFORMER_LAB_CPU_CAUSAL=0`` keeps the causal numerator on the pure-PyTorch chunk path.
ENV_VARIABLE = "LINFORMER_LAB_CPU_CAUSAL"
_DTYPES = (torch.float32, torch.float64)


def enabled() -> bool:
    """False when ``LINFORMER_LAB_CPU_CAUSAL=0`` turns the kernel off."""
    return os.environ.get(ENV_VARIABLE, "1").strip() != "0"


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None) -> bool:
    """Whether the kernel can run these inputs (module docstring); builds the extension on the
    first call that needs it."""
    tensors = (q, k, v) if initial_state is None else (q, k, v, initial_state)
    if not enabled() or any(t.device.type != "cpu" for t in tensors) or torch.is_autocast_enabled("cpu"):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        return False
    return cpu.CAUSAL_DOT.module() is not None


def default_chunk_size(feature_dim: int, value_dim: int) -> int:
    """The kernel's chunk length: 32 up to D = 32, else 64 (the fastest or within 10 % of it
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
    :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct`. Saved for backward:
    the inputs (and S_0); the backward recomputes the chunk-boundary states, one K^T V per chunk,
    except where the forward ran chunks in parallel and has them anyway (chunk.py keeps them)."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_size: int, initial_state=None, return_final_state: bool = False):
        b, h, _, c = q.shape
        m = v.shape[-1]
        ext = cpu.CAUSAL_DOT.load()
        initial = None if initial_state is None else initial_state.reshape(b * h, c, m)
        qr, kr, vr = _rows(q), _rows(k), _rows(v)
        out, final, states = ext.forward(qr, kr, vr, initial, chunk_size)
        ctx.chunk, ctx.shape4 = chunk_size, (b, h, q.shape[2])
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)  # an unused final state sends None, not a zero tensor
        ctx.save_for_backward(qr, kr, vr, initial, states)  # states: empty unless chunks ran in parallel
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
        final = None if grad_final is None else grad_final.reshape(qr.shape[0], qr.shape[2], vr.shape[2])
        gq, gk, gv, grad_initial = cpu.CAUSAL_DOT.load().backward(qr, kr, vr, grad_out, initial, states, final,
                                                                   ctx.chunk)
        shape = ctx.shape4
        grad_initial = None if ctx.initial_dtype is None else grad_initial.view(*shape[:2], *grad_initial.shape[1:])
        if grad_initial is not None:
            grad_initial = grad_initial.to(ctx.initial_dtype)
        return (gq.view(*shape, gq.shape[-1]), gk.view(*shape, gk.shape[-1]), gv.view(*shape, gv.shape[-1]),
                None, grad_initial, None)
