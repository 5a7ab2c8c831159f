"""Causal linear attention on CPU through the C++ recurrence (``linformer_lab/ops/cpu/causal_recurrence.cpp``):
the CPU candidate of the ``causal_attention`` op (:mod:`linformer_lab.ops.kernels`; ``attention/linear.py``'s
causal forward), for every feature map.

:func:`causal_attention` computes the numerator and the normaliser (z, the state's one more row) in
one forward and one backward pass of the kernel (its ``attention_forward`` / ``attention_backward``,
the operators ``causal_attention_forward`` / ``_backward`` of :mod:`linformer_lab.ops.custom_ops`,
so ``torch.compile`` traces through it), and with the elu + 1 map (eq. 7) phi too; other maps are
applied by PyTorch first (``mapped``), which differentiates them. float16 / bfloat16 inputs run as
float32, as the PyTorch forms accumulate them
(:func:`~linformer_lab.ops.linear_attention.chunk.compute_dtype`): the output comes back in the
inputs' dtype, the state in float32.

The kernel's loops hold a tile of the state in SIMD registers while the positions stream past, so
they need C and M in whole registers. Other C, M (odd head sizes, poly2's 1 + D + D (D + 1) / 2
features) are zero-padded up to whole registers (:func:`recurrence_dims`): zero columns of phi(q),
phi(k) and v add nothing to any state or output (a zero column of q maps to phi = 1, so the kernel
zeroes phi in C's padding columns, and phi(k) past ``key_lengths``), and the padded columns of the
results are cut off. ``tests/ops/test_causal_cpu_attention.py`` and ``test_causal_recurrence.py``
hold it to the float64 naive attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linformer_lab.ops import cpu, custom_ops
from linformer_lab.ops.linear_attention import check_linear_state, computed_in, joint_state
from linformer_lab.ops.linear_attention.chunk import compute_dtype
from linformer_lab.ops.masks import length_mask

__all__ = ["accepts_attention", "causal_attention", "recurrence_dims"]


def _padded(size: int, width: int) -> int:
    """``size`` up to a multiple of ``width``, at least one (an empty C or M runs one zero register)."""
    return max(1, -(-size // width)) * width


@torch.compiler.assume_constant_result  # traced as its value: the extension is built and asked once per shape
def recurrence_dims(feature_dim: int, value_dim: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """(C', M') that the kernel runs (C, M) as in ``dtype``: (C, M) where they fill whole
    registers, else both zero-padded to the register width with the fewest vector FMAs per
    position (C' M' / width: D = 7 pads to 8 floats, D = 33 to 48 where AVX-512 has 16); None
    where the extension cannot be had (warned once) or ``dtype`` is not float32 / float64."""
    module = cpu.CAUSAL_RECURRENCE.module()
    if module is None or dtype not in (torch.float32, torch.float64):
        return None
    like = torch.empty(0, dtype=dtype)
    if module.fits(feature_dim, value_dim, like):
        return feature_dim, value_dim
    widths = []  # in elements, the widest register of the instruction set in use down to 16 bytes
    width = module.width(64, 64, like) // like.element_size()
    while width * like.element_size() >= 16:
        widths.append(width)
        width //= 2
    best = min(widths, key=lambda w: (_padded(feature_dim, w) * _padded(value_dim, w) / w, -w))
    return _padded(feature_dim, best), _padded(value_dim, best)


def _padded_inputs(q, k, v):
    """``(q, k, v, pad_c, pad_m)``: q, k, v of one float32 / float64 dtype zero-padded in C and M to
    what the kernel runs, contiguous (the operators read raw rows), and the padding."""
    c, m = q.shape[-1], v.shape[-1]
    dims = recurrence_dims(c, m, q.dtype)
    if dims is None:
        raise RuntimeError(f"the fused CPU attention does not run {q.dtype} here: it takes float32, float64, "
                           "float16 or bfloat16 (as float32), and needs the causal_recurrence.cpp extension built")
    pad_c, pad_m = dims[0] - c, dims[1] - m
    if pad_c or pad_m:
        return F.pad(q, (0, pad_c)), F.pad(k, (0, pad_c)), F.pad(v, (0, pad_m)), pad_c, pad_m
    return q.contiguous(), k.contiguous(), v.contiguous(), 0, 0


_ATTENTION_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def accepts_attention(feature_map, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Any feature map, CPU tensors of one dtype (float16 / bfloat16 run as float32), self-attention
    ``(B, H, N, D)`` of one length: what :func:`causal_attention` takes."""
    return (q.dim() == 4 and q.shape[:-1] == k.shape[:-1] == v.shape[:-1]
            and q.shape[-1] == k.shape[-1] and q.dtype == k.dtype == v.dtype and v.dtype in _ATTENTION_DTYPES
            and q.device.type == k.device.type == v.device.type == "cpu")


def causal_attention(feature_map, q, k, v, key_lengths=None, eps=1e-6, dot_product=None, initial_state=None,
                     return_state=False, cu_seqlens=None):
    """Causal eq. 9-12 in the fused C++ kernel (module docstring; the map inside it where its
    ``kernel_form`` names ``"cpp"``, the elu map, any other applied here first). The
    ``causal_attention`` op's arguments (``ops/kernels.py``): unmapped ``q, k (B, H, N, D)``,
    ``v (B, H, N, M)``, ``key_lengths (B,)``, ``initial_state (S_0 (S, H, D, M), Z_0 (S, H, D))``
    with S = B, or with ``cu_seqlens`` (int ``[0, n_1, ..., N]``, B = 1) one row per packed
    sequence. Returns ``(B, H, N, M)`` in v's dtype, with ``return_state`` also ``(S_N, Z_N)`` as a
    :class:`LinearState` in the compute dtype (float32 for half inputs). ``dot_product`` is not
    used: the kernel computes the numerator."""
    dtype = v.dtype
    compute = compute_dtype(dtype)
    mapped = not computed_in("cpp", feature_map)
    if mapped:
        q, k = feature_map.forward_queries(q), feature_map.forward_keys(k)  # (B, H, N, C)
        if key_lengths is not None:  # masked keys out here too: the kernel zeroes them, autograd must see it
            k = k * length_mask(key_lengths, k.shape[2])[:, None, :, None].to(k.dtype)
    s0 = z0 = None
    if initial_state is not None:  # one row per batch entry, or per packed sequence
        packed = cu_seqlens is not None
        s0, z0 = check_linear_state(initial_state, k, v, f"{'packed ' * packed}causal linear attention",
                                    rows=cu_seqlens.shape[0] - 1 if packed else None)
        s0, z0 = s0.to(compute), z0.to(compute)
    with torch.autocast("cpu", enabled=False):
        c, m = q.shape[-1], v.shape[-1]
        q, k, v, pad_c, pad_m = _padded_inputs(q.to(compute), k.to(compute), v.to(compute))
        if pad_c or pad_m:
            s0 = None if s0 is None else F.pad(s0, (0, pad_m, 0, pad_c))
            z0 = None if z0 is None else F.pad(z0, (0, pad_c))
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device="cpu", dtype=torch.int64)
        if key_lengths is not None:
            key_lengths = key_lengths.to(device="cpu", dtype=torch.int64)
        out, _, s_n, z_n, *_ = custom_ops.causal_attention_forward(q, k, v, s0, z0, cu_seqlens, key_lengths, c,
                                                                   float(eps), mapped)
        if pad_c or pad_m:
            out, s_n, z_n = out[..., :m], s_n[..., :c, :m], z_n[..., :c]
    out = out.to(dtype)
    if not return_state:
        return out
    return out, joint_state(s_n, z_n)
