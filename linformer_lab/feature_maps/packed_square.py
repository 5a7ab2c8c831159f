"""Features of the squared dot product, ``psi(x)^T psi(y) = (x^T y)^2``, packed to the upper triangle,
and the second-order maps built on them (``poly2``, ``taylor``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from linformer_lab.feature_maps.base import FeatureMap


class PackedSquare(nn.Module):
    """``(..., D) -> (..., D (D + 1) / 2)`` with ``psi(x)^T psi(y) = (x^T y)^2``.

    ``(x^T y)^2 = sum_ij x_i x_j y_i y_j`` is the inner product of the outer products ``x x^T`` and
    ``y y^T``; a symmetric matrix is fixed by its upper triangle, each off-diagonal entry counted
    twice, so the features are ``x_i^2`` (i) and ``sqrt(2) x_i x_j`` (i < j): half the D^2 entries
    of the flattened outer product, the same kernel. Used by ``poly2``, ``taylor`` and ``rebased``.
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


class SecondOrderFeatureMap(FeatureMap):
    """``phi(x) = [1, a x', b psi(x')]`` with ``x' = x / D^(1/4)``, so that ``phi(q)^T phi(k) = 1 +
    a^2 t + b^2 t^2``, ``t = q^T k / sqrt(D)``: a polynomial of degree two in the scaled dot product,
    its coefficients set by a subclass (``linear_weight`` a, ``square_weight`` b);
    ``output_dim = 1 + D + D (D + 1) / 2`` instead of the flattened outer product's ``1 + D + D^2``.
    """

    linear_weight: float
    square_weight: float

    def __init__(self, query_dim: int):
        super().__init__(query_dim)
        self.square = PackedSquare(query_dim)

    @property
    def output_dim(self) -> int:
        return 1 + self.query_dim + self.square.output_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = x * self.query_dim ** -0.25
        # a weight of 1 is left out, not multiplied: a product by 1 would be one more pass over the
        # (..., D (D + 1) / 2) features, forward and backward, the map's largest tensor
        linear = x if self.linear_weight == 1.0 else self.linear_weight * x
        square = self.square(x)
        square = square if self.square_weight == 1.0 else self.square_weight * square
        return torch.cat([torch.ones_like(x[..., :1]), linear, square], dim=-1)
