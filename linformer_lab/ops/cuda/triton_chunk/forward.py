"""Forward Triton kernels of chunk-parallel causal linear attention (eq. 9-12).

Split the sequence into chunks of BT positions. With S_c, z_c the state of eq. 10-11 before
chunk c (the initial state S_0, z_0 plus every earlier chunk), a query i of chunk c reads

    out_i = (q_i^T S_c + sum_{j in c, j <= i} (q_i . k_j) v_j) / (q_i^T z_c + sum_{j in c, j <= i} q_i . k_j + eps)

where q, k are the feature-mapped queries and keys (phi = elu + 1 applied as they are loaded,
or the inputs as given). Two kernels:

* ``chunk_states_forward``: one program per (value tile, feature tile, sequence x head) walks
  the chunks in order, writes S_c, z_c before each chunk and S_N, z_N after the last. Its loop
  carries only the running state in registers; the loads of the next chunk overlap the product
  of this one (software pipelining).
* ``chunk_output_forward``: one program per (value tile, chunk, sequence x head): the masked
  intra-chunk scores, q^T S_c, and the normaliser from the same scores (their row sums) and
  q . z_c. It also stores the denominator per position for the backward pass.

The functions here are plain Python: ``launch.py`` compiles them with ``triton.jit`` when first
used, so that ``TRITON_INTERPRET=1`` set at any time before the first call runs them on a CPU.

Dtypes: ``DT`` is the input dtype; a product of two loaded tiles runs in it (exact products,
fp32 accumulation). The states are fp32, and a product with an fp32 operand (a state, the
scores) runs at ``PREC``: for half inputs three tf32 products (``tf32x3``), as exact as fp32,
because one tf32 product would truncate the fp32 operand to 10 bits and the backward's
cancelling terms (``backward.py``) need the states' full accuracy. Sequences are
addressed by (batch b, first position bos, length L): one per batch row, or one per entry of
``cu_seqlens`` in a packed (1, H, T, .) tensor (VARLEN). State rows are indexed by the global
chunk number g (chunks of all sequences back to back) and the head.
"""

# no ``from __future__ import annotations``: Triton's interpreter reads ``tl.constexpr`` from
# the annotations as objects, not strings
import triton.language as tl


def chunk_states_forward(
    K, V, S0, Z0, STATES, ZSTATES, SN, ZN, CU, CHUNK_OFF,
    T, H, sb_k, sh_k, st_k, sb_v, sh_v, st_v, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, HAS_INIT: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    INTERPRET: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):
    """Grid ``(cdiv(M, BV), cdiv(C, BK), sequences * H)``. STATES ``(chunks, H, C, M)`` in the
    state dtype, ZSTATES ``(chunks, H, C)`` fp32, SN/ZN and S0/Z0 ``(sequences, H, C, M / -)`` fp32.
    MAX_CHUNKS (interpreter only): the most chunks of any sequence."""
    i_v = tl.program_id(0)
    i_k = tl.program_id(1)
    i_sh = tl.program_id(2)
    s = i_sh // H
    h = i_sh % H
    if VARLEN:
        bos = tl.load(CU + s).to(tl.int32)
        length = tl.load(CU + s + 1).to(tl.int32) - bos
        b = i_sh * 0  # a tensor like the other branch's, so .to() applies
        g0 = tl.load(CHUNK_OFF + s).to(tl.int32)
    else:
        bos = i_sh * 0
        length = T
        b = s
        g0 = s * tl.cdiv(T, BT)
    DT = K.dtype.element_ty
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    kmask = ck < C
    vmask = cv < M
    tt = tl.arange(0, BT)
    state_offs = ck[:, None] * M + cv[None, :]
    state_mask = kmask[:, None] & vmask[None, :]
    row = s * H + h
    if HAS_INIT:
        acc = tl.load(S0 + row.to(tl.int64) * (C * M) + state_offs, mask=state_mask, other=0.0).to(tl.float32)
        z = tl.load(Z0 + row.to(tl.int64) * C + ck, mask=kmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)
    k_base = K + b.to(tl.int64) * sb_k + h.to(tl.int64) * sh_k + bos.to(tl.int64) * st_k
    v_base = V + b.to(tl.int64) * sb_v + h.to(tl.int64) * sh_v + bos.to(tl.int64) * st_v
    n_chunks = tl.cdiv(length, BT)
    # numpy 2 refuses range() over the interpreter's scalars (and the interpreter makes every
    # assigned value one): there the bound is a constant and the chunks past the end are masked
    for c in range(0, MAX_CHUNKS if INTERPRET else n_chunks):
        live = c < n_chunks
        g = (g0 + c) * H + h
        tl.store(STATES + g.to(tl.int64) * (C * M) + state_offs, acc, mask=state_mask & live)
        if i_v == 0:
            tl.store(ZSTATES + g.to(tl.int64) * C + ck, z, mask=kmask & live)
        t = c * BT + tt
        tmask = (t < length) & live
        x = tl.load(k_base + t[:, None] * st_k + ck[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        if ELU:
            x = x.to(tl.float32)
            # x + 1 for x > 0, exp(x) otherwise: elu + 1 without the cancellation of (exp(x) - 1) + 1;
            # clamped at the dtype's smallest normal so that half-precision phi stays > 0
            x = tl.maximum(tl.where(x > 0, x + 1.0, tl.exp(x)), tiny)
            x = tl.where(tmask[:, None] & kmask[None, :], x, 0.0).to(DT)
        vt = tl.load(v_base + t[:, None] * st_v + cv[None, :], mask=tmask[:, None] & vmask[None, :], other=0.0)
        acc += tl.dot(tl.trans(x), vt, input_precision=PREC)
        z += tl.sum(x.to(tl.float32), axis=0)
    tl.store(SN + row.to(tl.int64) * (C * M) + state_offs, acc, mask=state_mask)
    if i_v == 0:
        tl.store(ZN + row.to(tl.int64) * C + ck, z, mask=kmask)


def chunk_output_forward(
    Q, K, V, O, DEN, STATES, ZSTATES, CU, CHUNK_OFF, CHUNK_TABLE,
    T, H, sb_k, sh_k, st_k, sb_v, sh_v, st_v, tiny, eps,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(cdiv(M, BV), chunks, sequences * H)`` (VARLEN: ``(cdiv(M, BV), all chunks, H)``
    with CHUNK_TABLE ``(all chunks, 2)`` = (sequence, chunk within it)). O like V; DEN
    ``(B, H, T)`` fp32: the denominator q_i^T z_i + eps of every position."""
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_sh = tl.program_id(2)
    if VARLEN:
        s = tl.load(CHUNK_TABLE + 2 * i_t).to(tl.int32)
        c = tl.load(CHUNK_TABLE + 2 * i_t + 1).to(tl.int32)
        h = i_sh
        bos = tl.load(CU + s).to(tl.int32)
        length = tl.load(CU + s + 1).to(tl.int32) - bos
        b = i_sh * 0  # a tensor like the other branch's, so .to() applies
        g = (tl.load(CHUNK_OFF + s).to(tl.int32) + c) * H + h
    else:
        s = i_sh // H
        h = i_sh % H
        c = i_t
        bos = i_sh * 0
        length = T
        b = s
        g = (s * tl.cdiv(T, BT) + c) * H + h
    DT = Q.dtype.element_ty
    tt = tl.arange(0, BT)
    t = c * BT + tt
    tmask = t < length
    cv = i_v * BV + tl.arange(0, BV)
    vmask = cv < M
    k_off = b.to(tl.int64) * sb_k + h.to(tl.int64) * sh_k + bos.to(tl.int64) * st_k
    v_off = b.to(tl.int64) * sb_v + h.to(tl.int64) * sh_v + bos.to(tl.int64) * st_v
    num = tl.zeros([BT, BV], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    qz = tl.zeros([BT], dtype=tl.float32)
    for kk in tl.static_range(0, C, BK):
        ck = kk + tl.arange(0, BK)
        kmask = ck < C
        mask = tmask[:, None] & kmask[None, :]
        offs = k_off + t[:, None] * st_k + ck[None, :]
        q = tl.load(Q + offs, mask=mask, other=0.0)
        k = tl.load(K + offs, mask=mask, other=0.0)
        if ELU:
            q = q.to(tl.float32)
            q = tl.where(mask, tl.maximum(tl.where(q > 0, q + 1.0, tl.exp(q)), tiny), 0.0).to(DT)
            k = k.to(tl.float32)
            k = tl.where(mask, tl.maximum(tl.where(k > 0, k + 1.0, tl.exp(k)), tiny), 0.0).to(DT)
        state = tl.load(STATES + g.to(tl.int64) * (C * M) + ck[:, None] * M + cv[None, :],
                        mask=kmask[:, None] & vmask[None, :], other=0.0)
        zc = tl.load(ZSTATES + g.to(tl.int64) * C + ck, mask=kmask, other=0.0)
        num += tl.dot(q.to(tl.float32), state, input_precision=PREC)
        scores += tl.dot(q, tl.trans(k), input_precision=PREC)
        qz += tl.sum(q.to(tl.float32) * zc[None, :], axis=1)
    scores = tl.where(tt[:, None] >= tt[None, :], scores, 0.0)
    den = qz + tl.sum(scores, axis=1) + eps
    vt = tl.load(V + v_off + t[:, None] * st_v + cv[None, :], mask=tmask[:, None] & vmask[None, :], other=0.0)
    num += tl.dot(scores.to(tl.float32), vt.to(tl.float32), input_precision=PREC)
    out = num / den[:, None]
    tl.store(O + v_off + t[:, None] * st_v + cv[None, :], out.to(O.dtype.element_ty), mask=tmask[:, None] & vmask[None, :])
    if i_v == 0:
        tl.store(DEN + (b * H + h).to(tl.int64) * T + bos + t, den, mask=tmask)
