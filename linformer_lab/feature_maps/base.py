"""The feature-map interface: phi such that sim(q, k) = phi(q)^T phi(k) (paper eq. 4)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn


class KernelForm(NamedTuple):
    """How compiled kernels compute a feature map themselves, in one place for every one of them.

    ``name``: the map's name in the kernels' code (``fused_step.cpp`` takes it); ``kernels``: the
    kernels that apply it, by the names ``ops.linear_attention.computed_in`` is asked with:
    ``"triton"`` (the Triton chunk and step kernels), ``"cpp"`` (the fused C++ causal attention),
    ``"fused_step"`` (generation's C++ step); ``projections``: the map's ``nn.Linear`` attributes
    whose ``[W, b]`` those kernels read, in the order they take them."""

    name: str
    kernels: tuple[str, ...]
    projections: tuple[str, ...] = ()


class FeatureMap(nn.Module):
    """Base class of every feature map; subclasses are registered by entry point.

    Built as ``Cls(query_dim=D, **kwargs)``; maps ``(..., D) -> (..., output_dim)``.
    Queries and keys go through the same map by default; a map that can stabilise
    queries differently (e.g. by a per-query constant that cancels in the attention ratio)
    overrides :meth:`forward_queries`.
    """

    #: The kernels that compute this map themselves (:class:`KernelForm`); None: PyTorch applies it
    #: and the kernels take the mapped inputs.
    kernel_form: ClassVar[KernelForm | None] = None

    def __init_subclass__(cls, **kwargs):
        # A subclass may change the map (its forward, its parameters), which a kernel would skip:
        # the kernels compute only the classes that state their form themselves.
        super().__init_subclass__(**kwargs)
        if "kernel_form" not in cls.__dict__:
            cls.kernel_form = None

    def __init__(self, query_dim: int):
        super().__init__()
        if not isinstance(query_dim, int) or query_dim < 1:
            raise ValueError(f"query_dim must be a positive int, got {query_dim!r}")
        self.query_dim = query_dim

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_queries(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def forward_keys(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """The similarity ``phi(q)^T phi(k)`` for all pairs, ``(..., N, D), (..., L, D) -> (..., N, L)``,
        computed from its closed form rather than through the features; None where the map has
        no closed form of its own (random features only approximate a kernel). Tests use it as
        the independent reference of the map."""
        return None

    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw new random features (no-op for deterministic maps)."""

    def _check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.query_dim:
            raise ValueError(
                f"{type(self).__name__} was built for query_dim={self.query_dim} but got input "
                f"of shape {tuple(x.shape)} (last dim {x.shape[-1]})"
            )

    def extra_repr(self) -> str:
        return f"query_dim={self.query_dim}, output_dim={self.output_dim}"
