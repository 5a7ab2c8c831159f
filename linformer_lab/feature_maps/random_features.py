"""Shared machinery of the random-feature maps (random Fourier and FAVOR+)."""

from __future__ import annotations

import torch

from linformer_lab.feature_maps.base import FeatureMap
from linformer_lab.validation import check_at_least


def draw_gaussian_projection(
    num_features: int, dim: int, orthogonal: bool, generator: torch.Generator
) -> torch.Tensor:
    """Rows w_r ~ N(0, I_dim), shape ``(num_features, dim)``; with ``orthogonal``, orthogonal within
    each block of ``dim`` rows (lower variance, Choromanski et al. 2021), each rescaled to the norm
    of an independent Gaussian vector, so every row keeps the N(0, I) marginal (unbiased estimate)."""
    if not orthogonal:
        return torch.randn(num_features, dim, generator=generator)
    blocks = []
    for start in range(0, num_features, dim):
        gaussian = torch.randn(dim, dim, generator=generator)
        q, r = torch.linalg.qr(gaussian)
        # fix the signs so Q is Haar-distributed; raw QR output is biased towards R_ii > 0
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T[: min(dim, num_features - start)])
    rows = torch.cat(blocks)
    norms = torch.randn(num_features, dim, generator=generator).norm(dim=1, keepdim=True)
    return rows * norms


class RandomFeatureMap(FeatureMap):
    """Base of maps built on a random Gaussian projection ``W (num_features, D)``, a persistent
    buffer, so a checkpoint restores the exact features the model was trained with.

    Args:
        num_features: m, the rows of W.
        orthogonal: orthogonal rows within blocks of D (:func:`draw_gaussian_projection`).
        seed: seed of the initial draw; :meth:`redraw` draws anew (from ``generator`` if given,
            else from a generator advanced from ``seed``).
    """

    def __init__(self, query_dim: int, num_features: int = 256, orthogonal: bool = True, seed: int = 0):
        super().__init__(query_dim)
        check_at_least("num_features", num_features, 1, "rows of the random projection W")
        self.num_features = num_features
        self.orthogonal = orthogonal
        self._generator = torch.Generator().manual_seed(seed)
        self.register_buffer("projection", torch.empty(num_features, query_dim))
        self.redraw()

    def redraw(self, generator: torch.Generator | None = None) -> None:
        w = draw_gaussian_projection(self.num_features, self.query_dim, self.orthogonal, generator or self._generator)
        with torch.no_grad():
            self.projection.copy_(w.to(self.projection.device, self.projection.dtype))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale x by D^(-1/4) (so x'^T y' = x^T y / sqrt(D)) and project; computed in at
        least fp32 because the maps exponentiate. Returns ``(x' W^T, |x'|^2 / 2)``."""
        self._check_input(x)
        compute = torch.promote_types(x.dtype, torch.float32)
        x = x.to(compute) * self.query_dim ** -0.25
        return x @ self.projection.to(compute).T, 0.5 * (x * x).sum(-1, keepdim=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_features={self.num_features}, orthogonal={self.orthogonal}"
