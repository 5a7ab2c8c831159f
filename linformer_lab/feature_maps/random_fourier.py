"""Random Fourier features (Rahimi & Recht 2007) turned into a softmax-kernel estimator."""

from __future__ import annotations

import math

import torch

from linformer_lab.feature_maps.random_features import RandomFeatureMap


class RandomFourierFeatureMap(RandomFeatureMap):
    """Unbiased estimate of the softmax kernel exp(q^T k / sqrt(D)), the paper's closing idea.

    With x' = x / D^(1/4):  exp(q'^T k') = exp(|q'|^2/2) exp(|k'|^2/2) exp(-|q' - k'|^2 / 2),
    and the Gaussian kernel has random Fourier features: for w ~ N(0, I),
    E[cos(w^T q') cos(w^T k') + sin(w^T q') sin(w^T k')] = E[cos(w^T (q' - k'))] = exp(-|q'-k'|^2/2).
    So  phi(x) = exp(|x'|^2 / 2) / sqrt(m) [cos(W x'), sin(W x')],  output_dim = 2 m.

    Note: unlike ``favor`` these features are signed, so for few features the estimated
    normaliser can be close to zero or negative; use many features or ``favor`` for training.
    """

    @property
    def output_dim(self) -> int:
        return 2 * self.num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected, half_sq_norm = self._project(x)
        scale = torch.exp(half_sq_norm) / math.sqrt(self.num_features)
        out = torch.cat([torch.cos(projected), torch.sin(projected)], dim=-1) * scale
        return out if x.dtype == torch.float64 else out.to(x.dtype)
