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
of the same order when n_hashes > 1). Which earlier tokens share a chunk
depends on where *all* tokens hash, later ones included; RNN mode therefore re-runs the
attention over the prefix (the paper's baseline for lsh generation).
"""

from __future__ import annotations

import math

import torch

from linformer_lab.ops.masks import length_mask


def lsh_attention(
    q: torch.Tensor,
    v: torch.Tensor,
    rotations: torch.Tensor,
    chunk_size: int,
    causal: bool,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Args:
        q: ``(B, H, N, D)`` shared queries/keys.
        v: ``(B, H, N, M)``.
        rotations: ``(D, n_hashes, n_buckets // 2)`` random projection for hashing.
        chunk_size: positions per attention chunk.
        key_lengths: ``(B,)``, keys at positions >= length are ignored; query positions past
            the length are padding and return zeros.
    Returns: ``(B, H, N, M)`` in the dtype of ``v``.
    """
    out_dtype = v.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = _lsh_attention(q.to(compute), v.to(compute), rotations.to(compute), chunk_size, causal, key_lengths)
    return out.to(out_dtype)


def _lsh_attention(q, v, rotations, chunk_size, causal, key_lengths):
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

    # 3. chunks, each looking one chunk back (wrapping around, like Reformer)
    n_chunks = n_hashes * length // chunk_size
    sq = gather(q).reshape(b, h, n_chunks, chunk_size, d)
    sk = gather(unit).reshape(b, h, n_chunks, chunk_size, d)
    sv = gather(v).reshape(b, h, n_chunks, chunk_size, m)
    spos = sorted_pos.reshape(b, h, n_chunks, chunk_size)
    svalid = valid[:, None, :].expand(b, h, length).gather(2, sorted_pos).reshape(b, h, n_chunks, chunk_size)
    if n_chunks > 1:
        def look_back(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.roll(1, dims=2)], dim=3)

        sk, sv, kpos, kvalid = look_back(sk), look_back(sv), look_back(spos), look_back(svalid)
    else:
        kpos, kvalid = spos, svalid

    # 4. scores with masks: (B, H, chunks, chunk, keys); the token itself is masked here and
    # brought back below for the rows that see nothing else
    scores = sq @ sk.transpose(-1, -2) / math.sqrt(d)
    qpos = spos.unsqueeze(-1)
    kpos = kpos.unsqueeze(-2)
    masked = ~kvalid.unsqueeze(-2) | (kpos == qpos)
    if causal:
        masked = masked | (kpos > qpos)
    if n_hashes > 1:
        scores = scores - _duplicate_counts(order, n_hashes, length, chunk_size, b, h, scores.dtype).log()
    scores = scores.masked_fill(masked, float("-inf"))
    lse = scores.logsumexp(dim=-1, keepdim=True)  # -inf where the whole window is masked
    out = torch.exp(scores - _finite(lse)) @ sv  # masked scores give exp(-inf) = 0

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


def _duplicate_counts(order, n_hashes, length, chunk_size, b, h, dtype) -> torch.Tensor:
    """N_ij for every (query slot, key slot) pair of the chunked layout: in how many of query
    i's windows (all rounds; a window is a chunk and the one before it) key j stands.
    Called for n_hashes > 1 only (one round never holds a key twice in a window).

    ``order (B, H, R*L)`` is the sorted layout of step 2. Returns ``(B, H, chunks, chunk, 2 chunk)``
    float counts >= 1 for the pairs that occur (others are masked anyway).
    """
    n_chunks = n_hashes * length // chunk_size
    # chunk_of[b, h, r, p]: the chunk in which round r placed position p
    slot_chunk = (torch.arange(n_hashes * length, device=order.device) // chunk_size).expand_as(order)
    chunk_of = torch.empty_like(order)
    chunk_of.scatter_(2, order, slot_chunk)  # indexed by round * L + position
    chunk_of = chunk_of.reshape(b, h, n_hashes, length)
    sorted_pos = order % length
    # per slot of the layout: the chunks of that position in every round, (B, H, R*L, R)
    slot_chunks = chunk_of.gather(3, sorted_pos[:, :, None, :].expand(-1, -1, n_hashes, -1)).transpose(2, 3)
    # int32 chunk ids and uint8 counts (at most 3 n_hashes): this runs over as many pairs as
    # the scores, so its memory traffic is kept to an eighth of float arithmetic's
    q_chunks = slot_chunks.to(torch.int32).reshape(b, h, n_chunks, chunk_size, n_hashes)  # query i's chunk per round
    k_chunks = q_chunks
    if n_chunks > 1:
        k_chunks = torch.cat([k_chunks, k_chunks.roll(1, dims=2)], dim=3)
    counts = torch.zeros(b, h, n_chunks, chunk_size, k_chunks.shape[3], dtype=torch.uint8, device=order.device)
    # each comparison lands in one bool buffer, added as the uint8 it already is: `counts += a == b`
    # allocated the bools and converted them in a second pass (lsh-4 fwd + bwd of one layer at the
    # copy task's 64 x 8 x 256 x 8, one thread: 2.31 s with it, 2.00 s without)
    hit = torch.empty(counts.shape, dtype=torch.bool, device=order.device)

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
    return counts.clamp_min(1).to(dtype)


def lsh_attention_naive(
    q: torch.Tensor,
    v: torch.Tensor,
    rotations: torch.Tensor,
    chunk_size: int,
    causal: bool,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
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
