"""How a model names its attention: :class:`AttentionConfig`, and the builder behind it.

A config is plain data (a registered backend name, an optional feature map, their keyword
arguments), so it round-trips through YAML, the command line and a checkpoint's hparams;
:meth:`AttentionConfig.build` makes the :class:`~linformer_lab.attention.base.Attention` module.
Where a user's form is coerced, once (:meth:`AttentionConfig.coerce`, :func:`as_config`,
:func:`layer_attention`): docs/ARCHITECTURE.md, "The configuration boundary".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from linformer_lab.attention.base import Attention, backends_with
from linformer_lab.registry import ATTENTION, FEATURE_MAPS


def list_attention() -> list[str]:
    """Sorted names of every installed attention backend (group ``linformer_lab.attention``)."""
    return ATTENTION.names()


def build_attention(name: str, causal: bool = False, query_dim: int | None = None, feature_map=None, **kwargs) -> Attention:
    """Build the attention backend registered as ``name`` (see :class:`Attention`).

    ``feature_map``: a registered name, a FeatureMap instance or None (the backend's default,
    ``elu`` for linear backends); an error for backends that take none (softmax, lsh).
    """
    return ATTENTION.build(name, Attention, causal=causal, query_dim=query_dim, feature_map=feature_map, **kwargs)


@dataclass
class AttentionConfig:
    """Which attention a model uses, by registered name, e.g. in YAML::

        model:
          attention:
            backend: lsh
            kwargs: {n_hashes: 4, bucket_size: 29, n_buckets: 64}

    or on the command line: ``--model.attention.backend softmax``.

    Attributes:
        backend: a registered attention backend (``python cli.py plugins`` lists them).
        feature_map: a registered feature map for linear backends; None = the backend's default.
        feature_map_kwargs: arguments of the feature map (e.g. ``{num_features: 64}``).
        kwargs: further backend arguments (e.g. lsh's ``n_hashes``).
    """

    backend: str = "linear"
    feature_map: str | None = None
    feature_map_kwargs: dict = field(default_factory=dict)
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        # fail at config-parsing time, with the valid choices, rather than mid-training
        backend_cls = ATTENTION.get(self.backend)
        uses_feature_map = bool(getattr(backend_cls, "uses_feature_map", False))
        if self.feature_map is not None:
            FEATURE_MAPS.get(self.feature_map)
            if not uses_feature_map:
                raise ValueError(
                    f"attention backend {self.backend!r} takes no feature map (got feature_map={self.feature_map!r}): "
                    f"set feature_map to None (on the command line: --model.attention.feature_map null); "
                    f"feature maps apply to: {backends_with('uses_feature_map')}"
                )
        if self.feature_map_kwargs and not uses_feature_map:
            raise ValueError(f"attention backend {self.backend!r} takes no feature map, so feature_map_kwargs must be empty "
                             f"(on the command line: --model.attention.feature_map_kwargs '{{}}')")

    @classmethod
    def coerce(cls, attention: AttentionConfig | str | dict | None) -> AttentionConfig:
        """None (the default, ``linear`` with ``elu``), a backend name, a dict of the fields
        (as saved in a checkpoint's hparams) or a config -> a config."""
        if attention is None:
            return cls()
        if isinstance(attention, cls):
            return attention
        if isinstance(attention, str):
            return cls(backend=attention)
        if isinstance(attention, dict):
            unknown = sorted(set(attention) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(
                    f"unknown attention field(s) {unknown}; valid fields: "
                    f"{', '.join(f.name for f in dataclasses.fields(cls))}"
                )
            return cls(**attention)
        raise ValueError(
            f"attention must be an AttentionConfig, a backend name, a dict of AttentionConfig fields or None; "
            f"got {type(attention).__name__}"
        )

    def to_hparams(self) -> dict:
        """Plain dict of the fields (what a checkpoint stores; :meth:`coerce` reads it back)."""
        return dataclasses.asdict(self)

    def build(self, causal: bool, query_dim: int) -> Attention:
        """The backend module for one attention layer of per-head size ``query_dim``."""
        kwargs = dict(self.kwargs)
        if self.feature_map_kwargs:
            kwargs["feature_map_kwargs"] = dict(self.feature_map_kwargs)
        return build_attention(self.backend, causal=causal, query_dim=query_dim, feature_map=self.feature_map, **kwargs)


def as_config(attention, owner: str) -> AttentionConfig:
    """The ``attention`` argument of a constructor that builds several layers (``owner`` names it in
    the error) as a config, coerced unless it is one; a built :class:`Attention` is a TypeError."""
    if isinstance(attention, AttentionConfig):
        return attention
    if isinstance(attention, Attention):
        raise TypeError(
            f"{owner} builds one attention per layer, so it takes a backend name, a dict of AttentionConfig fields, an "
            f"AttentionConfig or None, not one built {type(attention).__name__} (one module cannot serve every layer; "
            f"TransformerLayer and MultiHeadAttention take a built one)"
        )
    return AttentionConfig.coerce(attention)


def layer_attention(attention, causal: bool, query_dim: int) -> Attention:
    """The ``attention`` argument of a constructor that makes one attention layer, as a module: a
    built :class:`Attention` as it is, anything else through :func:`as_config`, built for ``causal``
    and per-head ``query_dim``."""
    if isinstance(attention, Attention):
        return attention
    return as_config(attention, "a layer").build(causal=causal, query_dim=query_dim)
