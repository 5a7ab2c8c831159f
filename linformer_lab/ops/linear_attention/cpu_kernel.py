"""The causal numerator on CPU through the C++ recurrence (``linformer_lab/ops/cpu/causal_recurrence.cpp``).

Same contract as :class:`~linformer_lab.ops.linear_attention.chunk.CausalDotProduct` (initial
state in, final state out, gradients into both); :mod:`linformer_lab.ops.kernels` decides where
it runs (the ``recurrence`` candidate of the ``causal`` op: CPU tensors of one dtype, under CPU
autocast too). float16 / bfloat16 inputs run as float32, as the reference accumulates them
(:func:`~linformer_lab.ops.linear_attention.chunk.compute_dtype`): the output comes back in the
inputs' dtype, S_N in float32, the gradients in the inputs' dtypes.

The recurrence is the plain S_t = S_{t-1} + k_t v_t^T with a tile of the state held in SIMD
registers while the positions stream past: 16 C M flops per position (fwd+bwd), all of them
broadcast FMAs, so its loops need C and M in whole registers. Other C, M (odd head sizes, poly2's
1 + D + D (D + 1) / 2 features) are zero-padded up to whole registers (:func:`recurrence_dims`):
zero columns of q and k, and zero columns of v, add nothing to any state or output, and the
padded columns of the results are cut off. The kernel runs as the ``torch.library`` operator of
:mod:`linformer_lab.ops.custom_ops`, so ``torch.compile`` traces through it. Its large outputs come
from a pool of reused buffers (``ops/cpu/output_pool.h``), since a fresh buffer costs a page fault
per 4 KiB. ``tests/ops/test_causal_cpu_kernel.py`` holds it to a float64 O(N^2) reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linformer_lab.ops import cpu, custom_ops
from linformer_lab.ops.linear_attention.chunk import compute_dtype

__all__ = ["causal_dot_product", "recurrence_dims"]


def _padded(size: int, width: int) -> int:
    """``size`` up to a multiple of ``width``, at least one (an empty C or M runs one zero register)."""
    return max(1, -(-size // width)) * width


@torch.compiler.assume_constant_result  # traced as its value: the extension is built and asked once per shape
def recurrence_dims(feature_dim: int, value_dim: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """(C', M') that the recurrence runs (C, M) as in ``dtype``: (C, M) where they fill whole
    registers, else both zero-padded to the register width with the fewest vector FMAs per
    position (C' M' / width: D = 7 pads to 8 floats, D = 33 to 48 where AVX-512 has 16); None
    where the extension cannot be had (warned once) or ``dtype`` is not float32 / float64."""
    module = cpu.CAUSAL_RECURRENCE.module()
    if module is None or dtype not in (torch.float32, torch.float64):
        return None
    like = torch.empty(0, dtype=dtype)
    if module.fits(feature_dim, value_dim, like):
        return feature_dim, value_dim
    widths = []  # in elements, the widest register of the instruction set in use down to 16 bytes
    width = module.width(64, 64, like) // like.element_size()
    while width * like.element_size() >= 16:
        widths.append(width)
        width //= 2
    best = min(widths, key=lambda w: (_padded(feature_dim, w) * _padded(value_dim, w) / w, -w))
    return _padded(feature_dim, best), _padded(value_dim, best)


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None,
                       initial_state: torch.Tensor | None = None, return_final_state: bool = False):
    """:func:`~linformer_lab.ops.linear_attention.causal_dot_product` on the recurrence:
    ``q, k (B, H, N, C), v (B, H, N, M)`` of one dtype on CPU, ``initial_state`` S_0
    ``(B, H, C, M)`` or None -> ``out (B, H, N, M)`` in that dtype, with ``return_final_state``
    ``(out, S_N)``, S_N in the compute dtype (float32 for float16 / bfloat16 inputs, module
    docstring). ``chunk_size`` is the reference's and unused here."""
    dtype = q.dtype
    compute = compute_dtype(dtype)
    # the operator takes only float32 / float64: autocast off around it, as around the reference's
    # two passes, so that nothing on the way in or out is recast to half precision
    with torch.autocast("cpu", enabled=False):
        out, final = _recurrence(q.to(compute), k.to(compute), v.to(compute),
                                 None if initial_state is None else initial_state.to(compute))
    out = out.to(dtype)
    return (out, final) if return_final_state else out


def _recurrence(q, k, v, initial_state):
    """The operator on ``q, k, v, initial_state`` of one float32 / float64 dtype, C and M padded to
    what it runs: ``(out, S_N)``."""
    c, m = q.shape[-1], v.shape[-1]
    dims = recurrence_dims(c, m, q.dtype)
    if dims is None:
        raise RuntimeError(f"the C++ causal recurrence does not run {q.dtype} here: it takes float32, float64, "
                           "float16 or bfloat16 (as float32), and needs the causal_recurrence.cpp extension built")
    pad_c, pad_m = dims[0] - c, dims[1] - m
    if pad_c or pad_m:
        q, k, v = F.pad(q, (0, pad_c)), F.pad(k, (0, pad_c)), F.pad(v, (0, pad_m))
        if initial_state is not None:
            initial_state = F.pad(initial_state, (0, pad_m, 0, pad_c))
    else:  # the operator reads contiguous rows; copied here, the copies are what it saves for the backward
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, final, _ = custom_ops.causal_recurrence_forward(q, k, v, initial_state)
    if pad_c or pad_m:
        out, final = out[..., :m], final[..., :c, :m]
    return out, final
