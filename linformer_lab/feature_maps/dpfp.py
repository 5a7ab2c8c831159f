"""Deterministic parameter-free projection (DPFP, Schlag et al. 2021)."""

from __future__ import annotations

import torch

from linformer_lab.feature_maps.base import FeatureMap


class DpfpFeatureMap(FeatureMap):
    """DPFP of Schlag, Irie & Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight
    Programmers", §5.3 (eq. 37): with ``r(x) = [relu(x), relu(-x)]`` in R^(2D),

        phi_(i nu + j)(x) = r_i(x) r_(i + j)(x),   i = 1..2D,  j = 1..nu  (indices mod 2D),

    so ``output_dim = 2 D nu``: products of pairs of the 2D rectified entries, each entry with its
    ``nu`` neighbours. Non-negative; its features of different inputs overlap less as ``nu`` grows
    (the paper's point: a larger, sparser feature space without random draws).

    Args:
        nu: how many neighbours each rectified entry is multiplied with (the paper's nu, 1-3).
    """

    def __init__(self, query_dim: int, nu: int = 1):
        super().__init__(query_dim)
        if not isinstance(nu, int) or not 1 <= nu <= 2 * query_dim - 1:
            raise ValueError(f"nu must be an int from 1 to 2 * query_dim - 1 = {2 * query_dim - 1}, got {nu!r}")
        self.nu = nu

    @property
    def output_dim(self) -> int:
        return 2 * self.query_dim * self.nu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        rectified = torch.cat([torch.relu(x), torch.relu(-x)], dim=-1)  # r(x), (..., 2D)
        # neighbour j of entry i is entry i + j: a roll by -j lines it up with entry i
        neighbours = torch.cat([rectified.roll(-j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)
        # feature (j - 1) 2D + i here is the paper's i nu + j: the same features in another order
        return rectified.repeat(*([1] * (x.dim() - 1)), self.nu) * neighbours

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nu={self.nu}"
