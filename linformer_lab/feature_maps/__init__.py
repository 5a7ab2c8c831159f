"""Feature maps phi for linear attention, sim(q, k) = phi(q)^T phi(k).

Each lives in its own module and is registered by entry point (group
``linformer_lab.feature_maps``); import them through :func:`linformer_lab.build_feature_map`.
"""

from linformer_lab.feature_maps.base import FeatureMap

__all__ = ["FeatureMap"]
