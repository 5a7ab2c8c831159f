"""Pieces shared by the tasks: how a config names its attention."""

from __future__ import annotations

from dataclasses import dataclass, field

from linformer_lab.registry import ATTENTION, FEATURE_MAPS


@dataclass
class AttentionConfig:
    """Which attention a model uses, by registered name, e.g. in YAML::

        model:
          attention:
            backend: lsh
            kwargs: {n_hashes: 4, bucket_size: 29, n_buckets: 64}

    or on the command line: ``--model.attention.backend softmax``.

    Attributes:
        backend: a registered attention backend (``linformer_lab plugins`` lists them).
        feature_map: a registered feature map for linear backends; None = the backend's default.
        feature_map_kwargs: arguments of the feature map (e.g. ``{num_features: 64}``).
        kwargs: further backend arguments (e.g. lsh's ``n_hashes``).
    """

    backend: str = "linear"
    feature_map: str | None = None
    feature_map_kwargs: dict = field(default_factory=dict)
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        # Fail at config-parsing time, with the valid choices, rather than mid-training.
        backend_cls = ATTENTION.get(self.backend)
        if self.feature_map is not None:
            FEATURE_MAPS.get(self.feature_map)
            if not getattr(backend_cls, "uses_feature_map", False):
                raise ValueError(
                    f"attention backend {self.backend!r} takes no feature map (got feature_map={self.feature_map!r}); "
                    f"feature maps apply to: {', '.join(n for n in ATTENTION.names() if _uses_feature_map(n))}"
                )
        if self.feature_map_kwargs and not getattr(backend_cls, "uses_feature_map", False):
            raise ValueError(f"attention backend {self.backend!r} takes no feature map, so feature_map_kwargs must be empty")

    def transformer_kwargs(self) -> dict:
        """Arguments for :class:`linformer_lab.models.transformer.Transformer`."""
        kwargs = dict(self.kwargs)
        if self.feature_map_kwargs:
            kwargs["feature_map_kwargs"] = dict(self.feature_map_kwargs)
        return {"attention": self.backend, "feature_map": self.feature_map, "attention_kwargs": kwargs}


def _uses_feature_map(name: str) -> bool:
    try:
        return bool(getattr(ATTENTION.get(name), "uses_feature_map", False))
    except Exception:
        return False
