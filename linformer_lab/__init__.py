"""linformer_lab: linear attention from "Transformers are RNNs" (Katharopoulos et al. 2020).

Public API::

    import linformer_lab as ll
    ll.list_feature_maps()                      # ['elu', 'favor', 'poly2', 'random_fourier', ...]
    ll.list_attention()                         # ['linear', 'linear_cuda', 'lsh', 'softmax', ...]
    fm = ll.build_feature_map("elu", query_dim=32)
    attn = ll.build_attention("linear", causal=True, query_dim=32, feature_map="favor")
    out = attn(q, k, v, key_lengths=None)       # (B, H, N, D), (B, H, N, D), (B, H, N, M) -> (B, H, N, M)
    out_t, state = attn.step(q_t, k_t, v_t)     # RNN mode: (B, H, D), (B, H, D), (B, H, M) -> (B, H, M)
"""

from __future__ import annotations

from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError

__version__ = "0.1.0"


def list_feature_maps() -> list[str]:
    """Sorted names of every installed feature map (entry-point group ``linformer_lab.feature_maps``)."""
    return FEATURE_MAPS.names()


def list_attention() -> list[str]:
    """Sorted names of every installed attention backend (group ``linformer_lab.attention``)."""
    return ATTENTION.names()


def build_feature_map(name: str, query_dim: int, **kwargs):
    """Build the feature map registered as ``name``: an nn.Module ``(..., D) -> (..., output_dim)``."""
    from linformer_lab.feature_maps import FeatureMap

    cls = FEATURE_MAPS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
        raise PluginError(f"feature map {name!r} is registered as {cls!r}, which is not a linformer_lab.feature_maps.FeatureMap subclass")
    return cls(query_dim=query_dim, **kwargs)


def build_attention(name: str, causal: bool = False, query_dim: int | None = None, feature_map=None, **kwargs):
    """Build the attention backend registered as ``name`` (see :class:`linformer_lab.attention.Attention`).

    ``feature_map``: a registered name, a FeatureMap instance or None (the backend's default,
    ``elu`` for linear backends); an error for backends that take none (softmax, lsh).
    """
    from linformer_lab.attention.base import Attention

    cls = ATTENTION.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
        raise PluginError(f"attention backend {name!r} is registered as {cls!r}, which is not a linformer_lab.attention.Attention subclass")
    return cls(causal=causal, query_dim=query_dim, feature_map=feature_map, **kwargs)


__all__ = [
    "PluginError",
    "build_attention",
    "build_feature_map",
    "list_attention",
    "list_feature_maps",
]
