"""The Triton kernels' chunk algorithm in plain PyTorch: same signature, same arithmetic order
(states before each chunk, masked intra-chunk scores, the normaliser from their row sums),
differentiated by autograd, on any device and dtype (float64 too): the tests hold it to the naive
form and the kernels to it. Slow: a Python loop over sequences."""

from __future__ import annotations

import torch

from linformer_lab.ops.linear_attention import elu_plus_one
from linformer_lab.ops.linear_attention.chunk import compute_dtype


def _one_sequence(q, k, v, s0, z0, chunk: int, eps: float):
    """``q, k (H, n, C)``, ``v (H, n, M)``, ``s0 (H, C, M)``, ``z0 (H, C)`` in the compute dtype
    -> out ``(H, n, M)``, S_n, z_n."""
    h, n, c = q.shape
    m = v.shape[-1]
    pad = (-n) % chunk
    chunks = (n + pad) // chunk
    qc, kc, vc = (torch.nn.functional.pad(x, (0, 0, 0, pad)).view(h, chunks, chunk, x.shape[-1]) for x in (q, k, v))
    # states before each chunk: S_0 plus the sums of k_j v_j^T over the chunks before it
    per_chunk = kc.transpose(-1, -2) @ vc  # (H, chunks, C, M)
    after = s0[:, None] + per_chunk.cumsum(dim=1)
    before = torch.cat([s0[:, None], after[:, :-1]], dim=1)
    z_after = z0[:, None] + kc.sum(dim=2).cumsum(dim=1)
    z_before = torch.cat([z0[:, None], z_after[:, :-1]], dim=1)
    scores = (qc @ kc.transpose(-1, -2)).tril()  # (H, chunks, L, L): q_i . k_j, j <= i
    num = qc @ before + scores @ vc
    den = (qc * z_before[:, :, None, :]).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True) + eps
    out = (num / den).reshape(h, chunks * chunk, m)[:, :n]
    if after.shape[1] == 0:  # an empty sequence: the state stays the initial one
        return out, s0, z0
    return out, after[:, -1], z_after[:, -1]


def chunk_linear_attention_torch(q, k, v, *, feature_map="elu", eps=1e-6, initial_state=None,
                                     return_final_state=False, cu_seqlens=None, chunk_size=64, head_first=True):
    """The arguments and results of
    :func:`~linformer_lab.ops.cuda.triton_chunk.chunk_linear_attention`, computed in PyTorch."""
    if not head_first:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if feature_map == "elu":
        q, k = elu_plus_one(q), elu_plus_one(k)
    compute = compute_dtype(v.dtype)
    b, h, t, c = q.shape
    m = v.shape[-1]
    if cu_seqlens is None:
        bounds = [(i, 0, t) for i in range(b)]
    else:
        edges = [int(x) for x in cu_seqlens.tolist()]
        bounds = [(0, start, stop) for start, stop in zip(edges[:-1], edges[1:])]
    if initial_state is None:
        s0 = torch.zeros(len(bounds), h, c, m, dtype=compute, device=v.device)
        z0 = torch.zeros(len(bounds), h, c, dtype=compute, device=v.device)
    else:
        s0, z0 = (x.to(compute) for x in initial_state)
    outs, s_final, z_final = [], [], []
    for i, (row, start, stop) in enumerate(bounds):
        part = (x[row, :, start:stop].to(compute) for x in (q, k, v))
        out, s_n, z_n = _one_sequence(*part, s0[i], z0[i], chunk_size, eps)
        outs.append(out)
        s_final.append(s_n)
        z_final.append(z_n)
    out = torch.stack(outs) if cu_seqlens is None else torch.cat(outs, dim=1)[None]
    out = out.to(v.dtype)
    if not head_first:
        out = out.transpose(1, 2)
    if not return_final_state:
        return out
    return out, (torch.stack(s_final), torch.stack(z_final))
