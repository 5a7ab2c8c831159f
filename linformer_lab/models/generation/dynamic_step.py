"""The Python generation step, :func:`fast_step`: the one-position RNN step (paper §3.4) made fast
at small batch sizes.

:meth:`Transformer.step <linformer_lab.models.transformer.Transformer.step>`, the readable
recurrent path, is module calls and each backend's own ``step``; at small batch sizes that is a
few dozen operations on ``(B, d_model)`` rows, whose time goes to per-operation costs (module
calls, argument handling, thread start-up, reading the weights), not arithmetic.
``tests/models/test_generation.py`` checks :func:`fast_step` equals it for every backend and
feature map. Layers of the paper's form (:func:`~linformer_lab.models.generation.form.why_not_paper_layer`)
step here, through the weight copies of :mod:`~linformer_lab.models.generation.weights`; other
layers through ``TransformerLayer.step``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.feature_maps import FeatureMap
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.models.generation import cpu_step
from linformer_lab.models.generation.form import ANY_ATTENTION, has_linear_step, why_not_paper_layer
from linformer_lab.models.generation.weights import step_linear, weight_copies_for_steps
from linformer_lab.models.transformer import Transformer, TransformerLayer
from linformer_lab.ops import kernels
from linformer_lab.ops.linear_attention import StateOwner, check_step_fits_state, elu_plus_one
from linformer_lab.ops.state import LinearState, SequenceBuffer, StackState

__all__ = ["CPU_MATMUL_MIN_ROWS", "fast_step", "fused_steps", "layer_norm", "split_heads"]

#: On CPU, :func:`fast_step` computes linear attention's ``phi(q)^T [S | Z]`` as a batched matmul
#: when the state has at least this many (batch x head) rows, and as a broadcast product + sum
#: below: a batched matmul of (1, C) x (C, M + 1) costs more in BLAS set-up than the arithmetic at
#: a few rows, and from here on the product's (B, H, C, M + 1) temporary costs more than that set-up.
CPU_MATMUL_MIN_ROWS = 32
_OWNED = StateOwner()  # the linear states fast_step made, the only ones it updates in place (others: copied first)


def fast_step(transformer: Transformer, x_t: torch.Tensor, state: list | SequenceBuffer | None = None):
    """:meth:`Transformer.step` for inference: ``x_t (B, d_model) -> (out (B, d_model), state)``
    (a :class:`~linformer_lab.ops.state.StackState`), the same arithmetic up to summation order
    (and the weight copies of :func:`~linformer_lab.models.generation.weights.weight_copies_for_steps`),
    in fewer tensor operations.

    Needs eval mode (it applies no dropout) and no autograd (``torch.no_grad()`` or
    ``torch.inference_mode()``): a linear state it made is updated in place, one from elsewhere
    copied first. Per layer: :func:`layer_norm`, the linear layers through
    :func:`~linformer_lab.models.generation.weights.step_linear`, q, k, v as views of the fused
    projection, feature maps through their ``forward`` (no module call: hooks on sub-modules do
    not run), and for linear attention (a backend that keeps ``LinearAttention.step``) its own
    in-place step; other backends through their ``step``. A stack without a recurrent form (lsh)
    goes through ``Transformer.step``. Where :func:`linformer_lab.models.generation.cpu_step.step`
    applies (its module docstring), the step is one C++ call.
    """
    if transformer.training:
        raise RuntimeError("fast_step applies no dropout: call it on a model in eval mode (model.eval()); "
                           "Transformer.step is the step for training mode")
    if torch.is_grad_enabled():
        raise RuntimeError("fast_step updates the attention state in place, without autograd: call it under "
                           "torch.no_grad() or torch.inference_mode(); Transformer.step is the step with gradients")
    # a recurrent form is decided on a sequence's first step, by the kind of state afterwards (no walk over the layers)
    recurrent = transformer.has_recurrent_form if state is None else not isinstance(state, SequenceBuffer)
    if not recurrent:
        return transformer.step(x_t, state)
    if (fused := cpu_step.step(transformer, x_t, (state := _OWNED.take(state)))) is not None:
        return fused
    new_state = StackState()
    for layer, layer_state in zip(transformer.layers, state or [None] * len(transformer.layers)):
        x_t, layer_state = _layer_step(layer, x_t, layer_state)
        new_state.append(layer_state)
    return layer_norm(x_t, transformer.norm), new_state


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` through ``torch.layer_norm`` directly (``F.layer_norm`` reads a backend flag at every call)."""
    return torch.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


#: layer -> (what its form depends on, whether it is the paper's layer): asked again only when a
#: sub-module was replaced, so the per-step cost is a tuple comparison.
_PAPER_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_paper_layer(layer: TransformerLayer) -> bool:
    feedforward = layer._modules.get("feedforward")
    key = (getattr(layer, "norm_first", None), *layer._modules.values(),
           *(feedforward._modules.values() if feedforward is not None else ()))
    cached = _PAPER_LAYERS.get(layer)
    if cached is None or cached[0] != key:  # modules compare by identity
        cached = _PAPER_LAYERS[layer] = (key, why_not_paper_layer(layer, ANY_ATTENTION) is None)
    return cached[1]


def _layer_step(layer: TransformerLayer, x_t: torch.Tensor, state):
    """``TransformerLayer.step`` in eval mode (every dropout the identity): ``(B, d_model) -> ((B, d_model), state)``."""
    if not _is_paper_layer(layer):
        return layer.step(x_t, state)  # e.g. the authors' post-norm / ReLU layer: the readable step, written for all
    attended, state = _attention_step(layer.attention, layer_norm(x_t, layer.norm_attention), state)
    x_t = x_t + attended
    up, activation, _, down = layer.feedforward  # Linear, GELU, Dropout, Linear
    hidden = F.gelu(step_linear(layer_norm(x_t, layer.norm_ff), up), approximate=activation.approximate)
    return x_t + step_linear(hidden, down), state


def _attention_step(attention: MultiHeadAttention, x_t: torch.Tensor, state):
    """``MultiHeadAttention.step``: ``(B, d_model) -> ((B, d_model), state)``."""
    q, k, v = split_heads(attention, step_linear(x_t, attention.qkv))
    backend = attention.attention
    if has_linear_step(backend):
        out, state = _linear_attention_step(backend, q, k, v, state)
    else:
        out, state = backend.step(q, k, v, state)
    return step_linear(out.flatten(1), attention.out), state


def split_heads(attention: MultiHeadAttention, qkv: torch.Tensor):
    """The fused projection ``(B, parts x heads x dim)``, laid out as ``MultiHeadAttention``
    documents, -> q, k, v each ``(B, heads, dim)``, as views; k is q for shared-QK backends."""
    batch, heads = qkv.shape[0], attention.n_heads
    if attention.query_dim == attention.value_dim:  # one view (B, parts, H, dim) instead of split + views
        parts = qkv.view(batch, -1, heads, attention.query_dim).unbind(1)
    else:
        queries, values = heads * attention.query_dim, heads * attention.value_dim
        sizes = [queries, values] if attention.shares_query_key else [queries, queries, values]
        parts = [part.view(batch, heads, -1) for part in qkv.split(sizes, dim=-1)]
    if attention.shares_query_key:
        q, v = parts
        return q, q, v
    return parts


def _linear_attention_step(backend: LinearAttention, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, state):
    """``LinearAttention.step`` (eq. 18-20) on the :class:`LinearState`'s ``[S | Z]`` buffer, in
    place: q_t, k_t ``(B, H, D)``, v_t ``(B, H, M)`` -> ``(out (B, H, M), state)``."""
    if not isinstance(state, LinearState):  # None or (S, Z) built by hand: the backend's step makes the state
        return _OWNED.adopt(*backend.step(q_t, k_t, v_t, state))
    phi_q, phi_k = _features(backend.feature_map, q_t, k_t)
    joint, (s, z) = state.joint, state
    check_step_fits_state(phi_k, v_t, s, z)
    v = v_t
    if phi_q.dtype != joint.dtype or v.dtype != joint.dtype:
        phi_q, phi_k, v = phi_q.to(joint.dtype), phi_k.to(joint.dtype), v.to(joint.dtype)
    s.addcmul_(phi_k.unsqueeze(-1), v.unsqueeze(-2))  # S += phi(k) v^T
    z.add_(phi_k)
    if joint.device.type == "cpu" and joint.shape[0] * joint.shape[1] < CPU_MATMUL_MIN_ROWS:
        both = (phi_q.unsqueeze(-1) * joint).sum(-2)  # (B, H, M + 1) = [phi(q)^T S | phi(q)^T Z]
    elif torch.is_autocast_enabled(joint.device.type):  # the product with the fp32 state stays fp32
        with torch.autocast(joint.device.type, enabled=False):
            both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)
    else:  # the autocast context costs time of its own: entered only when autocast is on
        both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)
    m = s.shape[-1]
    out = both[..., :m] / both[..., m:].add_(_scalar(backend.eps, both))
    return (out if out.dtype == v_t.dtype else out.to(v_t.dtype)), state


def _features(feature_map: FeatureMap, q_t: torch.Tensor, k_t: torch.Tensor):
    """``(feature_map.forward_queries(q_t), feature_map.forward_keys(k_t))``: the paper's elu map
    through :func:`~linformer_lab.ops.linear_attention.elu_plus_one` (same values, fewer
    operations), and a map that keeps the base class's versions (``self(x)``) through ``forward``,
    without the module-call machinery."""
    cls = type(feature_map)
    if cls is EluFeatureMap:
        return elu_plus_one(q_t), elu_plus_one(k_t)
    phi_q = feature_map.forward(q_t) if cls.forward_queries is FeatureMap.forward_queries else feature_map.forward_queries(q_t)
    phi_k = feature_map.forward(k_t) if cls.forward_keys is FeatureMap.forward_keys else feature_map.forward_keys(k_t)
    return phi_q, phi_k


_SCALARS: dict = {}


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor of ``value`` in ``like``'s dtype and device, cached (a float becomes a tensor at every call)."""
    key = (value, like.dtype, like.device)
    scalar = _SCALARS.get(key)
    if scalar is None:
        with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
            scalar = _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return scalar


def fused_steps(x, candidate):
    """``x (B, T, 16)`` through a small linear-attention stack's ``fast_step``, position by position,
    with the fused-step ``candidate`` forced inside a weight-copy block: the fused step's probe for
    ``cli.py plugins --check`` (:func:`linformer_lab.ops.kernel_check.check_kernels`)."""
    torch.manual_seed(0)
    model = Transformer(2, 16, 4, 32, attention="linear").to(device=x.device, dtype=x.dtype).eval()
    outputs, state = [], None
    with kernels.switched(f"fused_step={candidate.name}"), torch.no_grad(), weight_copies_for_steps(model, "model"):
        for t in range(x.shape[1]):
            out, state = fast_step(model, x[:, t], state)
            outputs.append(out)
    return torch.stack(outputs, 1)
