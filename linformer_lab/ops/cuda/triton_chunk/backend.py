"""The Triton chunk kernel as the attention layers call it: the ``causal_attention`` op's GPU
candidate in :mod:`linformer_lab.ops.kernels` (``linear`` on a GPU; ``linear_cuda`` forces it), with
the arguments of the op's ``pytorch`` candidate: unmapped q, k ``(B, H, N, D)``, v ``(B, H, N, M)``.
The elu map (eq. 7) runs inside the kernels; any other map, or elu with ``key_lengths`` (masked
keys must be exactly zero after the map), is applied here first.
"""

from __future__ import annotations

import torch

from linformer_lab.ops.cuda.triton_chunk.op import MAX_WIDTH, chunk_linear_attention
from linformer_lab.ops.linear_attention import computed_in, joint_state, mask_keys

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fuses(feature_map) -> bool:
    """True when the kernels apply ``feature_map`` themselves: its ``kernel_form`` names
    ``"triton"`` (the elu map of eq. 7)."""
    return computed_in("triton", feature_map)


def accepts(feature_map, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA tensors on one device, v float32, float16 or bfloat16 (q and k are cast to it), self
    attention of one length, something to compute, the map's features and the values at most
    :data:`~.op.MAX_WIDTH` wide (whether the kernels run on this machine is the candidate's
    ``available``: ``triton_chunk.is_available``)."""
    return (q.device.type == "cuda" and k.device == q.device and v.device == q.device and v.dtype in _DTYPES
            and q.dim() == 4 and q.shape[:-1] == k.shape[:-1] == v.shape[:-1] and v.numel() > 0
            and max(feature_map.output_dim, v.shape[-1]) <= MAX_WIDTH)


def causal_attention(feature_map, q, k, v, key_lengths=None, eps=1e-6, dot_product=None, initial_state=None,
                     return_state=False, cu_seqlens=None):
    """Causal eq. 9-12 in the Triton kernels: ``(B, H, N, M)`` in v's dtype, with ``return_state``
    also the state after the last position as a ``LinearState`` (fp32; one row per packed
    sequence with ``cu_seqlens``). ``dot_product`` is not used: the kernels compute the numerator."""
    if fuses(feature_map) and key_lengths is None:
        q, k, mapped = q.to(v.dtype), k.to(v.dtype), "elu"
    else:
        q, k, mapped = feature_map.forward_queries(q).to(v.dtype), feature_map.forward_keys(k).to(v.dtype), None
        k, v = mask_keys(k, v, key_lengths)  # keys past a row's length enter neither the outputs nor the state
    state = None if initial_state is None else (initial_state[0], initial_state[1])
    result = chunk_linear_attention(q, k, v, feature_map=mapped, eps=eps, initial_state=state,
                                    return_final_state=return_state, cu_seqlens=cu_seqlens)
    if not return_state:
        return result
    out, (s_n, z_n) = result
    return out, joint_state(s_n, z_n)
