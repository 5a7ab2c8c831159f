"""The exact degree-2 polynomial kernel (paper §3.2.1)."""

from __future__ import annotations

import math

import torch

from linformer_lab.feature_maps.base import FeatureMap
from linformer_lab.ops.reference import polynomial_similarity


class Poly2FeatureMap(FeatureMap):
    """phi(q)^T phi(k) = (1 + q^T k / sqrt(D))^2, exactly.

    With x' = x / D^(1/4) (so x'^T y' = x^T y / sqrt(D)) the kernel expands to
    1 + 2 x'^T y' + (x'^T y')^2, and (x'^T y')^2 = sum_ij x'_i x'_j y'_i y'_j. The outer product
    is symmetric, so we keep its upper triangle only, with off-diagonal terms scaled by sqrt(2):

        phi(x) = [1, sqrt(2) x', x'_i^2 (i), sqrt(2) x'_i x'_j (i < j)]

    output_dim = 1 + D + D (D + 1) / 2 instead of 1 + D + D^2. The kernel is a square, so it
    is never negative and the attention normaliser stays >= 0.
    """

    def __init__(self, query_dim: int):
        super().__init__(query_dim)
        rows, cols = torch.triu_indices(query_dim, query_dim)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        self.register_buffer("_off_diagonal", rows != cols, persistent=False)

    @property
    def output_dim(self) -> int:
        d = self.query_dim
        return 1 + d + d * (d + 1) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = x * self.query_dim ** -0.25
        pairs = x[..., self._rows] * x[..., self._cols]
        # a Python float keeps sqrt(2) at the input's precision (a float32 buffer would not)
        pairs = torch.where(self._off_diagonal, pairs * math.sqrt(2.0), pairs)
        ones = torch.ones_like(x[..., :1])
        return torch.cat([ones, math.sqrt(2.0) * x, pairs], dim=-1)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The kernel itself, ``(1 + q^T k / sqrt(D))^2``, without the packed features."""
        return polynomial_similarity(q, k)
