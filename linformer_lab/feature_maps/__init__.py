"""Feature maps phi for linear attention, sim(q, k) = phi(q)^T phi(k).

Each lives in its own module and is registered by entry point (group
``linformer_lab.feature_maps``); build them by name with :func:`build_feature_map`.
"""

from __future__ import annotations

from linformer_lab.feature_maps.base import FeatureMap
from linformer_lab.registry import FEATURE_MAPS


def list_feature_maps() -> list[str]:
    """Sorted names of every installed feature map (entry-point group ``linformer_lab.feature_maps``)."""
    return FEATURE_MAPS.names()


def build_feature_map(name: str, query_dim: int, **kwargs) -> FeatureMap:
    """Build the feature map registered as ``name``: an nn.Module ``(..., D) -> (..., output_dim)``."""
    return FEATURE_MAPS.build(name, FeatureMap, query_dim=query_dim, **kwargs)


__all__ = ["FeatureMap", "build_feature_map", "list_feature_maps"]
