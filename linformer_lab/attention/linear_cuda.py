"""``linear_cuda``: the name of ``linear`` with its GPU kernels forced (``gpu_kernels=True``)."""

from __future__ import annotations

from linformer_lab.attention.base import Attention
from linformer_lab.attention.linear import LinearAttention, gpu_kernels_unavailable


class LinearCudaAttention(Attention):
    """``linear_cuda``: builds ``LinearAttention(..., gpu_kernels=True)`` (same arguments, feature
    maps, RNN mode, packed sequences and code as ``linear``; see ``gpu_kernels`` there). It is a
    class, and no subclass of ``LinearAttention``, only because the registry holds Attention
    classes and reads a backend's capabilities and :meth:`unavailable_reason` from them: there is
    one linear attention layer, and a ``linear_cuda`` model is made of it."""

    uses_feature_map = LinearAttention.uses_feature_map
    supports_state = LinearAttention.supports_state
    supports_packed = LinearAttention.supports_packed
    has_recurrent_form = LinearAttention.has_recurrent_form

    def __new__(cls, causal: bool = False, query_dim: int | None = None, feature_map=None,
                feature_map_kwargs: dict | None = None, eps: float = 1e-6, chunk_size: int | None = None):
        return LinearAttention(causal, query_dim, feature_map, feature_map_kwargs, eps, chunk_size, gpu_kernels=True)

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run on this machine, or None (``cli.py plugins --check`` asks)."""
        return gpu_kernels_unavailable()
