"""The paper's equations written plainly, O(N^2), for tests and for reading.

Nothing here is fast or memory-efficient on purpose: every function builds the full
``(N, N)`` similarity matrix of eq. 3/4 (masked for eq. 8/9) and normalises it row by row.
Call them with float64 tensors to get an independent reference for the fast paths.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Similarity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def softmax_similarity(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """exp(q^T k / sqrt(D)) for all pairs: ``(B, H, N, D), (B, H, L, D) -> (B, H, N, L)``.

    The row maximum is subtracted first; a per-query factor cancels in eq. 3.
    """
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.exp(scores - scores.amax(dim=-1, keepdim=True))


def kernel_similarity(phi_q: torch.Tensor, phi_k: torch.Tensor) -> torch.Tensor:
    """phi(q)^T phi(k) for all pairs (eq. 4); inputs already feature-mapped."""
    return phi_q @ phi_k.transpose(-1, -2)


def polynomial_similarity(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(1 + q^T k / sqrt(D))^2, the degree-2 polynomial kernel, written directly."""
    return (1 + q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])) ** 2


def attention_from_similarity(
    similarity: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 3 (non-causal) / eq. 8 (causal): V'_i = sum_j sim_ij V_j / sum_j sim_ij.

    Args:
        similarity: ``(B, H, N, L)`` non-negative weights sim(Q_i, K_j).
        v: ``(B, H, L, M)``.
        key_lengths: ``(B,)``; keys at positions >= length get weight 0.
    Returns: ``(B, H, N, M)``.
    """
    n, l = similarity.shape[-2:]
    weights = similarity
    if causal:
        weights = weights * torch.ones(n, l, dtype=torch.bool, device=v.device).tril()
    if key_lengths is not None:
        valid = torch.arange(l, device=v.device) < key_lengths[:, None]  # (B, L)
        weights = weights * valid[:, None, None, :]
    return (weights @ v) / weights.sum(-1, keepdim=True)


def causal_dot_product_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Numerator of eq. 9: out_i = sum_{j <= i} (q_i^T k_j) v_j. ``(B,H,N,C),(B,H,N,C),(B,H,N,M)``."""
    n = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * torch.ones(n, n, dtype=q.dtype, device=q.device).tril()
    return scores @ v


def lsh_exact_reference(
    q: torch.Tensor, v: torch.Tensor, causal: bool, key_lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """What LSH attention computes when every token shares one bucket and one chunk:
    shared-QK softmax attention (keys = queries / |queries|) where a token attends to itself
    only when nothing else is visible (Kitaev et al. 2020, §2)."""
    n, d = q.shape[-2:]
    keys = q / q.norm(dim=-1, keepdim=True)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(d)
    visible = torch.ones(q.shape[0], 1, n, n, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if key_lengths is not None:
        visible = visible & (torch.arange(n, device=q.device) < key_lengths[:, None])[:, None, None, :]
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    others = visible & ~eye
    # self is used only in rows where no other key is visible
    allowed = torch.where(others.any(-1, keepdim=True), others, visible & eye)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
