"""Reformer's LSH attention (Kitaev et al. 2020), the paper's ``lsh-X`` baseline.

Shared-QK attention: keys are the unit-normalised queries. Every round of hashing
(``n_hashes`` in total) does:

1. hash each position with a random rotation: bucket = argmax([x R, -x R]), R ``(D, n_buckets/2)``;
2. sort positions by (bucket, position);
3. cut the sorted order into chunks of ``chunk_size``; every chunk attends to itself and to
   the chunk before it (so a bucket split by a chunk border still sees itself);
4. mask the future (causal), padding, and the token itself: a token attends to itself only
   when nothing else is visible, because q . q/|q| would dominate every other score;
5. un-sort. Rounds are combined by their softmax normalisers (log-sum-exp), which is
   exact if all rounds see the same keys.

Cost O(N n_hashes chunk_size D) time and memory. Note: which earlier tokens share a chunk
depends on where *all* tokens hash, later ones included; RNN mode therefore re-runs the
attention over the prefix (the paper's baseline for lsh generation).
"""

from __future__ import annotations

import math

import torch

# Masked scores: finite (not -inf) so fully-masked rows of padding stay NaN-free.
_MASKED = -1e9
# Self-attention score: below any real score, above _MASKED, so self wins only when alone.
_SELF = -1e5


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
        key_lengths: ``(B,)``, keys at positions >= length are ignored.
    Returns: ``(B, H, N, M)``.
    """
    b, h, n, d = q.shape
    m = v.shape[-1]
    n_hashes, half_buckets = rotations.shape[1], rotations.shape[2]
    n_buckets = 2 * half_buckets
    pad = (-n) % chunk_size
    valid = torch.ones(b, n + pad, dtype=torch.bool, device=q.device)
    valid[:, n:] = False
    if key_lengths is not None:
        valid[:, :n] = torch.arange(n, device=q.device) < key_lengths[:, None]
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    length = n + pad

    # 1. hash: (B, H, R, L) buckets; padded positions get their own bucket, sorted last
    unit = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    projected = torch.einsum("bhld,drk->bhrlk", unit, rotations.to(q.dtype))
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

    # 4. scores with masks: (B, H, chunks, chunk, keys)
    scores = sq @ sk.transpose(-1, -2) / math.sqrt(d)
    qpos = spos.unsqueeze(-1)
    kpos = kpos.unsqueeze(-2)
    masked = ~kvalid.unsqueeze(-2)
    if causal:
        masked = masked | (kpos > qpos)
    scores = scores.masked_fill(masked, _MASKED)
    scores = scores.masked_fill(kpos == qpos, _SELF)
    lse = scores.logsumexp(dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ sv  # (B, H, chunks, chunk, M)

    # 5. un-sort, then weight the rounds by their normalisers
    out = out.reshape(b, h, n_hashes * length, m)
    lse = lse.reshape(b, h, n_hashes * length)
    inverse = order.argsort(dim=-1)
    unsorted_out = out.gather(2, inverse.unsqueeze(-1).expand(-1, -1, -1, m)).reshape(b, h, n_hashes, length, m)
    unsorted_lse = lse.gather(2, inverse)
    weights = torch.softmax(unsorted_lse.reshape(b, h, n_hashes, length), dim=2).unsqueeze(-1)
    result = (unsorted_out * weights).sum(dim=2)[:, :, :n]
    if key_lengths is not None:
        # padded query positions saw only masked keys: give them zeros, not an arbitrary mix
        result = result * valid[:, None, :n, None]
    return result
