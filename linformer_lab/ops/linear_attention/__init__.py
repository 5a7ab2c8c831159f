"""Linear attention (paper §3.2-3.4) as pure functions on feature-mapped tensors.

Shapes follow ``scaled_dot_product_attention``: ``phi_q, phi_k (B, H, N, C)`` (C = the
feature map's output dim), ``v (B, H, N, M)``. One module per form, as in a reading order:

* :mod:`.naive` -- the paper's equations written plainly: the O(N^2) similarity form (eq. 3, 4,
  8, 9) and the loop over t of eq. 10-12. Slow on purpose; the tests compare against it.
* :mod:`.chunk` -- the causal numerator as a chunked ``autograd.Function`` (matmuls per chunk,
  eq. 13-15 backward), no ``(N, C, M)`` tensor: the ``pytorch`` candidate of the ``causal`` op,
  which runs anywhere (the kernels are tested against the float64 :mod:`.naive` form).
* :mod:`.recurrent` -- the RNN step (eq. 16-20) with a fixed-size state.
* :mod:`.packed` -- causal and non-causal attention over packed sequences (``cu_seqlens``) in one
  pass, the sequences' offsets never read on the host.
* here -- the attention itself: non-causal (eq. 5-6) and causal (eq. 9-12), numerator over
  normaliser, with fp32 accumulation for half inputs; :func:`causal_attention`, the PyTorch
  candidate of the ``causal_attention`` op; phi = elu + 1 (eq. 7, :func:`elu_plus_one`), the one
  Python definition the elu map and the kernels' PyTorch forms share.

Nothing here chooses a kernel: :mod:`linformer_lab.ops.kernels` does, and the causal numerator is
an argument (``dot_product``; by default the chunked PyTorch one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from linformer_lab.ops.linear_attention import chunk
from linformer_lab.ops.linear_attention.chunk import CausalDotProduct, compute_dtype, reference_chunk_size
from linformer_lab.ops.linear_attention.packed import packed_linear_attention
from linformer_lab.ops.linear_attention.recurrent import (
    StateOwner,
    check_step_fits_state,
    linear_attention_step,
    new_linear_state,
)
from linformer_lab.ops.masks import length_mask
from linformer_lab.ops.state import LinearState

__all__ = [
    "CausalDotProduct",
    "LinearState",
    "StateOwner",
    "causal_attention",
    "causal_linear_attention",
    "check_linear_state",
    "check_step_fits_state",
    "computed_in",
    "dot_product_with_state",
    "elu_plus_one",
    "joint_state",
    "linear_attention",
    "linear_attention_step",
    "mask_keys",
    "new_linear_state",
    "packed_linear_attention",
    "reference_chunk_size",
]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``phi(x) = elu(x) + 1`` (eq. 7) elementwise: ``exp(min(x, 0)) + max(x, 0)``, which is ``x + 1``
    for x > 0 and ``exp(x)`` otherwise, without the cancellation of ``(exp(x) - 1) + 1`` that rounds
    phi to 0 for x below about -17 in fp32 (about -9 in bf16) and makes the normaliser 0/0. In fp16
    even exp(x) underflows below about -17, so half-precision outputs are clamped at the dtype's
    smallest normal number: phi stays > 0. The clamps keep the unused branch finite, so autograd's
    zero gradient there stays zero. Each branch rounds once, as the kernels' inline copies (tested
    against this one) compute it."""
    out = torch.exp(x.clamp_max(0.0)) + x.clamp_min(0.0)
    if x.dtype in (torch.float16, torch.bfloat16):
        out = out.clamp_min(torch.finfo(x.dtype).tiny)
    return out


def computed_in(kernel: str, feature_map) -> bool:
    """True when ``kernel`` applies ``feature_map`` itself: its class's ``kernel_form``
    (:class:`~linformer_lab.feature_maps.base.KernelForm`) names it. Read duck-typed, since the
    maps sit above ops; a class without one (a subclass that did not restate it) is applied by
    PyTorch before the kernel."""
    form = getattr(feature_map, "kernel_form", None)
    return form is not None and kernel in form.kernels


def mask_keys(phi_k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None):
    """Zero keys ``(B, H, N, C)`` and values ``(B, H, N, M)`` at positions >= ``key_lengths (B,)``
    so they add nothing to any sum."""
    if key_lengths is None:
        return phi_k, v
    valid = length_mask(key_lengths, phi_k.shape[-2])  # (B, N)
    valid = valid[:, None, :, None]
    return phi_k * valid, v * valid


def check_linear_state(state, phi_k: torch.Tensor, v: torch.Tensor, who: str = "linear attention",
                       rows: int | None = None):
    """``state`` as ``(S (B, H, C, M), Z (B, H, C))`` fitting ``phi_k (B, H, N, C)`` and ``v (B, H, N, M)``,
    or a ValueError that says what was expected; ``rows``: B where it is not phi_k's (one row per
    packed sequence)."""
    b, h, _, c = phi_k.shape
    b = b if rows is None else rows
    m = v.shape[-1]
    if not (isinstance(state, (tuple, list)) and len(state) == 2 and all(isinstance(t, torch.Tensor) for t in state)):
        raise ValueError(f"{who}: state must be a pair (S (B, H, C, M), Z (B, H, C)) of tensors, e.g. a returned "
                         f"state; got {type(state).__name__}")
    s, z = state
    if tuple(s.shape) != (b, h, c, m) or tuple(z.shape) != (b, h, c):
        raise ValueError(f"{who}: state S {tuple(s.shape)}, Z {tuple(z.shape)} does not fit these inputs: expected "
                         f"S {(b, h, c, m)}, Z {(b, h, c)} (batch, heads, feature dim, value dim)")
    if s.device != v.device or z.device != v.device:
        raise ValueError(f"{who}: state is on {s.device} but the inputs are on {v.device}")
    return s, z


def joint_state(s: torch.Tensor, z: torch.Tensor) -> LinearState:
    """``(S (B, H, C, M), Z (B, H, C))`` as a :class:`LinearState`, the layout the RNN step
    reads fastest (one copy; differentiable)."""
    return LinearState(torch.cat([s, z.unsqueeze(-1)], dim=-1))


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None = None,
                     eps: float = 1e-6, initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                     return_state: bool = False):
    """Non-causal linear attention by associativity (eq. 5-6): phi(Q) (phi(K)^T V) / phi(Q) z.

    Args: phi_q ``(B, H, N, C)``, phi_k ``(B, H, L, C)``, v ``(B, H, L, M)``, key_lengths ``(B,)``;
    ``initial_state`` ``(S_0, Z_0)``: the summaries of keys seen before (also attended to).
    Returns ``(B, H, N, M)``, with ``return_state`` also the state ``(S, Z)`` = ``(S_0 + phi(K)^T V,
    Z_0 + sum_j phi(K_j))`` as a :class:`LinearState`. Cost O(N C M); the ``(C, M)`` key-value
    summary and the normaliser are accumulated in fp32 for half inputs.
    """
    compute, out_dtype = compute_dtype(phi_q.dtype), v.dtype
    with torch.autocast(phi_q.device.type, enabled=False):  # keep the fp32 accumulation under autocast
        phi_k, v = mask_keys(phi_k, v, key_lengths)
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        kv = phi_k.transpose(-1, -2) @ v  # (B, H, C, M)
        z = phi_k.sum(dim=-2)  # (B, H, C)
        if initial_state is not None:
            s0, z0 = check_linear_state(initial_state, phi_k, v)
            kv, z = kv + s0.to(compute), z + z0.to(compute)
        denominator = (phi_q @ z.unsqueeze(-1)) + eps  # (B, H, N, 1)
        out = ((phi_q @ kv) / denominator).to(out_dtype)
    return (out, joint_state(kv, z)) if return_state else out


def dot_product_with_state(dot_product, phi_q, phi_k, v, initial_state=None, return_final_state=False):
    """Give a causal numerator kernel ``dot_product(phi_q, phi_k, v)`` without a state argument
    an initial and a final state, exactly:

        out_i = phi(q_i)^T S_0 + kernel(phi_q, phi_k, v)_i,     S_N = S_0 + phi(K)^T V.

    Two more matmuls of O(N C M) (fp32 for half inputs), no ``(N, C, M)`` tensor; autograd
    differentiates them (grad S_0 = phi(Q)^T G + grad S_N, grad S_N into phi(K) and V).
    """
    out = dot_product(phi_q, phi_k, v)
    if initial_state is None and not return_final_state:
        return out
    compute = compute_dtype(phi_q.dtype)
    with torch.autocast(phi_q.device.type, enabled=False):
        if initial_state is not None:
            out = (out.to(compute) + phi_q.to(compute) @ initial_state.to(compute)).to(out.dtype)
        if not return_final_state:
            return out
        final = phi_k.to(compute).transpose(-1, -2) @ v.to(compute)
        if initial_state is not None:
            final = final + initial_state.to(compute)
    return out, final


def causal_linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                            key_lengths: torch.Tensor | None = None, eps: float = 1e-6, dot_product: Callable | None = None,
                            initial_state: tuple[torch.Tensor, torch.Tensor] | None = None, return_state: bool = False):
    """Causal linear attention (eq. 9-12): V'_i = phi(Q_i)^T S_i / phi(Q_i)^T Z_i.

    Args: phi_q, phi_k ``(B, H, N, C)``, v ``(B, H, N, M)``, key_lengths ``(B,)``;
    ``dot_product(phi_q, phi_k, v, initial_state=None, return_final_state=False)`` computes the
    numerator (the layers pass ``kernels.causal_dot_product``; None: :func:`.chunk.causal_dot_product`);
    ``initial_state`` ``(S_0 (B, H, C, M), Z_0 (B, H, C))`` is the RNN state before position 0
    (from an earlier segment: the parallel form continues the recurrence), None = empty.
    Returns ``(B, H, N, M)`` in v's dtype; with ``return_state`` also the state after the last
    position ``(S_N, Z_N)`` as a :class:`LinearState` (fp32 for half inputs), exactly what
    :func:`linear_attention_step` continues from. Keys at positions >= ``key_lengths`` enter
    neither the outputs nor the state, so the state is the one of the unpadded sequence.
    Gradients flow into ``initial_state`` and out of the returned state.

    The normaliser Z_i = Z_0 + sum_{j <= i} phi(K_j) is a cumulative sum, O(N C) memory. Half
    inputs are computed in fp32 from the start, numerator and normaliser alike: the numerator of a
    long prefix outgrows float16 (65,504) long before the quotient does, and the gradients of
    phi(Q) and phi(K) are each the sum of a numerator and a normaliser term that nearly cancel
    where v has a nonzero mean, so they are summed in fp32 and rounded to half precision once.
    """
    compute = compute_dtype(v.dtype)
    dot_product = dot_product or chunk.causal_dot_product
    with torch.autocast(phi_q.device.type, enabled=False):
        # under autocast the feature maps may return fp32 for half inputs: one dtype for the kernel
        phi_q, phi_k, values = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        phi_k, values = mask_keys(phi_k, values, key_lengths)
        s0 = z0 = None
        if initial_state is not None:
            s0, z0 = check_linear_state(initial_state, phi_k, values, "causal linear attention")
        if s0 is None and not return_state:
            numerator, s_final = dot_product(phi_q, phi_k, values), None
        else:
            result = dot_product(phi_q, phi_k, values, initial_state=s0, return_final_state=return_state)
            numerator, s_final = result if return_state else (result, None)
        z = phi_k.cumsum(dim=-2)  # (B, H, N, C)
        if z0 is not None:
            z = z + z0.to(compute).unsqueeze(-2)
        denominator = (phi_q * z).sum(dim=-1, keepdim=True) + eps
        out = (numerator / denominator).to(v.dtype)
        if not return_state:
            return out
        z_final = phi_k.sum(dim=-2)  # Z_N; also right for an empty sequence, unlike z[..., -1, :]
        if z0 is not None:
            z_final = z_final + z0.to(compute)
    return out, joint_state(s_final.to(compute), z_final)


def causal_attention(feature_map, q, k, v, key_lengths=None, eps=1e-6, dot_product=None, initial_state=None,
                     return_state=False, cu_seqlens=None):
    """Causal eq. 9-12 from the unmapped ``q, k (B, H, N, D)``, ``v (B, H, N, M)``: the feature map
    (a :class:`~linformer_lab.feature_maps.FeatureMap`), then :func:`causal_linear_attention` with
    the numerator ``dot_product``; with ``cu_seqlens`` (packed sequences, B = 1)
    :func:`packed_linear_attention` in one pass, which computes its own numerator. The PyTorch
    candidate of the ``causal_attention`` op (``ops/kernels.py`` names the op's arguments)."""
    phi_q, phi_k = feature_map.forward_queries(q), feature_map.forward_keys(k)
    if cu_seqlens is not None:
        return packed_linear_attention(phi_q, phi_k, v, cu_seqlens, True, eps, initial_state, return_state)
    return causal_linear_attention(phi_q, phi_k, v, key_lengths, eps, dot_product, initial_state, return_state)
