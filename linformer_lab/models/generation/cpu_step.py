"""The fused C++ CPU step behind :func:`~linformer_lab.models.generation.fast_step`: when it
applies and the weights it reads (generation-side speed code, docs/ARCHITECTURE.md).

At batch 1 a step of the paper's MNIST model (8 layers, d_model 256) runs about 40 small tensor
operations per layer, each costing microseconds of dispatch besides its arithmetic.
``linformer_lab/ops/cpu/fused_step.cpp`` runs the whole stack's step in one call: per layer
the norms, linear attention's state update and readout, the biases and the residuals as plain
loops, the four weight products through ATen's CPU ``mm`` (the BLAS of the ``addmm`` that
``fast_step`` calls) on the same transposed weights, and the GELU through ATen's kernel. Same
arithmetic up to summation order (``tests/models/test_fused_step.py`` holds it to ``Transformer.step``).

:func:`step` takes it when all of these hold, and otherwise leaves the step to ``fast_step``'s
Python path (the reference, which also raises the errors for states that do not fit):

* :mod:`linformer_lab.ops.kernels` picks the C++ candidate of its ``fused_step`` op: CPU inputs,
  float32 or float64, CPU autocast off, at most :data:`FUSED_MAX_BATCH` rows, the extension
  built or buildable, and no ``LINFORMER_LAB_KERNELS`` forcing the reference;
* the stack's linear layers hold ``"model"`` weight copies (inside
  ``weight_copies_for_steps(..., "model")``, as in ``PixelTransformer.generate``): the copies
  say the weights are fixed for the block, and the fused step reads them;
* every layer is a ``TransformerLayer`` with a ``MultiHeadAttention`` (separate keys) over the
  ``linear`` backend with the ``elu`` feature map, LayerNorms with weight and bias, a GELU
  feed-forward, the same head sizes in every layer, float32 or float64 weights on CPU;
* a state from an earlier step or a prefill (a list of ``LinearState``; a sequence's first step
  makes it on the Python path), inputs of the weights' dtype.

It needs no autograd and eval mode, which ``fast_step`` checks before.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.models.transformer import Transformer, TransformerLayer
from linformer_lab.ops import kernels
from linformer_lab.ops.kernels import FUSED_MAX_BATCH
from linformer_lab.ops.linear_attention import LinearState

__all__ = ["FUSED_MAX_BATCH", "release", "step"]


class _Plan:
    """A stack's fused step for one block of weight copies: ``marker`` is the copy held by the
    first layer's qkv projection when the plan was made (a new block makes new copies)."""

    __slots__ = ("qkv", "marker", "stack", "dtype", "layers")

    def __init__(self, qkv: nn.Linear, marker, stack, dtype: torch.dtype | None, layers: int):
        self.qkv, self.marker, self.stack, self.dtype, self.layers = qkv, marker, stack, dtype, layers


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Transformer -> _Plan


def step(transformer: Transformer, x_t: torch.Tensor, state, copy_attribute: str):
    """``fast_step(transformer, x_t, state)`` through the fused C++ step: ``(out, state)``, with the
    state's ``[S | Z]`` buffers updated in place; None where it does not apply (module docstring).
    ``copy_attribute``: the attribute under which ``weight_copies_for_steps`` gives a linear layer
    its weight copy."""
    kernel = None if state is None else kernels.select("fused_step", x_t)
    if kernel is None or kernel.name == kernels.REFERENCE:
        return None
    plan = _PLANS.get(transformer)
    if plan is None or plan.qkv.__dict__.get(copy_attribute) is not plan.marker:
        plan = _make_plan(transformer, copy_attribute, kernel.run)
        if plan is None:
            return None
    if plan.stack is None or x_t.dtype != plan.dtype or len(state) != plan.layers:
        return None
    joints = []
    for layer_state in state:
        if type(layer_state) is not LinearState:
            return None
        joints.append(layer_state.joint)
    try:
        out = plan.stack.step(x_t, joints)
    except RuntimeError:  # checked before any state changes: shapes, dtypes, layouts that do not fit
        return None
    return out, list(state)


def release(module: nn.Module) -> None:
    """Forget the fused steps made for the transformers in ``module`` (and the weight copies they
    hold): ``weight_copies_for_steps`` calls it when its block ends."""
    for sub in module.modules():
        _PLANS.pop(sub, None)


def _make_plan(transformer: Transformer, copy_attribute: str, make_stack) -> _Plan | None:
    """A plan for the copies held now; None (and nothing remembered) when there are none.
    ``make_stack``: the selected kernel's ``run``, which builds its ``FusedStack``."""
    if not transformer.layers:
        return None
    qkv = getattr(getattr(transformer.layers[0], "attention", None), "qkv", None)
    marker = qkv.__dict__.get(copy_attribute) if isinstance(qkv, nn.Linear) else None
    if marker is None:
        return None
    found = _fused_form(transformer, lambda linear: linear.__dict__.get(copy_attribute))
    stack, dtype = None, None
    if found is not None:
        weights, norm_eps, sizes, eps, approximate = found
        try:
            stack = make_stack(weights, norm_eps, *sizes, eps, approximate)
            dtype = weights[0].dtype
        except RuntimeError:  # shapes the fused step does not take (e.g. d_ff differing by layer)
            stack = None
    plan = _PLANS[transformer] = _Plan(qkv, marker, stack, dtype, len(transformer.layers))
    return plan


def _fused_form(transformer: Transformer, held_copy):
    """``(weights, norm eps, (heads, query dim, value dim), attention eps, GELU approximate)`` in
    the order ``FusedStack`` takes them, or None when the stack is not of the form it computes."""
    weights, norm_eps, sizes, eps, approximate = [], [], set(), set(), set()
    for layer in transformer.layers:
        if type(layer) is not TransformerLayer or type(layer.attention) is not MultiHeadAttention or not layer.norm_first:
            return None
        attention, backend = layer.attention, layer.attention.attention
        if attention.shares_query_key or not isinstance(backend, LinearAttention) \
                or type(backend).step is not LinearAttention.step or type(backend.feature_map) is not EluFeatureMap:
            return None
        up, activation, _, down = layer.feedforward
        if type(activation) is not nn.GELU:
            return None
        layer_weights = []
        for part in (layer.norm_attention, attention.qkv, attention.out, layer.norm_ff, up, down):
            if isinstance(part, nn.LayerNorm):
                if part.weight is None or part.bias is None or len(part.normalized_shape) != 1:
                    return None
                layer_weights += [part.weight.detach(), part.bias.detach()]
                norm_eps.append(float(part.eps))
                continue
            copy = held_copy(part)
            weight_t = getattr(copy, "weight_t", None)
            if copy is None or copy.format != "model" or weight_t is None or copy.bias is None:
                return None
            layer_weights += [weight_t, copy.bias]
        weights += layer_weights
        sizes.add((attention.n_heads, attention.query_dim, attention.value_dim))
        eps.add(float(backend.eps))
        approximate.add(activation.approximate)
    norm = transformer.norm
    if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
        return None
    weights += [norm.weight.detach(), norm.bias.detach()]
    norm_eps.append(float(norm.eps))
    dtype = weights[0].dtype
    if len(sizes) != 1 or len(eps) != 1 or len(approximate) != 1 or dtype not in (torch.float32, torch.float64) \
            or any(w.device.type != "cpu" or w.dtype != dtype or not w.is_contiguous() for w in weights):
        return None
    return weights, norm_eps, sizes.pop(), eps.pop(), approximate.pop()
