"""ReBased: a learned affine map of the normalised input, squared (Aksenov et al. 2024)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.feature_maps.base import FeatureMap
from linformer_lab.feature_maps.packed_square import PackedSquare


class RebasedFeatureMap(FeatureMap):
    """``phi(q)^T phi(k) = (q~^T k~)^2`` with ``x~ = (gamma * norm(x) + beta) / D^(1/4)``, learned.

    Aksenov et al. 2024, "Linear Transformers with Learnable Kernel Functions are Better
    In-Context Models" (ReBased), §4, eq. 5: ``sim(q, k) = ((gamma_q norm(q) + beta_q)^T
    (gamma_k norm(k) + beta_k))^2``, where ``norm`` is layer normalisation without its own affine
    and gamma, beta are learned per feature. Like the library flash-linear-attention, one
    ``(gamma, beta)`` serves queries and keys alike (shared over heads). The 1/D^(1/4) keeps the
    dot product at the scale of ``q^T k / sqrt(D)``. Features: the square's packed upper triangle
    (:class:`PackedSquare`), ``output_dim = D (D + 1) / 2``; never negative.

    Parameters ``gamma`` (ones) and ``beta`` (zeros), both ``(D,)``: part of the model's state dict.

    Args:
        eps: the layer normalisation's epsilon.
    """

    def __init__(self, query_dim: int, eps: float = 1e-5):
        super().__init__(query_dim)
        self.gamma = nn.Parameter(torch.ones(query_dim))
        self.beta = nn.Parameter(torch.zeros(query_dim))
        self.eps = eps
        self.square = PackedSquare(query_dim)

    @property
    def output_dim(self) -> int:
        return self.square.output_dim

    def affine(self, x: torch.Tensor) -> torch.Tensor:
        """``x~`` of the docstring: ``(..., D) -> (..., D)``."""
        normalised = F.layer_norm(x, (self.query_dim,), eps=self.eps)
        return (self.gamma.to(x.dtype) * normalised + self.beta.to(x.dtype)) * self.query_dim ** -0.25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self.square(self.affine(x))

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``(q~^T k~)^2`` from the affine inputs' dot products."""
        return (self.affine(q) @ self.affine(k).transpose(-1, -2)) ** 2
