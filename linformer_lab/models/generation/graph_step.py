"""Generation with static buffers, replayable as one CUDA graph per step (paper §3.4 on a GPU).

:func:`~linformer_lab.models.generation.fast_step` allocates its outputs and grows softmax's
cache as it goes, and the loop around it (output head, sampling, next input) is a few hundred
small operations per position. On a GPU each is a kernel launch, so at small batch sizes a step
costs the launches, not the arithmetic. Here the whole generation step -- every layer, the
sampling and the write of the sampled value into the next input -- touches only buffers
allocated once per ``generate`` call, with the position a device tensor, so the same kernels
serve every position: on CUDA they are captured once as a graph and replayed per position (the
approach of Mamba's decoder).

* :class:`StaticDecoder`: the buffers and :meth:`StaticDecoder.step`, eager on any device (the
  CPU tests hold it to ``fast_step`` and ``Transformer.step``);
* :func:`decode`: the sampling loop over it (``generate(decoder="graph")``).

It takes stacks of the paper's form with causal linear or softmax attention (``LINEAR_OR_SOFTMAX``).
The state per layer: linear attention's ``[S | Z]`` buffer ``(B, H, C, M + 1)`` (as
:class:`~linformer_lab.ops.linear_attention.LinearState`); softmax's keys and values for the
whole image ``(B, H, N, D|M)``, the position marking what is filled (stateful softmax, paper
appendix C.1, preallocated). Softmax attends to the first ``span`` cached positions, masked
beyond the current one; ``span`` grows in blocks of :data:`SPAN_BLOCK` (one graph per block), so
its cost follows the position instead of paying for the whole image at every step.

The weight copies of :func:`~linformer_lab.models.generation.weights.weight_copies_for_steps`
apply; the sampling noise is drawn ahead in the blocks and order of ``generate``'s dynamic loop,
so a generator seeded alike gives the same images on both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.models.generation.dynamic_step import layer_norm, split_heads
from linformer_lab.models.generation.form import LINEAR_OR_SOFTMAX, why_not_paper_form
from linformer_lab.models.generation.weights import step_linear
from linformer_lab.ops.cuda.triton_chunk import backend as triton_backend
from linformer_lab.ops.cuda.triton_chunk import step as triton_step
from linformer_lab.ops.cuda.triton_chunk.step import linear_attention_step_
from linformer_lab.ops.state import KVCache

__all__ = ["SPAN_BLOCK", "StaticDecoder", "capture", "decode"]

#: Softmax attends to the cache in spans that grow by this many positions (one graph each).
SPAN_BLOCK = 128

#: Eager runs of a step before its capture (lazy initialisation, the allocator's first blocks).
_WARMUP_RUNS = 2


class _LinearBuffers:
    """Linear attention's ``[S | Z]`` ``(B, H, C, M + 1)``, fp32 (fp64 for fp64 models)."""

    def __init__(self, backend: LinearAttention, batch: int, heads: int, value_dim: int, dtype, device,
                 fused: bool | None = None):
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.backend = backend
        self.joint = torch.zeros(batch, heads, backend.feature_map.output_dim, value_dim + 1, dtype=state_dtype,
                                 device=device)
        # one Triton kernel for maps, state update and readout where it runs (a GPU; None: there)
        self.fused = fused if fused is not None else triton_step.runs_for(self.joint)
        if self.fused and state_dtype != torch.float32:
            raise ValueError("the fused attention step keeps an fp32 state: not for float64 models")
        self.mapped_in_kernel = triton_backend.fuses(backend.feature_map)

    def load(self, state) -> None:
        self.joint.zero_()
        if state is not None:
            s, z = state
            self.joint[..., :-1].copy_(s)
            self.joint[..., -1].copy_(z)

    def attend(self, q, k, v, position, span):
        """Eq. 18-20 in place: q, k ``(B, H, D)``, v ``(B, H, M)`` -> ``(B, H, M)`` in v's dtype."""
        joint, feature_map = self.joint, self.backend.feature_map
        if self.fused:
            if self.mapped_in_kernel:
                return linear_attention_step_(q, k, v, joint, "elu", self.backend.eps)
            mapped_q, mapped_k = feature_map.forward_queries(q), feature_map.forward_keys(k)
            return linear_attention_step_(mapped_q, mapped_k, v, joint, "none", self.backend.eps)
        phi_q = feature_map.forward_queries(q).to(joint.dtype)
        phi_k = feature_map.forward_keys(k).to(joint.dtype)
        m = joint.shape[-1] - 1
        joint[..., :m].addcmul_(phi_k.unsqueeze(-1), v.to(joint.dtype).unsqueeze(-2))  # S += phi(k) v^T
        joint[..., m].add_(phi_k)  # Z += phi(k)
        both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)  # [phi(q)^T S | phi(q)^T Z]
        return (both[..., :m] / (both[..., m:] + self.backend.eps)).to(v.dtype)


class _SoftmaxBuffers:
    """Softmax's keys ``(B, H, N, D)`` and values ``(B, H, N, M)`` for a whole sequence."""

    def __init__(self, batch: int, heads: int, query_dim: int, value_dim: int, length: int, dtype, device):
        # zeros, not empty: a masked key's weight is exactly 0, but 0 * NaN left in memory is NaN
        self.keys = torch.zeros(batch, heads, length, query_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, length, value_dim, dtype=dtype, device=device)
        self.slots = torch.arange(length, device=device)

    def load(self, state) -> None:
        self.keys.zero_()
        self.values.zero_()
        if state is not None:
            if not isinstance(state, KVCache) or state.valid is not None:
                raise ValueError("a static softmax cache starts from a KVCache of equal-length sequences")
            self.keys[:, :, : state.length].copy_(state.keys)
            self.values[:, :, : state.length].copy_(state.values)

    def attend(self, q, k, v, position, span):
        """Writes k, v at ``position`` and attends ``q (B, H, D)`` to cached positions
        ``<= position`` among the first ``span`` -> ``(B, H, M)``."""
        self.keys.index_copy_(2, position, k.unsqueeze(2).to(self.keys.dtype))
        self.values.index_copy_(2, position, v.unsqueeze(2).to(self.values.dtype))
        visible = (self.slots[:span] <= position).unsqueeze(0)  # (1, span), broadcast over (B, H, 1, span)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), self.keys[:, :, :span], self.values[:, :, :span],
                                             attn_mask=visible)
        return out.squeeze(2)


class StaticDecoder:
    """The buffers of one ``generate`` call and the generation step over them.

    Args:
        model: a :class:`~linformer_lab.models.pixel_transformer.PixelTransformer` whose stack
            ``why_not_paper_form(..., LINEAR_OR_SOFTMAX)`` accepts, in eval mode.
        values: int64 ``(B, N)``, the image being generated; positions ``< known`` hold the
            prefix and are never overwritten. Filled in place.
        known: prefix length ``P``.
        temperature: as ``DiscretizedMixtureOfLogistics.sample``.
        noise: ``(gumbel (B, N - P, K), logistic (B, N - P))`` for the sampled positions
            (``sampling.whole_image_noise``); None at temperature 0.
        span_block: softmax's spans grow by this many positions (:data:`SPAN_BLOCK`).
        fused_attention: linear attention's step in one Triton kernel per layer
            (``ops/cuda/triton_chunk/step.py``); None: where it runs (a CUDA GPU).

    :meth:`load` sets the state, input and position; each :meth:`step` then samples the position
    in :attr:`position` (a device tensor, int64 ``(1,)``), writes it into ``values`` (unless
    prefix), prepares the next input in :attr:`x` and advances :attr:`position`, allocating
    nothing outside its own temporaries.
    """

    def __init__(self, model, values: torch.Tensor, known: int, temperature: float, noise,
                 span_block: int = SPAN_BLOCK, fused_attention: bool | None = None):
        why = why_not_paper_form(model.transformer, LINEAR_OR_SOFTMAX)
        if why is not None:
            raise ValueError(f"StaticDecoder: {why}")
        self.model, self.values, self.known, self.temperature = model, values, known, temperature
        self.noise, self.span_block = noise, span_block
        batch, length = values.shape
        device, dtype = model.start.device, model.start.dtype
        self.length = length
        self.table = model.position_table()  # (N, d_model): fixed while sampling
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.x = torch.zeros(batch, model.d_model, dtype=dtype, device=device)
        self.hidden = torch.zeros(batch, model.d_model, dtype=dtype, device=device)
        self.layers = []
        for layer in model.transformer.layers:
            attention = layer.attention
            backend = attention.attention
            if isinstance(backend, LinearAttention):
                buffers = _LinearBuffers(backend, batch, attention.n_heads, attention.value_dim, dtype, device,
                                         fused_attention)
            else:
                buffers = _SoftmaxBuffers(batch, attention.n_heads, attention.query_dim, attention.value_dim, length,
                                          dtype, device)
            self.layers.append((layer, buffers))
        self.has_softmax = any(isinstance(b, _SoftmaxBuffers) for _, b in self.layers)

    def spans(self, first: int = 0) -> list[int]:
        """The distinct ``span`` values that positions ``first..N-1`` step with."""
        return sorted({self.span(p) for p in range(first, self.length)})

    def span(self, position: int) -> int:
        """Cached positions softmax attends to at ``position`` (a stack without softmax: N)."""
        if not self.has_softmax:
            return self.length
        return min(self.length, -(-(position + 1) // self.span_block) * self.span_block)

    def load(self, state: list | None, x_t: torch.Tensor, position: int) -> None:
        """Start at ``position`` with input ``x_t (B, d_model)`` and the per-layer ``state``
        after the positions before it (None: the empty prefix)."""
        for i, (_, buffers) in enumerate(self.layers):
            buffers.load(None if state is None else state[i])
        self.x.copy_(x_t)
        self.position.fill_(position)

    def transformer_step(self, span: int) -> torch.Tensor:
        """``Transformer.step`` at :attr:`position` on :attr:`x` -> ``(B, d_model)`` (also in
        :attr:`hidden`); the caches are written, the position is not advanced."""
        x = self.x
        for layer, buffers in self.layers:
            attention = layer.attention
            q, k, v = split_heads(attention, step_linear(layer_norm(x, layer.norm_attention), attention.qkv))
            out = buffers.attend(q, k, v, self.position, span)
            x = x + step_linear(out.flatten(1), attention.out)
            up, activation, _, down = layer.feedforward
            hidden = F.gelu(step_linear(layer_norm(x, layer.norm_ff), up), approximate=activation.approximate)
            x = x + step_linear(hidden, down)
        self.hidden.copy_(layer_norm(x, self.model.transformer.norm))
        return self.hidden

    def step(self, span: int) -> None:
        """One generation step at :attr:`position` (see the class docstring)."""
        head, position = self.model.head, self.position
        params = head(self.transformer_step(span))
        noise = None
        if self.noise is not None:
            index = (position - self.known).clamp_(0, self.noise[1].shape[1] - 1)
            noise = (self.noise[0].index_select(1, index).squeeze(1), self.noise[1].index_select(1, index).squeeze(1))
        sampled = head.sample(params, self.temperature, noise=noise)
        current = self.values.index_select(1, position).squeeze(1)
        value = torch.where(position >= self.known, sampled, current)  # a prefix position keeps the prefix
        self.values.index_copy_(1, position, value.unsqueeze(1))
        following = (position + 1).clamp_(max=self.length - 1)  # past the last position: unused
        self.x.copy_(F.embedding(value, self.model.value_embedding.weight) + self.table.index_select(0, following))
        position.add_(1)


def capture(function, device: torch.device):
    """``function`` (no arguments, static buffers) captured as a CUDA graph after
    :data:`_WARMUP_RUNS` eager runs on a side stream. The warm-up runs change the buffers:
    :meth:`StaticDecoder.load` comes after the captures."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(_WARMUP_RUNS):
            function()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    return graph


def decode(model, values: torch.Tensor, known: int, first: int, state, x_t: torch.Tensor, temperature: float,
           noise) -> None:
    """Fill ``values[:, known:]`` from position ``first <= known`` on, given the state after
    positions ``< first`` and the input ``x_t`` of ``first``: one CUDA graph per span replayed per
    position on CUDA, the same step eagerly elsewhere. ``noise``: as :class:`StaticDecoder`'s."""
    device, length = values.device, values.shape[1]
    if first >= length:
        return
    static = StaticDecoder(model, values, known, temperature, noise)
    steps = {}
    for span in static.spans(first):
        if device.type == "cuda":
            static.position.zero_()
            steps[span] = capture(lambda span=span: static.step(span), device).replay
        else:
            steps[span] = lambda span=span: static.step(span)
    static.load(state, x_t, first)
    for position in range(first, length):
        steps[static.span(position)]()
