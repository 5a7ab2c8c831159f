"""Elementwise non-negative maps: relu(x), relu(x)^2 and sigmoid(x)."""

from __future__ import annotations

import torch

from linformer_lab.feature_maps.base import FeatureMap


class ElementwiseFeatureMap(FeatureMap):
    """A map applied to each entry alone, ``phi(x)_i = f(x_i)``: ``output_dim == query_dim``;
    subclasses define ``elementwise(x)``, f on a tensor."""

    @property
    def output_dim(self) -> int:
        return self.query_dim

    def elementwise(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self.elementwise(x)


class ReluFeatureMap(ElementwiseFeatureMap):
    """``phi(x) = max(x, 0)``, elementwise; ``output_dim == query_dim``.

    The map of cosFormer without its reweighting (Qin et al. 2022, "cosFormer: Rethinking
    Softmax in Attention", eq. 6: ``sim(q, k) = relu(q)^T relu(k)``). Unlike ``elu + 1`` it can
    be exactly zero: such a query gets a normaliser of ``eps`` alone and an output of zero (never 0/0).
    """

    def elementwise(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``sum_i max(q_i, 0) max(k_i, 0)``, written with clamp rather than relu."""
        return q.clamp_min(0) @ k.clamp_min(0).transpose(-1, -2)


class SquaredReluFeatureMap(ElementwiseFeatureMap):
    """``phi(x) = max(x, 0)^2``, elementwise; ``output_dim == query_dim``.

    The squared ReLU of Primer (So et al. 2021, "Primer: Searching for Efficient Transformers
    for Language Modeling", §3: ``relu(x)^2``), used as a feature map as in the flash-linear-
    attention library's ``squared_relu``. Sharper than ``relu``: large query and key entries
    dominate the similarity.
    """

    def elementwise(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``sum_i max(q_i, 0)^2 max(k_i, 0)^2``."""
        return (q.clamp_min(0) ** 2) @ (k.clamp_min(0) ** 2).transpose(-1, -2)


class SigmoidFeatureMap(ElementwiseFeatureMap):
    """``phi(x) = 1 / (1 + exp(-x))``, elementwise; ``output_dim == query_dim``.

    As in the flash-linear-attention library (Yang & Zhang 2024, ``fla.modules.feature_map``,
    ``sigmoid``): every feature lies in (0, 1), so the similarity is positive and bounded by D and
    the normaliser never comes near zero; the drawback: too flat a map to make attention sharp.
    """

    def elementwise(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``sum_i s(q_i) s(k_i)`` with ``s(x) = exp(x) / (1 + exp(x))``, written in that form."""
        return (torch.exp(q) / (1 + torch.exp(q))) @ (torch.exp(k) / (1 + torch.exp(k))).transpose(-1, -2)
