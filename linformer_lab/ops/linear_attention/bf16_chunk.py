"""Causal linear attention (eq. 9-12, phi = elu + 1) in bfloat16 on CPUs with bf16 matrix units:
the ``bf16`` candidate of the ``causal_attention`` op (``ops/kernels.py``).

The chunked form: positions in chunks of L; within a chunk the products are small GEMMs on bf16
operands, which ATen hands to oneDNN (AMX tiles or AVX-512-BF16 dot products where the CPU has
them); across chunks the state is carried in float32::

    A_c     = tril(phi(Q_c) phi(K_c)^T)                    (L x L, bf16 GEMM)
    num_c   = A_c V_c + phi(Q_c) S_{c-1}                   (bf16 GEMMs, summed in float32)
    S_c     = S_{c-1} + phi(K_c)^T V_c                     (bf16 GEMM, float32 running sum)
    den_t   = phi(q_t) . (z_0 + sum_{s <= t} phi(k_s))     (float32 throughout)

Accuracy: a bf16 GEMM rounds its output to bf16, so each numerator carries a relative error of
about 2^-9 of its own size. Where v has a large mean the numerator is mostly ``mean x den`` and its
gradients nearly cancel against the normaliser's (``ops/linear_attention``'s half-precision note),
which would magnify that rounding. So v is centred first: with mu the mean of v over positions,
out = (num(v - mu) + mu den) / (den + eps) exactly (the state S_0 becomes S_0 - z_0 mu^T), and only
the centred numerator, of the size of v's spread, goes through bf16. The gradients come from
autograd over these few large operations, in the same dtypes.

Packed sequences (``cu_seqlens``) and float32 / float64 inputs are not this path's: the fused C++
kernel takes them (:func:`causal_attention` hands packed input over). Whether the CPU has the units
(:func:`matrix_units`) decides whether the dispatch chooses this path by itself (:func:`pays_here`).
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

__all__ = ["CHUNK", "accepts", "available", "causal_attention", "matrix_units", "pays_here"]

#: Positions per chunk: the intra-chunk GEMMs are (L x C) (C x L) and (L x L) (L x M).
CHUNK = 64


@functools.cache
def matrix_units() -> str | None:
    """``"amx"`` where the CPU has AMX tiles for bf16, ``"avx512_bf16"`` where it has AVX-512's bf16 dot
    products only, None otherwise; from torch's CPU feature probe, else ``/proc/cpuinfo``'s flags."""
    flags: set[str] = set()
    try:
        capability = torch._C._cpu._get_cpu_capability()
        flags = {name for name, present in capability.items() if present is True}
    except (AttributeError, RuntimeError):
        try:
            with open("/proc/cpuinfo") as info:
                match = re.search(r"^flags\s*:(.*)$", info.read(), re.MULTILINE)
            flags = set(match.group(1).split()) if match else set()
        except OSError:
            pass
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def available() -> bool:
    """bf16 matrix units here and oneDNN's bf16 matmul in this torch build."""
    return matrix_units() is not None and torch.backends.mkldnn.is_available()


def pays_here() -> bool:
    """Whether the dispatch takes this path unforced: on AMX. With AVX-512-BF16 alone the fused
    float32 kernel is faster (its bf16 dot products only double the float32 FMA rate, and the chunked
    form does more arithmetic than the recurrence), so there it runs only when forced
    (``LINFORMER_LAB_KERNELS=causal_attention=bf16``)."""
    return matrix_units() == "amx"


def accepts(feature_map, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The elu map on bfloat16 CPU self-attention ``(B, H, N, D)`` (q, k, v all bfloat16)."""
    from linformer_lab.ops.linear_attention import cpu_kernel

    return cpu_kernel.accepts_attention(feature_map, q, k, v) and v.dtype == torch.bfloat16


def causal_attention(feature_map, q, k, v, key_lengths=None, eps=1e-6, dot_product=None, initial_state=None,
                     return_state=False, cu_seqlens=None):
    """The ``causal_attention`` op's arguments (``ops/kernels.py``): unmapped ``q, k (B, H, N, C)``,
    ``v (B, H, N, M)`` in bfloat16, ``key_lengths (B,)``, ``initial_state (S_0 (B, H, C, M), Z_0 (B, H, C))``.
    Returns ``(B, H, N, M)`` bfloat16, with ``return_state`` also ``(S_N, Z_N)`` as a
    :class:`~linformer_lab.ops.linear_attention.recurrent.LinearState` in float32. ``dot_product``
    is not used; packed input (``cu_seqlens``) runs on the fused float32 kernel."""
    from linformer_lab.ops.linear_attention import check_linear_state, cpu_kernel, joint_state
    from linformer_lab.ops.masks import length_mask

    if cu_seqlens is not None:
        return cpu_kernel.causal_attention(feature_map, q, k, v, key_lengths, eps, dot_product, initial_state,
                                           return_state, cu_seqlens)
    if not cpu_kernel.fuses(feature_map):
        raise ValueError(f"the bf16 CPU attention computes the elu feature map only, not {type(feature_map).__name__}")
    b, h, n, c = q.shape
    m = v.shape[-1]
    with torch.autocast("cpu", enabled=False):
        # phi = elu + 1 as the fused kernel computes it: exp(min(x, 0)) + max(x, 0), without the
        # cancellation of (exp(x) - 1) + 1 that makes phi 0 below about -17 in fp32
        phi_q, phi_k = (torch.exp(x.float().clamp_max(0.0)) + x.float().clamp_min(0.0) for x in (q, k))
        values = v.float()
        if key_lengths is not None:
            valid = length_mask(key_lengths.to(q.device), n)[:, None, :, None]
            phi_k, values = phi_k * valid, values * valid
        if initial_state is not None:
            s0, z0 = (x.float() for x in check_linear_state(initial_state, k, v, "bf16 causal linear attention"))
        else:
            s0, z0 = phi_k.new_zeros(b, h, c, m), phi_k.new_zeros(b, h, c)
        mean = values.mean(dim=2, keepdim=True)  # (B, H, 1, M): the centring (module docstring)
        centred = values - mean
        if key_lengths is not None:
            centred = centred * valid  # masked keys stay out of every sum
        s0_centred = s0 - z0.unsqueeze(-1) * mean

        z = z0.unsqueeze(2) + phi_k.cumsum(dim=2)  # (B, H, N, C), float32
        den = (phi_q * z).sum(dim=-1, keepdim=True)  # (B, H, N, 1)

        chunks = -(-n // CHUNK)
        pad = chunks * CHUNK - n

        def blocks(x: torch.Tensor) -> torch.Tensor:
            """(B, H, N, D) float32 -> (B, H, chunks, L, D) bfloat16. Each use of an operand takes a cast
            of its own, so autograd sums the uses' gradients in float32, not in bfloat16."""
            return F.pad(x, (0, 0, 0, pad)).to(torch.bfloat16).reshape(b, h, chunks, CHUNK, x.shape[-1])

        # S before each chunk: S_0 plus the float32 running sum of the chunks' bf16 k^T v
        per_chunk = (blocks(phi_k).transpose(-1, -2) @ blocks(centred)).float()  # (B, H, chunks, C, M)
        before = torch.cat([s0_centred.unsqueeze(2), s0_centred.unsqueeze(2) + per_chunk.cumsum(dim=2)[:, :, :-1]],
                           dim=2)
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
        scores = (blocks(phi_q) @ blocks(phi_k).transpose(-1, -2)).masked_fill(~causal, 0)
        numerator = (scores @ blocks(centred)).float() + (blocks(phi_q) @ before.to(torch.bfloat16)).float()
        numerator = numerator.reshape(b, h, chunks * CHUNK, m)[:, :, :n]
        out = ((numerator + den * mean) / (den + eps)).to(v.dtype)
        if not return_state:
            return out
        s_n = before[:, :, -1] + per_chunk[:, :, -1] + z[:, :, -1].unsqueeze(-1) * mean.squeeze(2).unsqueeze(-2)
        return out, joint_state(s_n, z[:, :, -1])
