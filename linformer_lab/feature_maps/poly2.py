"""The exact degree-2 polynomial kernel (paper §3.2.1)."""

from __future__ import annotations

import math

import torch

from linformer_lab.feature_maps.base import FeatureMap
from linformer_lab.feature_maps.packed_square import PackedSquare
from linformer_lab.ops.reference import polynomial_similarity


class Poly2FeatureMap(FeatureMap):
    """phi(q)^T phi(k) = (1 + q^T k / sqrt(D))^2, exactly.

    With x' = x / D^(1/4) (so x'^T y' = x^T y / sqrt(D)) the kernel expands to
    1 + 2 x'^T y' + (x'^T y')^2, and the square's features are packed to the upper triangle
    (:class:`PackedSquare`):

        phi(x) = [1, sqrt(2) x', x'_i^2 (i), sqrt(2) x'_i x'_j (i < j)]

    output_dim = 1 + D + D (D + 1) / 2 instead of 1 + D + D^2. The kernel is a square, so it
    is never negative and the attention normaliser stays >= 0.
    """

    def __init__(self, query_dim: int):
        super().__init__(query_dim)
        self.square = PackedSquare(query_dim)

    @property
    def output_dim(self) -> int:
        return 1 + self.query_dim + self.square.output_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = x * self.query_dim ** -0.25
        return torch.cat([torch.ones_like(x[..., :1]), math.sqrt(2.0) * x, self.square(x)], dim=-1)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The kernel itself, ``(1 + q^T k / sqrt(D))^2``, without the packed features."""
        return polynomial_similarity(q, k)
