"""Second-order Taylor expansion of exp(q^T k / sqrt(D)) (Based, Arora et al. 2024)."""

from __future__ import annotations

import torch

from linformer_lab.feature_maps.packed_square import SecondOrderFeatureMap


class TaylorFeatureMap(SecondOrderFeatureMap):
    """``phi(q)^T phi(k) = 1 + t + t^2 / 2`` with ``t = q^T k / sqrt(D)``: exp(t) to second order.

    Arora et al. 2024, "Simple linear attention language models balance the recall-throughput
    tradeoff" (Based), §3.1: the feature map ``phi(x) = [1, x / D^(1/4), (x x^T) / (sqrt(2) sqrt(D))]``
    flattened; here the second-order map with a = 1, b = 1 / sqrt(2), the outer product packed to
    its upper triangle (the kernel is the same). ``1 + t + t^2 / 2 = ((t + 1)^2 + 1) / 2 >= 1/2``
    for every t: the normaliser never comes near zero, whatever the inputs.
    """

    linear_weight = 1.0
    square_weight = 0.5**0.5

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``1 + t + t^2 / 2``, ``t = q^T k / sqrt(D)``, from the dot products themselves."""
        t = q @ k.transpose(-1, -2) / self.query_dim**0.5
        return 1 + t + t * t / 2
