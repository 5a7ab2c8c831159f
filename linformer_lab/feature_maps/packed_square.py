"""Features of the squared dot product, ``psi(x)^T psi(y) = (x^T y)^2``, packed to the upper triangle."""

from __future__ import annotations

import math

import torch
from torch import nn


class PackedSquare(nn.Module):
    """``(..., D) -> (..., D (D + 1) / 2)`` with ``psi(x)^T psi(y) = (x^T y)^2``.

    ``(x^T y)^2 = sum_ij x_i x_j y_i y_j`` is the inner product of the outer products ``x x^T`` and
    ``y y^T``; a symmetric matrix is fixed by its upper triangle, each off-diagonal entry counted
    twice, so the features are ``x_i^2`` (i) and ``sqrt(2) x_i x_j`` (i < j): half the D^2 entries
    of the flattened outer product, the same kernel. Used by ``taylor`` and ``rebased``.
    """

    def __init__(self, dim: int):
        super().__init__()
        first, second = torch.triu_indices(dim, dim)
        self.register_buffer("first", first, persistent=False)
        self.register_buffer("second", second, persistent=False)
        # which entries are off the diagonal (scaled by sqrt(2), a Python float: the input keeps its precision)
        self.register_buffer("twice", (first != second), persistent=False)
        self.output_dim = len(first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = x[..., self.first] * x[..., self.second]
        return torch.where(self.twice, products * math.sqrt(2.0), products)
