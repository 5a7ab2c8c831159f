"""Causal linear attention (eq. 9-12, phi = elu + 1) in bfloat16 on CPUs with bf16 matrix units:
the ``bf16`` candidate of the ``causal_attention`` op (``ops/kernels.py``), taken only when forced
(``LINFORMER_LAB_KERNELS=causal_attention=bf16``). Composed of ATen operations, its layer fwd+bwd on
AVX-512-BF16 costs several times the fused float32 kernel's, and its GEMMs are about a quarter of that
time: the rest (maps, cumsums, casts, masks, autograd's saved tensors) would leave it several times
slower on AMX too. What would pay is the chunked form as one C++ kernel on the matrix units, which
needs an AMX CPU to write and measure.

The chunked form: positions in chunks of L, phi(q), phi(k) rounded to bf16; within a chunk the
products are small GEMMs, which ATen hands to oneDNN (AMX tiles or AVX-512-BF16 dot products for the
bf16 ones); across chunks the state is carried in float32::

    A_c     = tril(phi(Q_c) phi(K_c)^T)                    (L x L, bf16 GEMM)
    num_c   = A_c V_c + phi(Q_c) S_{c-1}                   (float32 GEMMs)
    S_c     = S_{c-1} + phi(K_c)^T V_c                     (float32 GEMM, float32 running sum)
    den_t   = phi(q_t) . (z_0 + sum_{s <= t} phi(k_s))     (float32 throughout)

Accuracy: a bf16 GEMM on CPU rounds its output to bf16 (ATen has no float32-output bf16 matmul
there), so only two products are bf16 GEMMs (:class:`_ChunkNumerator`): A_c, whose rounding moves
each weight apart as the inputs' rounding does, and grad K's in the backward, a gradient rounded
once. With every product in bf16 the errors of grad q and grad z_0 were about twice the PyTorch
form's in the same dtype, and the output's grew with N at v of mean 0 (the state summed the rounding
of the centred v). Where v has a large mean the numerator is mostly ``mean x den`` and its gradients
nearly cancel against the normaliser's (``ops/linear_attention``'s half-precision note), which would
magnify any rounding; so v is centred first: with mu the mean of v over positions, out = (num(v -
mu) + mu den) / (den + eps) exactly (the state S_0 becomes S_0 - z_0 mu^T). The gradients come from
autograd over these few large operations, the numerator's from :class:`_ChunkNumerator`.

Packed sequences (``cu_seqlens``) and float32 / float64 inputs are not this path's: the fused C++
kernel takes them (:func:`causal_attention` hands packed input over). Forced, it runs where the CPU
has the units (:func:`matrix_units`).
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

__all__ = ["CHUNK", "accepts", "available", "causal_attention", "cpuinfo_flags", "matrix_units", "units_of"]

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
                flags = cpuinfo_flags(info.read())
        except OSError:
            pass
    return units_of(flags)


def cpuinfo_flags(text: str) -> set[str]:
    """The CPU flags of the first ``flags`` line of a ``/proc/cpuinfo`` text (empty without one)."""
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def units_of(flags: set[str]) -> str | None:
    """:func:`matrix_units`'s answer for a set of CPU flags (torch's or ``/proc/cpuinfo``'s names)."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def available() -> bool:
    """bf16 matrix units here and oneDNN's bf16 matmul in this torch build."""
    return matrix_units() is not None and torch.backends.mkldnn.is_available()


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
            """(B, H, N, D) float32 -> (B, H, chunks, L, D) float32. Each use of an operand rounds it to
            bf16 itself, so autograd sums the uses' gradients in float32, not in bfloat16."""
            return F.pad(x, (0, 0, 0, pad)).reshape(b, h, chunks, CHUNK, x.shape[-1])

        q_blocks, k_blocks, v_blocks = blocks(phi_q), blocks(phi_k), blocks(centred)
        # S before each chunk: S_0 plus the float32 running sum of the chunks' k^T v (k rounded to bf16)
        per_chunk = k_blocks.to(torch.bfloat16).float().transpose(-1, -2) @ v_blocks  # (B, H, chunks, C, M)
        before = torch.cat([s0_centred.unsqueeze(2), s0_centred.unsqueeze(2) + per_chunk.cumsum(dim=2)[:, :, :-1]],
                           dim=2)
        numerator = _ChunkNumerator.apply(q_blocks, k_blocks, v_blocks, before)
        numerator = numerator.reshape(b, h, chunks * CHUNK, m)[:, :, :n]
        out = ((numerator + den * mean) / (den + eps)).to(v.dtype)
        if not return_state:
            return out
        s_n = before[:, :, -1] + per_chunk[:, :, -1] + z[:, :, -1].unsqueeze(-1) * mean.squeeze(2).unsqueeze(-2)
        return out, joint_state(s_n, z[:, :, -1])


class _ChunkNumerator(torch.autograd.Function):
    """``tril(Q K^T) V + Q S`` per chunk: ``Q, K (..., L, C)``, ``V (..., L, M)``, ``S (..., C, M)``
    float32 -> float32 ``(..., L, M)``, Q and K rounded to bf16. ``Q K^T`` and grad K's ``tril(G
    V^T)^T Q`` are bf16 GEMMs; the other products are float32 ones, as the module docstring says why
    (grad q from an intra-chunk and a state term each rounded to bf16 had twice the error)."""

    @staticmethod
    def forward(ctx, q, k, v, state):
        q, k = (x.to(torch.bfloat16) for x in (q, k))
        causal = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0)  # bf16 GEMM
        ctx.save_for_backward(q, k, v, state, scores, causal)
        return scores.float() @ v + q.float() @ state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, state, scores, causal = ctx.saved_tensors
        grad_scores = (grad @ v.transpose(-1, -2)).masked_fill(~causal, 0)
        grad_q = grad_scores @ k.float() + grad @ state.transpose(-1, -2)
        grad_k = (grad_scores.to(torch.bfloat16).transpose(-1, -2) @ q).float()  # bf16 GEMM
        grad_v = scores.float().transpose(-1, -2) @ grad
        grad_state = q.float().transpose(-1, -2) @ grad
        return grad_q, grad_k, grad_v, grad_state
