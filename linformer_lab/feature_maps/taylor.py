"""Second-order Taylor expansion of exp(q^T k / sqrt(D)) (Based, Arora et al. 2024)."""

from __future__ import annotations

import torch

from linformer_lab.feature_maps.base import FeatureMap
from linformer_lab.feature_maps.packed_square import PackedSquare


class TaylorFeatureMap(FeatureMap):
    """``phi(q)^T phi(k) = 1 + t + t^2 / 2`` with ``t = q^T k / sqrt(D)``: exp(t) to second order.

    Arora et al. 2024, "Simple linear attention language models balance the recall-throughput
    tradeoff" (Based), §3.1: the feature map ``phi(x) = [1, x / D^(1/4), (x x^T) / (sqrt(2) sqrt(D))]``
    flattened. We pack the outer product to its upper triangle (:class:`PackedSquare`), so

        phi(x) = [1, x', psi(x') / sqrt(2)],   x' = x / D^(1/4),   psi(x')^T psi(y') = (x'^T y')^2,

    ``output_dim = 1 + D + D (D + 1) / 2`` instead of ``1 + D + D^2``; the kernel is the same.
    ``1 + t + t^2 / 2 = ((t + 1)^2 + 1) / 2 >= 1/2`` for every t: the normaliser never comes
    near zero, whatever the inputs.
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
        return torch.cat([torch.ones_like(x[..., :1]), x, self.square(x) * 0.5**0.5], dim=-1)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``1 + t + t^2 / 2``, ``t = q^T k / sqrt(D)``, from the dot products themselves."""
        t = q @ k.transpose(-1, -2) / self.query_dim**0.5
        return 1 + t + t * t / 2
