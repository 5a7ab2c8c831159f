"""A third-party feature map for linformer_lab: phi(x) = softplus(x), positive like elu + 1."""

import torch

from linformer_lab.feature_maps import FeatureMap


class SoftplusFeatureMap(FeatureMap):
    """phi(x) = log(1 + exp(beta x)) / beta, elementwise; output_dim == query_dim."""

    def __init__(self, query_dim: int, beta: float = 1.0):
        super().__init__(query_dim)
        self.beta = beta

    @property
    def output_dim(self) -> int:
        return self.query_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return torch.nn.functional.softplus(x, beta=self.beta)
