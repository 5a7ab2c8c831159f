"""Softmax and LSH attention written plainly, O(N^2), for tests and for reading (the linear
attention forms live beside their fast paths, in :mod:`linformer_lab.ops.linear_attention.naive`).

Every function builds the full ``(N, N)`` similarity matrix of eq. 3/4 (masked for eq. 8/9); with
float64 tensors they are an independent reference for the fast paths.
"""

from __future__ import annotations

import math

import torch


def softmax_similarity(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """exp(q^T k / sqrt(D)) for all pairs: ``(B, H, N, D), (B, H, L, D) -> (B, H, N, L)``.

    The row maximum is subtracted first; a per-query factor cancels in eq. 3.
    """
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.exp(scores - scores.amax(dim=-1, keepdim=True))


def polynomial_similarity(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(1 + q^T k / sqrt(D))^2, the degree-2 polynomial kernel, written directly."""
    return (1 + q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])) ** 2


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
