"""The causal numerator on CPU through the C++ kernels in ``linformer_lab/ops/cpu/``.

Same contract as :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct` (initial
state in, final state out, gradients into both), two C++ algorithms behind one Function,
:class:`CausalDotProductCPU`; :mod:`linformer_lab.ops.kernels` decides which runs (its
candidates ``recurrence`` and ``chunk`` of the ``causal`` op, with their conditions):

* ``"recurrence"`` (``causal_recurrence.cpp``): the plain recurrence S_t = S_{t-1} + k_t v_t^T
  with a tile of the state held in SIMD registers while the positions stream past; 16 C M
  flops per position (fwd+bwd), all of them broadcast FMAs. It runs where C and M are both
  multiples of a register width (4 floats / 2 doubles or more), and there it beats the chunked
  kernel at every shape measured: its column tails are whole registers,
  where the chunked kernel's are scalar. Its large outputs come from a pool of reused buffers
  (``ops/cpu/output_pool.h``), since a fresh buffer costs a page fault per 4 KiB. The chunk
  length is unused.
* ``"chunk"`` (``causal_dot.cpp``): the chunked algorithm of
  :mod:`~linformer_lab.ops.linear_attention.chunk` (per chunk an L x L masked product plus the
  product with the state) in cache-resident C++ loops; for the other C, M (odd ones, D = 7).

Both use AVX2 / AVX-512 where the CPU has them; ``tests/ops/test_causal_cpu_kernel.py`` holds both
to a float64 O(N^2) reference.
"""

from __future__ import annotations

import torch

from linformer_lab.ops import cpu

__all__ = ["ALGORITHMS", "CausalDotProductCPU", "causal_dot_product", "cpp_chunk_size"]

#: The C++ algorithms, by the name :mod:`linformer_lab.ops.kernels` gives them.
ALGORITHMS = ("recurrence", "chunk")


def cpp_chunk_size(feature_dim: int, value_dim: int) -> int:
    """The chunk length of the C++ chunked kernel (``causal_dot.cpp``) when none is given: 32 up to
    D = 32, else 64, the fastest or near it from D = 16 to 128 as measured. At
    least min(C, M) up to D = 64 keeps the (N / L, C, M) chunk states that the backward recomputes
    (one row's per thread) no larger than an input row; at C = M = 128 they are twice its size,
    still O(N). (The PyTorch reference has its own rule: ``chunk.reference_chunk_size``.)"""
    return 32 if min(feature_dim, value_dim) <= 32 else 64


def causal_dot_product(q, k, v, algorithm: str, chunk_size: int | None = None, initial_state=None,
                       return_final_state: bool = False):
    """:func:`~linformer_lab.ops.linear_attention.causal_dot_product` on ``algorithm`` (one of
    :data:`ALGORITHMS`; the caller has checked that it applies). ``chunk_size``: the chunked
    kernel's (None: :func:`cpp_chunk_size`)."""
    chunk = chunk_size or cpp_chunk_size(q.shape[-1], v.shape[-1])
    return CausalDotProductCPU.apply(q, k, v, algorithm, chunk, initial_state, return_final_state)


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, X) -> (B H, N, X)``, contiguous (the kernel reads raw rows)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]).contiguous()


class CausalDotProductCPU(torch.autograd.Function):
    """``apply(q, k, v, algorithm, chunk_size, initial_state=None, return_final_state=False)``: as
    :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct`, on ``algorithm``
    (``"recurrence"`` or ``"chunk"``; the chunk length is the chunked kernel's, the recurrence ignores it).
    Saved for backward: the inputs and states. The recurrence keeps the state at every block
    start ((B H, N / 256, C, M), at most half an input for M <= 128); the chunk kernel keeps S_0
    and recomputes the chunk-boundary states, one K^T V per chunk, except where the forward ran
    chunks in parallel and has them anyway (chunk.py keeps them)."""

    @staticmethod
    def forward(ctx, q, k, v, algorithm: str, chunk_size: int, initial_state=None, return_final_state: bool = False):
        b, h, _, c = q.shape
        m = v.shape[-1]
        ctx.algorithm = algorithm
        # contiguous: the C++ kernels index raw rows, and causal_dot.cpp's clone of S_0 keeps a transposed one's strides
        initial = None if initial_state is None else initial_state.reshape(b * h, c, m).contiguous()
        qr, kr, vr = _flat_rows(q), _flat_rows(k), _flat_rows(v)
        if ctx.algorithm == "recurrence":
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
        grad_out = _flat_rows(grad_out.to(qr.dtype)) if grad_out.dim() == 4 else grad_out.contiguous()
        final = None if grad_final is None else grad_final.reshape(qr.shape[0], qr.shape[2], vr.shape[2]).contiguous()
        if ctx.algorithm == "recurrence":
            gq, gk, gv, grad_initial = cpu.CAUSAL_RECURRENCE.load().backward(qr, kr, vr, grad_out, states, final)
        else:
            gq, gk, gv, grad_initial = cpu.CAUSAL_DOT.load().backward(qr, kr, vr, grad_out, initial, states, final,
                                                                       ctx.chunk)
        shape = ctx.shape4
        grad_initial = None if ctx.initial_dtype is None else grad_initial.view(*shape[:2], *grad_initial.shape[1:])
        if grad_initial is not None:
            grad_initial = grad_initial.to(ctx.initial_dtype)
        return (gq.view(*shape, gq.shape[-1]), gk.view(*shape, gk.shape[-1]), gv.view(*shape, gv.shape[-1]),
                None, None, grad_initial, None)
