"""The Triton kernel of one linear-attention generation step (``step.py`` registers and launches it)."""

# no ``from __future__ import annotations``: Triton's interpreter reads ``tl.constexpr`` from
# the annotations as objects, not strings
import triton.language as tl


def linear_attention_step(
    Q, K, V, JOINT, OUT, H, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, so_b, so_h, eps, tiny,
    C: tl.constexpr, M: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, ELU: tl.constexpr,
):
    """Grid ``(B H,)``: q, k ``(B, H, C)``, v ``(B, H, M)`` with strides (batch, head), feature
    stride 1; JOINT ``(B, H, C, M + 1)`` fp32 contiguous, [S | Z], updated in place; OUT ``(B, H, M)``:
    phi(q)^T S / (phi(q)^T Z + eps) after S += phi(k) v^T, Z += phi(k)."""
    row = tl.program_id(0)
    b, h = row // H, row % H
    c = tl.arange(0, BC)
    m = tl.arange(0, BM)
    cmask, mmask = c < C, m < M
    q = tl.load(Q + b.to(tl.int64) * sq_b + h * sq_h + c, mask=cmask, other=0.0)
    k = tl.load(K + b.to(tl.int64) * sk_b + h * sk_h + c, mask=cmask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * sv_b + h * sv_h + m, mask=mmask, other=0.0).to(tl.float32)
    if ELU:  # rounded to the input dtype, as the feature map's own output is, then widened; a NaN kept
        q = tl.where(cmask, tl.maximum(tl.where(q > 0, q + 1.0, tl.exp(q.to(tl.float32))), tiny,
                                       propagate_nan=tl.PropagateNan.ALL), 0.0).to(Q.dtype.element_ty)
        k = tl.where(cmask, tl.maximum(tl.where(k > 0, k + 1.0, tl.exp(k.to(tl.float32))), tiny,
                                       propagate_nan=tl.PropagateNan.ALL), 0.0).to(K.dtype.element_ty)
    q, k = q.to(tl.float32), k.to(tl.float32)
    base = JOINT + row.to(tl.int64) * (C * (M + 1))
    offsets = c[:, None] * (M + 1) + m[None, :]
    smask = cmask[:, None] & mmask[None, :]
    state = tl.load(base + offsets, mask=smask, other=0.0) + k[:, None] * v[None, :]
    z = tl.load(base + c * (M + 1) + M, mask=cmask, other=0.0) + k
    tl.store(base + offsets, state, mask=smask)
    tl.store(base + c * (M + 1) + M, z, mask=cmask)
    num = tl.sum(q[:, None] * state, axis=0)
    den = tl.sum(q * z, axis=0) + eps
    tl.store(OUT + b.to(tl.int64) * so_b + h * so_h + m, (num / den).to(OUT.dtype.element_ty), mask=mmask)
