"""FAVOR+ positive random features (Choromanski et al. 2021) for the softmax kernel."""

from __future__ import annotations

import math

import torch

from linformer_lab.feature_maps.random_features import RandomFeatureMap


class FavorFeatureMap(RandomFeatureMap):
    """phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m),  x' = x / D^(1/4),  rows of W ~ N(0, I).

    E_w[exp(w^T q' - |q'|^2/2) exp(w^T k' - |k'|^2/2)] = exp(q'^T k') = exp(q^T k / sqrt(D)):
    an unbiased estimate of the softmax kernel whose features are always > 0, so the normaliser
    is positive. Queries subtract their own max exponent before exp(): a per-query factor cancels
    between numerator and normaliser (eq. 5) and keeps exp() from overflowing. Keys cannot (a
    per-key factor would not cancel): the plain formula, clamped at the dtype's smallest normal
    number where exp() underflows, so features stay > 0 in floating point too.
    """

    @property
    def output_dim(self) -> int:
        return self.num_features

    def _features(self, x: torch.Tensor, stabilise: bool) -> torch.Tensor:
        projected, half_sq_norm = self._project(x)
        exponent = projected - half_sq_norm
        if stabilise:
            exponent = exponent - exponent.amax(dim=-1, keepdim=True).detach()
        out = torch.exp(exponent) / math.sqrt(self.num_features)
        out = out if x.dtype == torch.float64 else out.to(x.dtype)
        # exp() underflows to 0 for keys far from every w; keep features strictly positive
        return out.clamp_min(torch.finfo(out.dtype).tiny)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._features(x, stabilise=False)

    def forward_queries(self, x: torch.Tensor) -> torch.Tensor:
        return self._features(x, stabilise=True)
