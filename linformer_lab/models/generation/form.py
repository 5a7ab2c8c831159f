"""Is this stack of the paper's form, and if not, why not: the question every fast generation
path asks before it reads a layer's parts directly instead of calling its ``step``.

The paper's layer (§3.1, eq. 2 with a pre-norm residual block) is a :class:`TransformerLayer` with
``norm_first=True``, LayerNorms with weight and bias, a ``Linear-GELU-Dropout-Linear``
feed-forward and a :class:`MultiHeadAttention` with its fused ``qkv`` / ``out`` projections. The
fast paths differ in the attention they compute (``attention`` below):

* :data:`ANY_ATTENTION`: the Python step (``dynamic_step.fast_step``), any backend through its
  own ``step``;
* :data:`LINEAR_OR_SOFTMAX`: the graph step (``graph_step``), causal linear or softmax attention;
* :data:`LINEAR_FUSED`: the C++ step (``cpu_step``), eq. 18-20 with the feature maps whose
  ``kernel_form`` names ``"fused_step"`` (elu + 1, t2r, hedgehog), separate keys, and one
  feature map, set of head sizes, attention eps and GELU form for the whole stack.

Types are checked exactly, feature maps too: the fast paths would bypass a subclass's override
(a subclass of ``T2RFeatureMap`` has no ``kernel_form`` unless it states one).
"""

from __future__ import annotations

from torch import nn

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.attention.softmax import SoftmaxAttention
from linformer_lab.models.transformer import Transformer, TransformerLayer
from linformer_lab.ops.linear_attention import computed_in

__all__ = ["ANY_ATTENTION", "ATTENTION_FORMS", "LINEAR_FUSED", "LINEAR_OR_SOFTMAX",
           "has_linear_step", "why_not_paper_form", "why_not_paper_layer"]

ANY_ATTENTION = "any"
LINEAR_OR_SOFTMAX = "linear-or-softmax"
LINEAR_FUSED = "linear-fused"
#: The ``attention`` argument's choices, from the loosest to the strictest.
ATTENTION_FORMS = (ANY_ATTENTION, LINEAR_OR_SOFTMAX, LINEAR_FUSED)


def has_linear_step(backend) -> bool:
    """True for linear attention whose recurrent step is ``LinearAttention.step`` (eq. 18-20 on a
    ``[S | Z]`` state), the step the fast paths compute in place."""
    return isinstance(backend, LinearAttention) and type(backend).step is LinearAttention.step


def _has_softmax_step(backend) -> bool:
    return isinstance(backend, SoftmaxAttention) and type(backend).step is SoftmaxAttention.step


def _affine_layer_norm(norm) -> bool:
    return type(norm) is nn.LayerNorm and norm.weight is not None and norm.bias is not None \
        and len(norm.normalized_shape) == 1


def why_not_paper_layer(layer, attention: str = LINEAR_FUSED) -> str | None:
    """None when ``layer`` is the paper's layer with an ``attention`` the path computes (one of
    :data:`ATTENTION_FORMS`), else why not, as a phrase about the layer ("it is post-norm ...")."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"unknown attention form {attention!r}; valid choices: {', '.join(ATTENTION_FORMS)}")
    if type(layer) is not TransformerLayer:
        return f"it is a {type(layer).__name__}, not a TransformerLayer"
    if not layer.norm_first:
        return "it is post-norm (norm_first=False); the fast steps are written for pre-norm layers"
    if not (_affine_layer_norm(layer.norm_attention) and _affine_layer_norm(layer.norm_ff)):
        return "its norms are not LayerNorms with weight and bias over the last dimension"
    parts = list(layer.feedforward)
    kinds = (nn.Linear, nn.GELU, nn.Dropout, nn.Linear)
    if len(parts) != len(kinds) or any(type(part) is not kind for part, kind in zip(parts, kinds)):
        names = "-".join(type(part).__name__ for part in parts)
        return f"its feed-forward is {names}, not Linear-GELU-Dropout-Linear"
    if type(layer.attention) is not MultiHeadAttention:
        return f"its attention is a {type(layer.attention).__name__}, not a MultiHeadAttention"
    backend = layer.attention.attention
    if attention == LINEAR_OR_SOFTMAX:
        if not (has_linear_step(backend) or _has_softmax_step(backend)) or not backend.causal:
            return f"it uses {type(backend).__name__}, which has no static-buffer step (linear or causal softmax)"
    elif attention == LINEAR_FUSED:
        if not has_linear_step(backend):
            return f"it uses {type(backend).__name__}, not linear attention with LinearAttention's step"
        if not computed_in("fused_step", backend.feature_map):
            return (f"its feature map is {type(backend.feature_map).__name__}, not one the fused step computes "
                    "(its kernel_form does not name fused_step)")
        if layer.attention.shares_query_key:
            return "its queries are its keys (shared QK); the fused step takes separate keys"
    return None


def _map_and_size(feature_map) -> str:
    return f"{type(feature_map).__name__} of {feature_map.output_dim} features"


def why_not_paper_form(transformer: Transformer, attention: str = LINEAR_FUSED) -> str | None:
    """None when every layer of ``transformer`` passes :func:`why_not_paper_layer` for
    ``attention``, its final norm is a LayerNorm with weight and bias and, for
    :data:`LINEAR_FUSED`, the layers agree as the module docstring says; else the first reason
    it is not (naming the layer)."""
    for i, layer in enumerate(transformer.layers):
        why = why_not_paper_layer(layer, attention)
        if why is not None:
            return f"layer {i}: {why}"
    if not _affine_layer_norm(transformer.norm):
        return "the final norm is not a LayerNorm with weight and bias over the last dimension"
    if attention == LINEAR_FUSED:
        # One map for the stack (kind and state size C): per-layer maps would cost a branch and a
        # weight count per layer for stacks nobody builds (a model's settings name one map).
        for what, value in (("head sizes", lambda layer: (layer.attention.n_heads, layer.attention.query_dim,
                                                          layer.attention.value_dim)),
                            ("feature map", lambda layer: _map_and_size(layer.attention.attention.feature_map)),
                            ("attention eps", lambda layer: float(layer.attention.attention.eps)),
                            ("GELU form", lambda layer: layer.feedforward[1].approximate)):
            values = {value(layer) for layer in transformer.layers}
            if len(values) > 1:
                return f"the layers differ in {what} ({', '.join(sorted(map(str, values)))}); the fused step takes one"
    return None
