"""The causal numerator of linear attention (eq. 9), chunked, with the eq. 13-15 backward.

Shapes follow ``scaled_dot_product_attention``: ``phi_q, phi_k (B, H, N, C)`` (C = the
feature map's output dim), ``v (B, H, N, M)``.

Causal attention is computed chunk-wise. Split the sequence into chunks of L positions;
for a query i in chunk c,

    sum_{j <= i} (q_i . k_j) v_j  =  q_i^T S_{c-1}  +  sum_{j in c, j <= i} (q_i . k_j) v_j

where S_{c-1} = sum over all earlier chunks of k_j v_j^T is the RNN state of eq. 10 at the
chunk boundary, and the second term an (L x L) masked matrix product inside the chunk: matmuls
and one scan over chunks, no loop over time steps. Chunk states are (N / L) x C x M, which is
O(N max(C, M)) because L >= min(C, M); the (N, C, M) tensor of per-step states is never formed.
The backward is eq. 13-15 organised the same way: grad Q uses the forward prefix states S, grad K
and grad V the suffix states R_i = sum_{j >= i} q_j g_j^T (the backward scan of Algorithm 1).
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are accumulated in fp32 (states and normaliser); fp32/fp64 as is."""
    return torch.float32 if dtype in _HALF else dtype


def reference_chunk_size(feature_dim: int, value_dim: int) -> int:
    """The chunk length of :class:`CausalDotProduct` (the ``pytorch`` numerator) when none is given:
    at least min(C, M) so chunk states stay O(N max(C, M)), at least 32 so matmuls are not tiny, at
    most 256 so intra-chunk work stays small."""
    return max(32, min(256, min(feature_dim, value_dim)))


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None,
                       initial_state: torch.Tensor | None = None, return_final_state: bool = False):
    """The causal numerator of eq. 9 in PyTorch, chunked (:class:`CausalDotProduct`): the ``causal``
    op's ``pytorch`` candidate in :mod:`linformer_lab.ops.kernels`, which also says its contract."""
    return CausalDotProduct.apply(q, k, v, chunk_size, initial_state, return_final_state)


def _chunked(x: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, N, X) -> (B H, N/L, L, X)``, contiguous, in ``dtype``, zero-padding N up to a
    multiple of L. Zero keys and values add nothing to any state; outputs of zero queries are
    cut off afterwards."""
    b, h, n, d = x.shape
    pad = (-n) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.to(dtype).reshape(b * h, (n + pad) // chunk, chunk, d).contiguous()


def _unchunked(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(B H, N/L, L, X) -> (B, H, N, X)`` in ``like``'s dtype, the padding cut off."""
    b, h, n, _ = like.shape
    # every size spelled out: with B, H or X = 0 the tensor is empty and a -1 would be ambiguous
    return x.view(b, h, x.shape[1] * x.shape[2], x.shape[-1])[:, :, :n].to(like.dtype)


def _batched(x: torch.Tensor) -> torch.Tensor:
    """A ``(B H, n, R, X)`` tensor as the ``(B H n, R, X)`` batch of ``bmm``: a view, so
    ``bmm(..., out=)`` writes straight into it."""
    return x.flatten(0, 1)


def _exclusive_scan_(x: torch.Tensor, reverse: bool = False, initial: torch.Tensor | None = None) -> torch.Tensor:
    """In place along dim 1 (chunks): each entry becomes ``initial`` plus the sum of the entries
    strictly before it (or strictly after, with ``reverse``). ``x (rows, n, C, M)``, ``initial
    (rows, C, M)`` or None for zero. Returns the running sum past the last entry: ``initial``
    plus all entries (the final state of the forward scan).

    A loop over chunks (not time steps) with a (rows, C, M) running sum, rather than
    ``torch.cumsum`` along a non-innermost dim, which is slow; in place because a fresh output
    costs page faults on first touch.
    """
    running = x.new_zeros(x.shape[0], *x.shape[2:]) if initial is None else initial.to(x.dtype, copy=True)
    spare = torch.empty_like(running)
    order = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
    for i in order:
        torch.add(running, x[:, i], out=spare)  # sum up to and including i
        x[:, i].copy_(running)  # sum strictly before i
        running, spare = spare, running
    return running


class CausalDotProduct(torch.autograd.Function):
    """Numerator of eq. 9 with the constant-memory backward of eq. 13-15.

    ``apply(q, k, v, chunk_size=None, initial_state=None, return_final_state=False)``:
    ``initial_state`` is S_0 ``(B, H, C, M)`` (the state of everything before position 0), so
    out_i = q_i^T (S_0 + sum_{j <= i} k_j v_j^T); with ``return_final_state`` the result is
    ``(out, S_N)``, S_N = S_0 + sum_j k_j v_j^T in the compute dtype (fp32 for half inputs).
    Gradients flow into S_0 (grad S_0 = sum_i q_i g_i^T + grad S_N) and from S_N into k and v:
    both are the suffix state R of the backward scan started at grad S_N instead of 0.

    Works on ``(B H, n, L, X)`` chunked views, all rows in one batch of matmuls; outputs, saved
    states and saved scores are written in place (``bmm(out=)``, ``baddbmm_``).

    Saved for backward: the inputs, the (N / L, C, M) chunk-boundary states and, when the
    chunk is no longer than max(C, M), the masked intra-chunk scores q_i . k_j (N L numbers, at
    most the size of an input), which saves a third of the backward's intra-chunk matmuls.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None,
                initial_state: torch.Tensor | None = None, return_final_state: bool = False):
        # Autocast would run the matmuls below in bf16/fp16 and save a half-precision state;
        # we accumulate in fp32 ourselves, so autocast is off in both passes.
        with torch.autocast(q.device.type, enabled=False):
            return CausalDotProduct._forward(ctx, q, k, v, chunk_size, initial_state, return_final_state)

    @staticmethod
    def _forward(ctx, q, k, v, chunk_size, initial_state, return_final_state):
        chunk = chunk_size or reference_chunk_size(q.shape[-1], v.shape[-1])
        compute = compute_dtype(q.dtype)
        qc, kc, vc = (_chunked(t, chunk, compute) for t in (q, k, v))
        rows, n_chunks, c, m = qc.shape[0], qc.shape[1], qc.shape[-1], vc.shape[-1]
        initial = None if initial_state is None else initial_state.reshape(rows, c, m)
        prefix = qc.new_empty(rows, n_chunks, c, m)  # S before each chunk (eq. 10 at chunk boundaries)
        # [i, j] = q_i . k_j for j <= i inside each chunk, kept for grad V (class docstring)
        keep_scores = chunk <= max(c, m)
        scores = qc.new_empty(rows, n_chunks, chunk, chunk) if keep_scores else None
        out = qc.new_empty(rows, n_chunks, chunk, m)
        q3, k3, v3, prefix3 = _batched(qc), _batched(kc), _batched(vc), _batched(prefix)
        torch.bmm(k3.transpose(1, 2), v3, out=prefix3)
        final = _exclusive_scan_(prefix, initial=initial)  # S_N
        if keep_scores:
            scores3 = torch.bmm(q3, k3.transpose(1, 2), out=_batched(scores))
        else:
            scores3 = torch.bmm(q3, k3.transpose(1, 2))
        scores3.tril_()
        # intra-chunk term, then the state term accumulated by BLAS (beta = 1) in place
        torch.bmm(scores3, v3, out=_batched(out)).baddbmm_(q3, prefix3)
        ctx.chunk = chunk
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)  # an unused final state sends None, not a zero tensor
        ctx.save_for_backward(q, k, v, prefix, *((scores,) if keep_scores else ()))
        out = _unchunked(out, q)
        if not return_final_state:
            return out
        return out, final.view(*q.shape[:2], c, m)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_final: torch.Tensor | None = None):
        saved = ctx.saved_tensors  # read once: activation checkpointing allows one unpack
        with torch.autocast(saved[0].device.type, enabled=False):
            return CausalDotProduct._backward(ctx, saved, grad_out, grad_final)

    @staticmethod
    def _backward(ctx, saved, grad_out, grad_final):
        q, k, v, prefix, *kept = saved
        chunk, compute = ctx.chunk, prefix.dtype
        if grad_out is None:
            grad_out = torch.zeros_like(v)
        qc, kc, vc, gc = (_chunked(t, chunk, compute) for t in (q, k, v, grad_out))
        rows, n_chunks, c, m = qc.shape[0], qc.shape[1], qc.shape[-1], vc.shape[-1]
        grad_end = None if grad_final is None else grad_final.reshape(rows, c, m)
        grad_q, grad_k, grad_v = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(vc)
        q3, k3, v3, g3 = _batched(qc), _batched(kc), _batched(vc), _batched(gc)
        # eq. 13: grad Q_i = sum_{j <= i} (g_i . v_j) k_j = g_i S_i^T
        gv_scores = torch.bmm(g3, v3.transpose(1, 2)).tril_()  # [i, j] = g_i . v_j, j <= i
        torch.bmm(gv_scores, k3, out=_batched(grad_q)).baddbmm_(g3, _batched(prefix).transpose(1, 2))
        # eq. 14-15 with R = grad S_N + sum_{j >= i} q_j g_j^T: grad K_i = R_i v_i, grad V_i = R_i^T k_i
        suffix = torch.bmm(q3.transpose(1, 2), g3)
        # grad S_0 = R_0, the suffix state before position 0
        grad_initial = _exclusive_scan_(suffix.view(rows, n_chunks, c, m), reverse=True, initial=grad_end)
        torch.bmm(gv_scores.transpose(1, 2), q3, out=_batched(grad_k)).baddbmm_(v3, suffix.transpose(1, 2))
        del gv_scores
        qk_scores = _batched(kept[0]) if kept else torch.bmm(q3, k3.transpose(1, 2)).tril_()
        torch.bmm(qk_scores.transpose(1, 2), g3, out=_batched(grad_v)).baddbmm_(k3, suffix)
        if ctx.initial_dtype is None:
            grad_initial = None
        else:
            grad_initial = grad_initial.view(*q.shape[:2], c, m).to(ctx.initial_dtype)
        return _unchunked(grad_q, q), _unchunked(grad_k, k), _unchunked(grad_v, v), None, grad_initial, None

