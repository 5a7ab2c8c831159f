"""Learned feature maps for converting a trained softmax model: T2R (Kasai et al. 2021) and
Hedgehog (Zhang et al. 2024). Their weights are nn.Parameters, so they are part of the model's
state dict; a model's attention settings hold their keyword arguments."""

from __future__ import annotations

import torch
from torch import nn

from linformer_lab.feature_maps.base import FeatureMap, KernelForm
from linformer_lab.validation import check_at_least


def _check_num_features(num_features: int | None, query_dim: int) -> int:
    check_at_least("num_features", num_features, 1, "rows of W; None = query_dim", allow_none=True)
    return query_dim if num_features is None else num_features


class T2RFeatureMap(FeatureMap):
    """``phi(x) = relu(W x + b)``, ``W (num_features, D)`` and ``b`` learned.

    Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs" (T2R), §2.2, eq. 4: one map
    for queries and keys alike, learned while the converted model is fine-tuned; here one per
    layer, shared by its heads. Initialised at random as the paper does (``nn.Linear``'s uniform
    in +-1/sqrt(D)). Non-negative; it can be exactly zero (then the normaliser is ``eps`` alone).

    Args:
        num_features: ``output_dim`` (default: D).
    """

    kernel_form = KernelForm("t2r", kernels=("fused_step",), projections=("projection",))

    def __init__(self, query_dim: int, num_features: int | None = None):
        super().__init__(query_dim)
        self.projection = nn.Linear(query_dim, _check_num_features(num_features, query_dim))

    @property
    def output_dim(self) -> int:
        return self.projection.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return torch.relu(self.projection(x))


class HedgehogFeatureMap(FeatureMap):
    """``phi(x) = [softmax(W x + b), softmax(-(W x + b))]``, learned, queries and keys apart.

    Zhang et al. 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax
    Mimicry", §4.1: ``phi_mlp(x) = [exp(W^T x + b), exp(-W^T x - b)]``, in the softmax form (each
    half normalised over its features) of their implementation, bounded in half precision.
    Queries and keys get maps of their own (``query_map``, ``key_map``), each shared by a layer's
    heads, both starting as the identity (``W = I``, ``b = 0``) as in the paper, so training starts
    from the spiky, monotonic exp of the raw dot products. Features are positive and sum to 2:
    ``output_dim = 2 num_features``.

    ``forward`` maps keys (so does ``forward_keys``); ``forward_queries`` maps queries.

    Args:
        num_features: rows of W (default: D); W starts as the first ``num_features`` rows of an
            identity (padded with zero rows past D).
    """

    kernel_form = KernelForm("hedgehog", kernels=("fused_step",), projections=("query_map", "key_map"))

    def __init__(self, query_dim: int, num_features: int | None = None):
        super().__init__(query_dim)
        num_features = _check_num_features(num_features, query_dim)
        self.query_map = nn.Linear(query_dim, num_features)
        self.key_map = nn.Linear(query_dim, num_features)
        with torch.no_grad():
            for layer in (self.query_map, self.key_map):
                layer.weight.copy_(torch.eye(num_features, query_dim))
                layer.bias.zero_()

    @property
    def output_dim(self) -> int:
        return 2 * self.query_map.out_features

    @staticmethod
    def _features(projected: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.softmax(projected, dim=-1), torch.softmax(-projected, dim=-1)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_keys(x)

    def forward_keys(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self._features(self.key_map(x))

    def forward_queries(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self._features(self.query_map(x))
