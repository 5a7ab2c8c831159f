"""The weight copies a loop of generation steps reads, and the fused plan made from them.

At small batch sizes a generation step streams every weight matrix from memory once per
position (25 MB per step for the 8-layer MNIST model at fp32, 50 MB for the 16-layer CIFAR-10
model), so its time is set by how fast the matrix-vector products read them, not by arithmetic.

:func:`weight_copies_for_steps` gives every ``nn.Linear`` of a module, for a ``with`` block (a
loop of steps over fixed weights, e.g. ``PixelTransformer.generate``), a copy of its weight in a
format chosen for that, and :func:`step_linear` uses the copy. The formats
(:data:`STEP_WEIGHT_FORMATS`):

``"model"``
    The model's own weights, dtype and values; the same product up to summation order. On CPU
    the copy is the transposed ``(in, out)`` matrix: ``F.linear`` reads the ``(out, in)``
    parameter markedly slower at one row than ``x @ W^T`` with ``W^T`` contiguous. Elsewhere
    no copy is made.
``"bfloat16"``
    The input rounded to bfloat16, the product accumulated in fp32 and rounded to bfloat16 by
    the BLAS, the bias added in the model's dtype. Half the bytes per step.
``"int8"``
    Weight-only int8 (:func:`quantize_int8`); the input is rounded to bfloat16 and
    ``torch._weight_int8pack_mm`` dequantizes on the fly (bfloat16 output, the bias added in the
    model's dtype). A quarter of the bytes per step.

The reduced formats change the numbers (a lossy copy), so they are opt-in; their cost in
bits/dim is measured in ``benchmarks/dev/step_weights_quality.py``. Activations, the attention
state and the output head stay in the model's dtype.

The fused plan
--------------

The C++ CPU step (:mod:`~linformer_lab.models.generation.cpu_step`) reads the ``"model"`` copies
of a stack of the paper's form in one ``FusedStack``, built once per block of copies by
:func:`fused_plan` and forgotten when the block ends: the copies say the weights are fixed for
the block.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.models.generation.form import LINEAR_FUSED, why_not_paper_form
from linformer_lab.models.transformer import Transformer

__all__ = [
    "STEP_WEIGHT_FORMATS",
    "FusedPlan",
    "check_step_weight_format",
    "fused_plan",
    "quantize_int8",
    "step_linear",
    "weight_copies_for_steps",
]

#: The weight formats :func:`weight_copies_for_steps` can make (see the module docstring).
STEP_WEIGHT_FORMATS = ("model", "bfloat16", "int8")

#: ``torch._weight_int8pack_mm`` is only correct for input sizes that are multiples of this.
_INT8_KERNEL_K_MULTIPLE = 16

#: Attribute of an ``nn.Linear`` that holds its step weight inside :func:`weight_copies_for_steps`.
_ATTRIBUTE = "_step_weight"


def step_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` for ``x (B, in)``, through the weight copy that :func:`weight_copies_for_steps`
    holds, if any (no module-call machinery: hooks do not run). Returns ``x``'s dtype."""
    copy = linear.__dict__.get(_ATTRIBUTE)
    if copy is None:
        return F.linear(x, linear.weight, linear.bias)
    return copy(x)


def check_step_weight_format(format: str) -> str:
    if format not in STEP_WEIGHT_FORMATS:
        raise ValueError(f"unknown step weight format {format!r}; valid choices: {', '.join(STEP_WEIGHT_FORMATS)}")
    return format


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(out, in)`` -> ``(q int8 (out, in), scale bf16 (out,))``
    with ``|q * scale - weight| <= scale / 2`` elementwise. The scale is rounded *up* to bfloat16
    (the kernel takes bf16 scales), so ``max|w_i| / scale_i <= 127`` and no weight is clipped; a
    zero row gets scale 1."""
    weight = weight.detach().float()
    wanted = weight.abs().amax(dim=1) / 127
    scale = wanted.to(torch.bfloat16)
    low = scale.float() < wanted
    scale[low] = torch.nextafter(scale[low], torch.full_like(scale[low], float("inf")))
    scale[wanted == 0] = 1
    q = torch.round(weight / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class _Transposed:
    """Format ``"model"`` on CPU: ``x @ W^T (+ b)`` with ``W^T`` stored ``(in, out)``."""

    __slots__ = ("weight_t", "bias")
    format = "model"

    def __init__(self, linear: nn.Linear):
        self.weight_t = linear.weight.detach().t().contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


class _Bfloat16:
    """Format ``"bfloat16"``: ``bf16(x) @ bf16(W)^T`` in fp32 accumulation, plus the bias."""

    __slots__ = ("weight", "bias")
    format = "bfloat16"

    def __init__(self, linear: nn.Linear):
        self.weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        product = F.linear(x.to(torch.bfloat16), self.weight)
        # one op for "back to x's dtype, plus bias": type promotion of (bias, bf16 product)
        return product.to(x.dtype) if self.bias is None else torch.add(self.bias, product)


class _Int8:
    """Format ``"int8"``: weight-only int8 with per-output-channel bf16 scales.

    ``torch._weight_int8pack_mm`` (a private ATen kernel) gave wrong outputs or crashed for input
    sizes not a multiple of :data:`_INT8_KERNEL_K_MULTIPLE` (torch 2.11, CPU), and is used and
    tested here on CPU only. Other layers and devices multiply by the dequantized ``q * s`` held
    in fp32: the same values and bf16 output up to summation order, without the saving in bytes.
    """

    __slots__ = ("weight", "scale", "bias", "dequantized")
    format = "int8"

    def __init__(self, linear: nn.Linear):
        self.weight, self.scale = quantize_int8(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        use_kernel = linear.weight.device.type == "cpu" and linear.in_features % _INT8_KERNEL_K_MULTIPLE == 0
        self.dequantized = None if use_kernel else (self.weight.float() * self.scale.float()[:, None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is None:
            product = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale)
        else:  # rounded to bf16 like the kernel's output
            product = F.linear(x.to(torch.bfloat16).float(), self.dequantized).to(torch.bfloat16)
        return product.to(x.dtype) if self.bias is None else torch.add(self.bias, product)


def _make_copy(linear: nn.Linear, format: str):
    if format == "int8":
        return _Int8(linear)
    if format == "bfloat16":
        return _Bfloat16(linear)
    return _Transposed(linear) if linear.weight.device.type == "cpu" else None


@contextlib.contextmanager
def weight_copies_for_steps(module: nn.Module, format: str = "model", enabled: bool = True):
    """Give every ``nn.Linear`` in ``module`` a weight copy in ``format`` (one of
    :data:`STEP_WEIGHT_FORMATS`) that :func:`step_linear` reads, for the block; removed on exit.
    Memory: one more copy of the linear weights, in that format.

    The weights must not change inside the block (the copies would be stale). An inner block for
    a module that already holds copies keeps the outer ones; asking for another format there is
    an error.
    """
    check_step_weight_format(format)
    added = []
    if enabled:
        with torch.no_grad():
            for linear in module.modules():
                if not isinstance(linear, nn.Linear):
                    continue
                held = linear.__dict__.get(_ATTRIBUTE)
                if held is not None:
                    if held.format != format:
                        raise RuntimeError(
                            f"weight_copies_for_steps: a {type(linear).__name__} already holds a {held.format!r} step weight; "
                            f"cannot also use {format!r} inside that block"
                        )
                    continue
                copy = _make_copy(linear, format)
                if copy is not None:
                    linear.__dict__[_ATTRIBUTE] = copy
                    added.append(linear)
    try:
        yield
    finally:
        for linear in added:
            linear.__dict__.pop(_ATTRIBUTE, None)
        for sub in module.modules():  # and the fused plans that read the copies
            _PLANS.pop(sub, None)


# ---------------------------------------------------------------- the fused plan


class FusedPlan(NamedTuple):
    """A stack's fused step for one block of weight copies."""

    qkv: nn.Linear  # the first layer's qkv projection
    marker: object  # the copy ``qkv`` held when the plan was made (a new block makes new copies)
    stack: object  # the extension's ``FusedStack``; None where the stack is not of the form it computes
    dtype: torch.dtype | None  # the ``FusedStack``'s weights' dtype
    layers: int  # the stack's depth


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Transformer -> FusedPlan


def fused_plan(transformer: Transformer, make_stack) -> FusedPlan | None:
    """The plan for the weight copies ``transformer`` holds now, made on first use per block;
    None (and nothing remembered) when it holds none. ``make_stack``: the selected ``fused_step``
    kernel's ``run``, which builds its ``FusedStack`` from the arguments of :func:`_fused_weights`."""
    plan = _PLANS.get(transformer)
    if plan is not None and plan.qkv.__dict__.get(_ATTRIBUTE) is plan.marker:
        return plan
    if not transformer.layers:
        return None
    qkv = getattr(getattr(transformer.layers[0], "attention", None), "qkv", None)
    marker = qkv.__dict__.get(_ATTRIBUTE) if isinstance(qkv, nn.Linear) else None
    if marker is None:
        return None
    found = _fused_weights(transformer)
    stack, dtype = None, None
    if found is not None:
        weights, norm_eps, sizes, eps, approximate, feature_map = found
        try:
            stack = make_stack(weights, norm_eps, *sizes, eps, approximate, feature_map)
            dtype = weights[0].dtype
        except RuntimeError:  # shapes the fused step does not take (e.g. d_ff differing by layer)
            stack = None
    plan = _PLANS[transformer] = FusedPlan(qkv, marker, stack, dtype, len(transformer.layers))
    return plan


def _fused_weights(transformer: Transformer):
    """``(weights, norm eps, (heads, query dim, value dim), attention eps, GELU approximate,
    feature map name)`` in the order ``FusedStack`` takes them, or None when the stack is not of
    the ``LINEAR_FUSED`` form, its linear layers do not all hold ``"model"`` copies with a bias
    (transposed, on CPU), or its weights are not float32 / float64, contiguous, of one dtype. A
    layer's learned map (:func:`_map_weights`) follows its twelve tensors."""
    if why_not_paper_form(transformer, LINEAR_FUSED) is not None:
        return None
    weights, norm_eps = [], []
    for layer in transformer.layers:
        attention = layer.attention
        up, _, _, down = layer.feedforward
        for part in (layer.norm_attention, attention.qkv, attention.out, layer.norm_ff, up, down):
            if isinstance(part, nn.LayerNorm):
                weights += [part.weight.detach(), part.bias.detach()]
                norm_eps.append(float(part.eps))
                continue
            copy = part.__dict__.get(_ATTRIBUTE)
            weight_t = getattr(copy, "weight_t", None)
            if copy is None or copy.format != "model" or weight_t is None or copy.bias is None:
                return None
            weights += [weight_t, copy.bias]
        weights += _map_weights(attention.attention.feature_map)
    norm = transformer.norm
    weights += [norm.weight.detach(), norm.bias.detach()]
    norm_eps.append(float(norm.eps))
    dtype = weights[0].dtype
    if dtype not in (torch.float32, torch.float64) \
            or any(w.device.type != "cpu" or w.dtype != dtype or not w.is_contiguous() for w in weights):
        return None
    first = transformer.layers[0]
    sizes = (first.attention.n_heads, first.attention.query_dim, first.attention.value_dim)
    backend = first.attention.attention
    return (weights, norm_eps, sizes, float(backend.eps), first.feedforward[1].approximate,
            backend.feature_map.kernel_form.name)


def _map_weights(feature_map) -> list[torch.Tensor]:
    """A fused map's ``[W (F, D), b (F)]`` per projection of its ``kernel_form``, in ``FusedStack``'s
    order: t2r's one, hedgehog's query map then key map; none for elu."""
    projections = (getattr(feature_map, name) for name in feature_map.kernel_form.projections)
    return [tensor.detach() for linear in projections for tensor in (linear.weight, linear.bias)]
