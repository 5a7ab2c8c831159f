"""Reformer's LSH attention (Kitaev et al. 2020), the paper's ``lsh-X`` baseline.

Shared-QK attention: keys are the unit-normalised queries. Every round of hashing
(``n_hashes`` in total) does:

1. hash each position with a random rotation: bucket = argmax([x R, -x R]), R ``(D, n_buckets/2)``;
2. sort positions by (bucket, position); the rounds' sorted orders are laid end to end;
3. cut that order into chunks of ``chunk_size``; every chunk attends to itself and to the
   chunk before it (wrapping around, so a bucket split by a chunk border still sees itself);
4. mask the future (causal), padding, and the token itself: a token attends to itself only
   when no other key is visible to it in any round, because q . q/|q| would dominate every
   other score (Reformer §2);
5. un-sort, and combine the rounds by their softmax normalisers (log-sum-exp).

**Duplicates across rounds** are counted once, as Reformer defines multi-round attention: query
i attends over the *union* P_i of the keys its windows hold in all rounds, each key once.
Where key j stands in N_ij of i's windows (several rounds hashed them together, or one round's
window holds it twice), each copy's score is lowered by log N_ij, so the copies together weigh
exactly what one key weighs. Step 5 then gives ``softmax over P_i`` exactly: every row's weights
sum to one, whatever the number of rounds.

**Precision.** Hashing, scores, normalisers and the weighted sum run in float32 (float64 for
float64 inputs) with autocast off, and masks are ``-inf`` with the fully masked cases handled
explicitly: no finite sentinel that a half dtype overflows or that swamps the real scores'
precision. The result comes back in the input dtype.

Cost O(N n_hashes chunk_size D) time and memory (the duplicate counts add integer comparisons
of the same order when n_hashes > 1). Step 4 (masks, counts, window softmax and its backward)
is the caller's ``window`` function: :func:`window_attention_torch` by default; the ``lsh``
backend passes ``kernels.lsh_window`` (the C++ :func:`window_attention_cpp` on CPU). Which
earlier tokens share a chunk depends on where *all* tokens hash, later ones included; RNN mode
therefore re-runs the attention over the prefix (the paper's baseline for lsh generation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from linformer_lab.ops.masks import length_mask


def lsh_attention(
    q: torch.Tensor,
    v: torch.Tensor,
    rotations: torch.Tensor,
    chunk_size: int,
    causal: bool,
    key_lengths: torch.Tensor | None = None,
    window: Callable | None = None,
) -> torch.Tensor:
    """Args:
        q: ``(B, H, N, D)`` shared queries/keys.
        v: ``(B, H, N, M)``.
        rotations: ``(D, n_hashes, n_buckets // 2)`` random projection for hashing.
        chunk_size: positions per attention chunk.
        key_lengths: ``(B,)``, keys at positions >= length are ignored; query positions past
            the length are padding and return zeros.
        window: step 4, with :func:`window_attention_torch`'s arguments and results (None: that one).
    Returns: ``(B, H, N, M)`` in the dtype of ``v``.
    """
    out_dtype = v.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = _lsh_attention(q.to(compute), v.to(compute), rotations.to(compute), chunk_size, causal, key_lengths,
                             window or window_attention_torch)
    return out.to(out_dtype)


def _lsh_attention(q, v, rotations, chunk_size, causal, key_lengths, window):
    b, h, n, d = q.shape
    m = v.shape[-1]
    n_hashes, half_buckets = rotations.shape[1], rotations.shape[2]
    n_buckets = 2 * half_buckets
    pad = (-n) % chunk_size
    valid = torch.ones(b, n + pad, dtype=torch.bool, device=q.device)
    valid[:, n:] = False
    if key_lengths is not None:
        valid[:, :n] = length_mask(key_lengths, n)
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    length = n + pad

    # 1. hash: (B, H, R, L) buckets; padded positions get their own bucket, sorted last
    unit = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    projected = torch.einsum("bhld,drk->bhrlk", unit, rotations)
    buckets = torch.cat([projected, -projected], dim=-1).argmax(dim=-1)
    buckets = buckets.masked_fill(~valid[:, None, None, :], n_buckets)

    # 2. sort by (round, bucket, position): one sort over all rounds
    positions = torch.arange(length, device=q.device)
    rounds = torch.arange(n_hashes, device=q.device)[:, None]
    sort_key = (rounds * (n_buckets + 1) + buckets) * length + positions  # (B, H, R, L)
    order = sort_key.flatten(2).argsort(dim=-1)  # (B, H, R*L), index into (round, position)
    sorted_pos = order % length

    def gather(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, sorted_pos.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

    # 3. chunks, each looking one chunk back (wrapping around, like Reformer); the score scale
    # 1/sqrt(D) is folded into the queries
    n_chunks = n_hashes * length // chunk_size
    sq = gather(q / math.sqrt(d)).reshape(b, h, n_chunks, chunk_size, d)
    sk = gather(unit).reshape(b, h, n_chunks, chunk_size, d)
    sv = gather(v).reshape(b, h, n_chunks, chunk_size, m)
    spos = sorted_pos.reshape(b, h, n_chunks, chunk_size)
    svalid = valid[:, None, :].expand(b, h, length).gather(2, sorted_pos).reshape(b, h, n_chunks, chunk_size)

    # 4. softmax attention within each window, masking the future (causal), padding and the
    # token itself (brought back below for the rows that see nothing else), each key's score
    # lowered by log N_ij (the duplicates; n_hashes > 1)
    chunks = _slot_chunks(order, n_hashes, length, chunk_size) if n_hashes > 1 else None
    out, lse = window(sq, sk, sv, spos, svalid, chunks, causal)  # (B, H, chunks, chunk, M / -)

    # 5. un-sort, then weight the rounds by their normalisers
    out = out.reshape(b, h, n_hashes * length, m)
    lse = lse.reshape(b, h, n_hashes * length)
    inverse = order.argsort(dim=-1)
    unsorted_out = out.gather(2, inverse.unsqueeze(-1).expand(-1, -1, -1, m)).reshape(b, h, n_hashes, length, m)
    unsorted_lse = lse.gather(2, inverse).reshape(b, h, n_hashes, length)
    total = unsorted_lse.logsumexp(dim=2, keepdim=True)
    weights = torch.exp(unsorted_lse - _finite(total)).unsqueeze(-1)  # rounds that saw nothing weigh 0
    result = (unsorted_out * weights).sum(dim=2)
    # A query that sees no other key in any round attends to itself alone (Reformer §2).
    self_only = torch.isinf(total.squeeze(2)) & valid[:, None, :]  # (B, H, L)
    result = torch.where(self_only.unsqueeze(-1), v, result)[:, :, :n]
    if key_lengths is not None:
        # padded query positions saw only masked keys: give them zeros, not an arbitrary mix
        result = result * valid[:, None, :n, None]
    return result


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``-inf`` normalisers (nothing visible) -> 0, so ``exp(-inf - 0)`` is 0, not NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _look_back(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, chunks, chunk, ...)`` -> ``(B, H, chunks, 2 chunk, ...)``: each chunk beside the one before it."""
    return torch.cat([x, x.roll(1, dims=2)], dim=3)


def window_attention_cpp(q, k, v, positions, valid, chunks, causal: bool):
    """:func:`window_attention_torch` through the C++ kernel ``ops/cpu/lsh_window.cpp`` (a window's
    scores stay in cache): CPU tensors of one dtype, float32 or float64."""
    from linformer_lab.ops import cpu  # the build machinery, imported only where the kernel runs

    module = cpu.LSH_WINDOW.load()
    shape = q.shape[:2]
    if chunks is None:  # one round: every pair occurs once
        chunks = torch.zeros(*positions.shape, 0, dtype=torch.int32, device=q.device)
    rows = [x.flatten(0, 1).contiguous() for x in (q, k, v, positions, valid, chunks.to(torch.int32))]
    out, lse = _WindowAttentionCPU.apply(module, causal, *rows)
    return out.unflatten(0, shape), lse.unflatten(0, shape)


def window_attention_torch(q, k, v, positions, valid, chunks, causal: bool):
    """Step 4 in PyTorch operations (any device; autograd gives the gradients): each chunk's
    queries attend to the window of its own and the previous chunk's keys (its own alone when
    there is one chunk).

    Args:
        q, k: ``(B, H, chunks, chunk, D)`` sorted queries (scaled by 1/sqrt(D)) and keys.
        v: ``(B, H, chunks, chunk, M)``.
        positions: int64 ``(B, H, chunks, chunk)``, the sequence position of each slot.
        valid: bool, same shape: False for padding.
        chunks: int ``(B, H, chunks, chunk, n_hashes)`` from :func:`_slot_chunks` (the chunk of
            each slot's position in every round) when n_hashes > 1, else None.
    Returns: ``(out (B, H, chunks, chunk, M), lse (B, H, chunks, chunk))``, the window softmax's
    output and log normaliser; a row with every key masked gets ``lse = -inf`` and zeros.
    """
    n_chunks = q.shape[2]
    if n_chunks > 1:
        k, v, key_positions, key_valid = _look_back(k), _look_back(v), _look_back(positions), _look_back(valid)
    else:
        key_positions, key_valid = positions, valid
    query_positions, key_positions = positions.unsqueeze(-1), key_positions.unsqueeze(-2)
    masked = ~key_valid.unsqueeze(-2) | (key_positions == query_positions)
    if causal:
        masked = masked | (key_positions > query_positions)
    scores = q @ k.transpose(-1, -2)  # (B, H, chunks, chunk, window)
    if chunks is not None:
        scores = scores - _duplicate_counts(chunks.to(torch.int32)).to(scores.dtype).log()
    scores = scores.masked_fill(masked, float("-inf"))
    lse = scores.logsumexp(dim=-1, keepdim=True)  # -inf where the whole window is masked
    out = torch.exp(scores - _finite(lse)) @ v  # masked scores give exp(-inf) = 0
    return out, lse.squeeze(-1)


class _WindowAttentionCPU(torch.autograd.Function):
    """:func:`window_attention_cpp` on ``(G, chunks, chunk, ...)`` rows (G = B H). Saves the window
    probabilities ``(G, chunks, chunk, window)``, so the backward recomputes neither scores nor exponentials."""

    @staticmethod
    def forward(ctx, module, causal, q, k, v, positions, valid, chunks):
        out, lse, probabilities = module.forward(q, k, v, positions, valid, chunks, causal)
        ctx.module = module
        ctx.save_for_backward(q, k, v, probabilities, out)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, probabilities, out = ctx.saved_tensors
        dq, dk, dv = ctx.module.backward(q, k, v, probabilities, out, grad_out.contiguous(), grad_lse.contiguous())
        return None, None, dq, dk, dv, None, None, None


def _slot_chunks(order: torch.Tensor, n_hashes: int, length: int, chunk_size: int) -> torch.Tensor:
    """For every slot of the sorted layout, the chunk in which each round placed that slot's position.

    ``order (B, H, R*L)`` is the layout of step 2. Returns int32 ``(B, H, chunks, chunk, R)``.
    """
    b, h = order.shape[:2]
    # chunk_of[b, h, r, p]: the chunk in which round r placed position p
    slot_chunk = (torch.arange(n_hashes * length, device=order.device) // chunk_size).expand_as(order)
    chunk_of = torch.empty_like(order)
    chunk_of.scatter_(2, order, slot_chunk)  # indexed by round * L + position
    chunk_of = chunk_of.reshape(b, h, n_hashes, length)
    sorted_pos = order % length
    slot_chunks = chunk_of.gather(3, sorted_pos[:, :, None, :].expand(-1, -1, n_hashes, -1)).transpose(2, 3)
    return slot_chunks.to(torch.int32).reshape(b, h, n_hashes * length // chunk_size, chunk_size, n_hashes)


def _duplicate_counts(chunks: torch.Tensor) -> torch.Tensor:
    """N_ij for every (query slot, key slot) pair of the windows: in how many of query i's
    windows (all rounds; a window is a chunk and the one before it) key j stands. For
    n_hashes > 1 (one round never holds a key twice in a window).

    ``chunks``: int32 ``(B, H, chunks, chunk, R)`` from :func:`_slot_chunks`. Returns uint8
    ``(B, H, chunks, chunk, window)``, >= 1 for the pairs that occur (others are masked anyway).
    """
    n_chunks, n_hashes = chunks.shape[2], chunks.shape[4]
    # int32 chunk ids and uint8 counts (at most 3 n_hashes): this runs over as many pairs as
    # the scores, so its memory traffic is kept to an eighth of float arithmetic's
    q_chunks = chunks  # query i's chunk per round
    k_chunks = _look_back(chunks) if n_chunks > 1 else chunks
    counts = torch.zeros(*chunks.shape[:4], k_chunks.shape[3], dtype=torch.uint8, device=chunks.device)
    # every comparison lands in one reused bool buffer, added as the uint8 it already is (no
    # allocation and no conversion pass per comparison)
    hit = torch.empty(counts.shape, dtype=torch.bool, device=chunks.device)

    def count(key_chunks: torch.Tensor, query_chunks: torch.Tensor) -> None:
        torch.eq(key_chunks, query_chunks, out=hit)
        counts.add_(hit.view(torch.uint8))

    # Round r's chunks are a contiguous range of ids, so a key's round-r chunk can only be the
    # query's round-r chunk or the one before it, or (at a round's first chunk, whose window
    # reaches back into the previous round) the previous round's last chunk: 3 comparisons per
    # round instead of 2 per pair of rounds.
    for r in range(n_hashes):
        window = q_chunks[..., r].unsqueeze(-1)  # (B, H, chunks, chunk, 1)
        key_chunk = k_chunks[..., r].unsqueeze(-2)  # (B, H, chunks, 1, keys)
        count(key_chunk, window)
        if n_chunks > 1:
            previous = (window - 1) % n_chunks
            count(key_chunk, previous)
            count(k_chunks[..., (r - 1) % n_hashes].unsqueeze(-2), previous)
    return counts.clamp_min(1)


def lsh_attention_naive(q: torch.Tensor, v: torch.Tensor, rotations: torch.Tensor, chunk_size: int, causal: bool,
                        key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention written one query at a time, for tests and for reading.

    For every query: list the keys of its windows in every round (its chunk and the one before
    it in the rounds' sorted orders laid end to end), keep the distinct visible ones other than
    itself, and take a softmax over that set; if the set is empty the query attends to itself.
    O(N^2 n_hashes) Python-level work: use small inputs (and float64 for a reference).
    Same arguments and result as :func:`lsh_attention`.
    """
    b, h, n, d = q.shape
    n_hashes, n_buckets = rotations.shape[1], 2 * rotations.shape[2]
    length = n + (-n) % chunk_size
    lengths = key_lengths.tolist() if key_lengths is not None else [n] * b
    out = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype, device=q.device)
    for bi in range(b):
        for hi in range(h):
            x = q[bi, hi]
            unit = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            projected = unit @ rotations.to(q.dtype).flatten(1)  # (N, R * n_buckets/2)
            projected = projected.reshape(n, n_hashes, n_buckets // 2)
            buckets = torch.cat([projected, -projected], dim=-1).argmax(dim=-1)  # (N, R)
            # the layout: per round, valid positions by (bucket, position), then the padding
            layout = []
            for r in range(n_hashes):
                bucket_of = [int(buckets[p, r]) if p < lengths[bi] else n_buckets for p in range(n)]
                bucket_of += [n_buckets] * (length - n)
                layout += sorted(range(length), key=lambda p, bucket_of=bucket_of: (bucket_of[p], p))
            n_chunks = len(layout) // chunk_size
            chunks = [layout[c * chunk_size:(c + 1) * chunk_size] for c in range(n_chunks)]
            for i in range(min(n, lengths[bi])):
                seen = set()
                for slot, position in enumerate(layout):
                    if position != i:
                        continue
                    c = slot // chunk_size
                    seen.update(chunks[c])
                    if n_chunks > 1:
                        seen.update(chunks[(c - 1) % n_chunks])
                keys = sorted(j for j in seen if j != i and j < lengths[bi] and not (causal and j > i))
                if not keys:
                    out[bi, hi, i] = v[bi, hi, i]
                    continue
                scores = unit[keys] @ x[i] / math.sqrt(d)
                out[bi, hi, i] = torch.softmax(scores, dim=0) @ v[bi, hi, keys]
    return out
