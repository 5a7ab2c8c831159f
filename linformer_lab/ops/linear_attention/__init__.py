"""Linear attention (paper §3.2-3.4) as pure functions on feature-mapped tensors.

Shapes follow ``scaled_dot_product_attention``: ``phi_q, phi_k (B, H, N, C)`` (C = the
feature map's output dim), ``v (B, H, N, M)``. One module per form, as in a reading order:

* :mod:`.naive` -- the paper's equations written plainly: the O(N^2) similarity form (eq. 3, 4,
  8, 9) and the loop over t of eq. 10-12. Slow on purpose; the tests compare against it.
* :mod:`.chunk` -- the causal numerator as a chunked ``autograd.Function`` (matmuls per chunk,
  eq. 13-15 backward), no ``(N, C, M)`` tensor.
* :mod:`.recurrent` -- the RNN step (eq. 16-20) with a fixed-size state.
* here -- the attention itself: non-causal (eq. 5-6) and causal (eq. 9-12), numerator over
  normaliser, with fp32 accumulation for half inputs.
"""

from __future__ import annotations

import torch

from linformer_lab.ops.linear_attention.chunk import CausalDotProduct, causal_dot_product, compute_dtype, default_chunk_size
from linformer_lab.ops.linear_attention.recurrent import LinearState, linear_attention_step, new_linear_state
from linformer_lab.ops.masks import length_mask

__all__ = [
    "CausalDotProduct",
    "LinearState",
    "causal_dot_product",
    "causal_linear_attention",
    "default_chunk_size",
    "linear_attention",
    "linear_attention_step",
    "new_linear_state",
]


def _mask_keys(phi_k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None):
    """Zero keys and values at positions >= key_lengths so they add nothing to any sum."""
    if key_lengths is None:
        return phi_k, v
    valid = length_mask(key_lengths, phi_k.shape[-2])  # (B, N)
    valid = valid[:, None, :, None]
    return phi_k * valid, v * valid


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Non-causal linear attention by associativity (eq. 5-6): phi(Q) (phi(K)^T V) / phi(Q) z.

    Args: phi_q ``(B, H, N, C)``, phi_k ``(B, H, L, C)``, v ``(B, H, L, M)``, key_lengths ``(B,)``.
    Returns ``(B, H, N, M)``. Cost O(N C M); the ``(C, M)`` key-value summary and the
    normaliser are accumulated in fp32 for half inputs.
    """
    compute, out_dtype = compute_dtype(phi_q.dtype), v.dtype
    with torch.autocast(phi_q.device.type, enabled=False):  # keep the fp32 accumulation under autocast
        phi_k, v = _mask_keys(phi_k, v, key_lengths)
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        kv = phi_k.transpose(-1, -2) @ v  # (B, H, C, M)
        z = phi_k.sum(dim=-2)  # (B, H, C)
        denominator = (phi_q @ z.unsqueeze(-1)) + eps  # (B, H, N, 1)
        return ((phi_q @ kv) / denominator).to(out_dtype)


def causal_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
    dot_product=causal_dot_product,
) -> torch.Tensor:
    """Causal linear attention (eq. 9-12): V'_i = phi(Q_i)^T S_i / phi(Q_i)^T Z_i.

    Args: phi_q, phi_k ``(B, H, N, C)``, v ``(B, H, N, M)``, key_lengths ``(B,)``;
    ``dot_product`` computes the numerator (the pure-PyTorch :func:`causal_dot_product` or
    the CUDA kernel's). Returns ``(B, H, N, M)`` in v's dtype.

    The normaliser Z_i = sum_{j <= i} phi(K_j) is a cumulative sum, O(N C) memory, in fp32.
    """
    if not (phi_q.dtype == phi_k.dtype == v.dtype):
        # under autocast the feature maps may return fp32 for half inputs: one dtype for the kernel
        phi_q, phi_k = phi_q.to(v.dtype), phi_k.to(v.dtype)
    phi_k, v = _mask_keys(phi_k, v, key_lengths)
    numerator = dot_product(phi_q, phi_k, v)
    compute = compute_dtype(phi_q.dtype)
    with torch.autocast(phi_q.device.type, enabled=False):
        z = phi_k.to(compute).cumsum(dim=-2)  # (B, H, N, C)
        denominator = (phi_q.to(compute) * z).sum(dim=-1, keepdim=True) + eps
        return (numerator.to(compute) / denominator).to(v.dtype)
