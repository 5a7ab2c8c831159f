"""Generation speed, in one place: what makes the one-position RNN step (paper §3.4) fast at
small batch sizes, beside the readable step it is tested equal to.

:meth:`Transformer.step <linformer_lab.models.transformer.Transformer.step>` is the readable
recurrent path: module calls and each backend's own ``step``. At small batch sizes a generation
step is a few dozen operations on ``(B, d_model)`` rows, so its time goes to per-operation costs
(module calls, argument handling, thread start-up, reading the weights), not arithmetic. What
cuts those costs lives here and nowhere else (docs/ARCHITECTURE.md, "Where speed code goes"):

* :func:`fast_step`: ``Transformer.step`` for inference, with fewer operations and no module
  calls; ``tests/models/test_generation.py`` checks it equals ``Transformer.step`` for every backend
  and feature map. On CPU, inside a ``"model"`` weight-copy block, a stack of the paper's form
  (linear attention, elu) steps in one C++ call (:mod:`linformer_lab.models.fused_step`);
* :func:`weight_copies_for_steps` / :func:`step_linear`: the weight copy each linear layer of the step reads (below);
* :func:`generation_kernels`: the CPU kernel settings a loop of steps runs under (oneDNN off,
  one intra-op thread for small batches);
* :func:`noise_per_position`: the sampling noise drawn per block of positions.

Weight copies
-------------

A generation step multiplies a handful of rows by every weight matrix of the model, so at
small batch sizes it streams all the weights from memory once per position (25 MB per step
for the 8-layer MNIST model at fp32, 50 MB for the 16-layer CIFAR-10 model) and the time is
set by how fast the matrix-vector products read them, not by arithmetic.

:func:`weight_copies_for_steps` gives every ``nn.Linear`` of a module, for the duration of a
``with`` block (a loop of steps over fixed weights, e.g. ``PixelTransformer.generate``), a copy
of its weight in a format chosen for that, and :func:`step_linear` uses the copy when there is
one. The formats (:data:`STEP_WEIGHT_FORMATS`):

``"model"``
    The model's own weights, dtype and values; the product is the same up to summation
    order. On CPU the copy is the transposed ``(in, out)`` matrix: ``F.linear`` reads the
    ``(out, in)`` parameter markedly slower at one row than ``x @ W^T`` with ``W^T``
    contiguous. Elsewhere no copy is made.
``"bfloat16"``
    A bfloat16 copy; the layer's input is rounded to bfloat16, the product accumulated in
    fp32 and rounded to bfloat16 by the BLAS, the bias added in the model's dtype. Half the
    bytes per step.
``"int8"``
    Weight-only int8: each output row ``w_i`` stored as ``round(w_i / s_i)`` in int8 with
    one bfloat16 scale ``s_i >= max|w_i| / 127`` (symmetric, per output channel, so every
    weight is within ``s_i / 2`` of its original); the input is rounded to bfloat16 and
    ``torch._weight_int8pack_mm`` dequantizes on the fly (bfloat16 output, the bias added in
    the model's dtype). A quarter of the bytes per step.

The reduced formats change the numbers the step computes (a lossy copy), so they are opt-in;
how much they cost in bits/dim is measured in ``benchmarks/dev/step_weights_quality.py``. The
activations between layers, the attention state and the output head stay in the model's
dtype.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.base import SequenceBuffer
from linformer_lab.attention.linear import LinearAttention
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.feature_maps import FeatureMap
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.models import fused_step
from linformer_lab.models.mixture_of_logistics import DiscretizedMixtureOfLogistics
from linformer_lab.models.transformer import Transformer, TransformerLayer
from linformer_lab.ops.linear_attention import LinearState, StateOwner, check_step_fits_state

__all__ = [
    "CPU_MATMUL_MIN_ROWS",
    "NOISE_BLOCK",
    "SINGLE_THREAD_MAX_BATCH",
    "STEP_WEIGHT_FORMATS",
    "check_step_weight_format",
    "fast_step",
    "generation_kernels",
    "noise_per_position",
    "quantize_int8",
    "split_heads",
    "step_linear",
    "weight_copies_for_steps",
]

# ---------------------------------------------------------------- the fast step

#: On CPU, :func:`fast_step` computes linear attention's ``phi(q)^T [S | Z]`` as a batched matmul
#: when the state has at least this many (batch x head) rows, and as a broadcast product + sum
#: below: a batched matmul of (1, C) x (C, M + 1) costs more in BLAS set-up than the arithmetic at
#: a few rows, and from here on the product's (B, H, C, M + 1) temporary costs more than that set-up.
CPU_MATMUL_MIN_ROWS = 32
_OWNED = StateOwner()  # the linear states fast_step made, the only ones it updates in place (others: copied first)


def fast_step(transformer: Transformer, x_t: torch.Tensor, state: list | SequenceBuffer | None = None):
    """:meth:`Transformer.step` for inference: ``x_t (B, d_model) -> (out (B, d_model), state)``,
    the same weights and arithmetic up to summation order (the weight copies of
    :func:`weight_copies_for_steps` aside), in fewer tensor operations.

    Needs eval mode (it applies no dropout) and no autograd (``torch.no_grad()`` or
    ``torch.inference_mode()``: a linear state it made is updated in place, one from elsewhere copied first). Per layer:
    ``torch.layer_norm`` called directly (``F.layer_norm`` also reads a backend flag on every
    call), the linear layers through :func:`step_linear`, q, k, v as views of the fused
    projection, feature maps through their ``forward`` (no module call: hooks on sub-modules do
    not run), and for linear attention (a backend that keeps ``LinearAttention.step``) its own
    in-place step. Other backends step through their ``step``; a stack without a recurrent form
    (lsh) goes through ``Transformer.step``, which re-runs the stack on the prefix. Where
    :func:`linformer_lab.models.fused_step.step` applies (CPU, linear attention with elu, inside
    a ``"model"`` weight-copy block, small batches, after the first step), it is one C++ call.
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
    if (fused := fused_step.step(transformer, x_t, (state := _OWNED.take(state)), _ATTRIBUTE)) is not None:
        return fused
    new_state = []
    for layer, layer_state in zip(transformer.layers, state or [None] * len(transformer.layers)):
        x_t, layer_state = _layer_step(layer, x_t, layer_state)
        new_state.append(layer_state)
    return _layer_norm(x_t, transformer.norm), new_state


def _layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return torch.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _layer_step(layer: TransformerLayer, x_t: torch.Tensor, state):
    """``TransformerLayer.step`` in eval mode (every dropout the identity): ``(B, d_model) -> ((B, d_model), state)``."""
    if not layer.norm_first or not isinstance(layer.feedforward[1], nn.GELU):
        return layer.step(x_t, state)  # the authors' post-norm / ReLU layer: the readable step, written for both
    attended, state = _attention_step(layer.attention, _layer_norm(x_t, layer.norm_attention), state)
    x_t = x_t + attended
    up, activation, _, down = layer.feedforward  # Linear, GELU, Dropout, Linear
    hidden = F.gelu(step_linear(_layer_norm(x_t, layer.norm_ff), up), approximate=activation.approximate)
    return x_t + step_linear(hidden, down), state


def _attention_step(attention: MultiHeadAttention, x_t: torch.Tensor, state):
    """``MultiHeadAttention.step``: ``(B, d_model) -> ((B, d_model), state)``."""
    q, k, v = split_heads(attention, step_linear(x_t, attention.qkv))
    backend = attention.attention
    if isinstance(backend, LinearAttention) and type(backend).step is LinearAttention.step:
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
    """``(feature_map.forward_queries(q_t), feature_map.forward_keys(k_t))``; the paper's elu map
    through :func:`_elu_plus_one`, and where a map keeps the base class's versions (which are
    ``self(x)``), ``forward`` is called without the module-call machinery."""
    cls = type(feature_map)
    if cls is EluFeatureMap:
        return _elu_plus_one(q_t), _elu_plus_one(k_t)
    phi_q = feature_map.forward(q_t) if cls.forward_queries is FeatureMap.forward_queries else feature_map.forward_queries(q_t)
    phi_k = feature_map.forward(k_t) if cls.forward_keys is FeatureMap.forward_keys else feature_map.forward_keys(k_t)
    return phi_q, phi_k


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``EluFeatureMap.forward`` without autograd: ``exp(min(x, 0)) + max(x, 0)``, the same values
    in 4 tensor operations against the ``torch.where`` form's 6 (8 % of a batch-64 MNIST step)."""
    out = torch.exp(x.clamp_max(0.0)).add_(x.clamp_min(0.0))
    if x.dtype in (torch.float16, torch.bfloat16):  # as EluFeatureMap: phi stays > 0 in half precision
        out = out.clamp_min(torch.finfo(x.dtype).tiny)
    return out


_SCALARS: dict = {}


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor of ``value`` in ``like``'s dtype and device, cached (a float becomes a tensor at every call)."""
    key = (value, like.dtype, like.device)
    scalar = _SCALARS.get(key)
    if scalar is None:
        with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
            scalar = _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return scalar


# ---------------------------------------------------------------- weight copies

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
    with ``|q * scale - weight| <= scale / 2`` elementwise.

    The scale is rounded *up* to bfloat16 (the kernel takes bf16 scales), so
    ``max|w_i| / scale_i <= 127`` and no weight is clipped; a zero row gets scale 1.
    """
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

    ``torch._weight_int8pack_mm`` (a private ATen kernel) gave wrong outputs or crashed the
    process for input sizes that are not a multiple of :data:`_INT8_KERNEL_K_MULTIPLE` (a grid
    of shapes on torch 2.11, CPU), and it is only used and tested here on CPU. Other layers
    (and other devices) multiply by the dequantized weights ``q * s`` held in fp32: the same
    values and the same bf16 output, up to summation order, without the saving in bytes.
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
    :data:`STEP_WEIGHT_FORMATS`) that :func:`step_linear` reads, for the block; removed on
    exit. Memory: one more copy of the linear weights, in that format.

    The weights must not change inside the block (the copies would be stale). Nesting: an
    inner block for a module that already holds copies keeps the outer ones (and their
    format); it is an error to ask for another format there.
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
        fused_step.release(module)  # and the fused steps that read the copies


# ---------------------------------------------------------------- kernels


@contextlib.contextmanager
def generation_kernels(device: torch.device, batch_size: int, recurrent: bool = True):
    """The kernel settings :meth:`~linformer_lab.models.pixel_transformer.PixelTransformer.generate`
    steps under: oneDNN off on CPU (:func:`_native_cpu_kernels`) and one intra-op thread for small recurrent batches
    (:func:`_single_thread_for_small_steps`). Process-global settings, restored on exit.

    Code that steps the model by hand and must draw what ``generate`` draws runs under this
    too: a bf16 step copy goes through oneDNN's bf16 matmul when oneDNN is on (on CPUs with
    bf16 instructions), which rounds differently from the native kernel.
    """
    with _native_cpu_kernels(device), _single_thread_for_small_steps(device, batch_size, recurrent):
        yield


@contextlib.contextmanager
def _native_cpu_kernels(device: torch.device):
    """Turn oneDNN (mkldnn) off while stepping on CPU.

    With oneDNN on, PyTorch runs GELU through oneDNN, which opens a thread-parallel region on
    every call, even for the (B, d_ff) tensor of one RNN step; ATen's own kernel runs such a
    small tensor inline, many times faster. Nothing else on the fp32 step path uses oneDNN (linear layers go to BLAS), so
    fp32 results are identical; a bf16 step copy does go through oneDNN's bf16 matmul when
    oneDNN is on, which rounds differently. The flag is process-global; it is restored on exit.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.enabled:
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True


#: On CPU, :func:`generation_kernels` runs recurrent steps of at most this many sequences with
#: one intra-op thread (restored afterwards). Such a step is a few dozen operations on
#: (B, d_model) rows; a thread-parallel region costs more than the work in it.
SINGLE_THREAD_MAX_BATCH = 16


@contextlib.contextmanager
def _single_thread_for_small_steps(device: torch.device, batch_size: int, recurrent: bool):
    """One intra-op thread while stepping a small batch on CPU (see
    :data:`SINGLE_THREAD_MAX_BATCH`). Backends without a recurrent form (lsh) re-run the
    whole prefix at every step, which is large enough to use every thread: left as set."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or not recurrent or batch_size > SINGLE_THREAD_MAX_BATCH or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- sampling noise

#: :meth:`PixelTransformer.generate` draws the sampling noise of this many positions per call
#: (``B x block x (K + 1)`` fp32 numbers, about 360 KB for 64 images and 10 logistics).
NOISE_BLOCK = 128


def noise_per_position(head: DiscretizedMixtureOfLogistics, batch_size: int, positions: int, temperature: float,
                       generator: torch.Generator | None, device: torch.device):
    """Yields, per sampled position, the ``noise`` argument of ``head.sample``: slices of noise
    drawn :data:`NOISE_BLOCK` positions at a time, None at temperature 0 (which draws nothing).
    The same distribution as drawing per position, not the same stream: a generator seeded
    alike gives other images than position-by-position calls of ``head.sample`` would."""
    if temperature == 0:
        yield from itertools.repeat(None, positions)
        return
    for start in range(0, positions, NOISE_BLOCK):
        gumbel, logistic = head.sampling_noise((batch_size, min(NOISE_BLOCK, positions - start)), generator, device)
        for i in range(gumbel.shape[1]):
            yield gumbel[:, i], logistic[:, i]
