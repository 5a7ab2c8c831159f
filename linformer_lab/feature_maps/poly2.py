"""The exact degree-2 polynomial kernel (paper §3.2.1)."""

from __future__ import annotations

import math

import torch

from linformer_lab.feature_maps.packed_square import SecondOrderFeatureMap
from linformer_lab.ops.reference import polynomial_similarity


class Poly2FeatureMap(SecondOrderFeatureMap):
    """phi(q)^T phi(k) = (1 + q^T k / sqrt(D))^2, exactly.

    With x' = x / D^(1/4) (so x'^T y' = x^T y / sqrt(D)) the kernel expands to
    1 + 2 x'^T y' + (x'^T y')^2: the second-order map with a = sqrt(2), b = 1,

        phi(x) = [1, sqrt(2) x', x'_i^2 (i), sqrt(2) x'_i x'_j (i < j)]

    The kernel is a square, so it is never negative and the attention normaliser stays >= 0.
    """

    linear_weight = math.sqrt(2.0)
    square_weight = 1.0

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The kernel itself, ``(1 + q^T k / sqrt(D))^2``, without the packed features."""
        return polynomial_similarity(q, k)
