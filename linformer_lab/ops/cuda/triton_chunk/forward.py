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

The kernels are plain Python: ``launch.py`` compiles them with ``triton.jit`` when first used;
the helpers they call (``elu_plus_one``; ``chunk_program`` and ``walk_program``, the preambles
that unfold a program's index, the one of every kernel parallel over chunks and the one of the two
state walks) are jitted here, in the mode of the import (``TRITON_INTERPRET`` must be set before triton is imported anyway).

Addressing: every grid is one-dimensional (CUDA caps its y and z at 65,535; x holds 2^31 - 1
programs), each program unfolding its index into (tile, chunk, sequence x head). Every tensor
comes with its four strides (batch, head, position, feature), so views are read and written in
place; each program adds a 64-bit offset of its first position (T H D passes 2^31 in a long
(B, T, H, D) tensor) to 32-bit offsets within its chunk.

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
import triton
import triton.language as tl


@triton.jit
def elu_plus_one(x, mask, tiny, DT: tl.constexpr):
    """phi = elu + 1 in fp32, rounded to DT: x + 1 for x > 0, exp(x) otherwise (no cancellation
    of (exp(x) - 1) + 1), at least ``tiny`` so that half-precision phi stays > 0; 0 off the mask."""
    x = x.to(tl.float32)
    return tl.where(mask, tl.maximum(tl.where(x > 0, x + 1.0, tl.exp(x)), tiny), 0.0).to(DT)


@triton.jit
def chunk_program(pid, TILES, CU, CHUNK_OFF, CHUNK_TABLE, T, H, NT, BT: tl.constexpr, VARLEN: tl.constexpr):
    """The preamble of the kernels parallel over chunks: a program's index ``pid`` over (tile, chunk,
    sequence x head), TILES tiles per chunk and NT chunks per row, unfolded -> (tile, b, h, start,
    g, tt, tmask): the tile, batch row, head, first position of the chunk, its state row (global
    chunk x H + h), the chunk's offsets 0..BT-1 and which of them lie inside the sequence.
    VARLEN: the rows are the heads and CHUNK_TABLE ``(NT, 2)`` maps the global chunk to
    (sequence, chunk in it); NT is an upper bound, chunks past a sequence's end are masked."""
    tile = pid % TILES
    rest = pid // TILES
    i_t = rest % NT
    i_sh = rest // NT
    if VARLEN:
        s = tl.load(CHUNK_TABLE + 2 * i_t)
        c = tl.load(CHUNK_TABLE + 2 * i_t + 1)
        h = i_sh
        bos = tl.load(CU + s).to(tl.int32)
        length = tl.load(CU + s + 1).to(tl.int32) - bos
        b = i_sh * 0  # a tensor like the other branch's, so .to() applies
        g = (tl.load(CHUNK_OFF + s) + c) * H + h
    else:
        s = i_sh // H
        h = i_sh % H
        c = i_t
        bos = i_sh * 0
        length = T
        b = s
        g = (s * NT + c) * H + h
    tt = tl.arange(0, BT)
    tmask = c * BT + tt < length
    return tile, b, h, bos + c * BT, g, tt, tmask


@triton.jit
def walk_program(pid, CU, CHUNK_OFF, T, H, C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, VARLEN: tl.constexpr):
    """The preamble of the state walks: a program's index ``pid`` over (value tile, feature tile,
    sequence x head) unfolded -> (i_v, b, h, bos, length, g0, row, ck, cv, kmask, vmask, tt,
    state_offs, state_mask): the value tile, batch row, head, first position and length of the
    sequence, its first global chunk, its row of the initial and final states (sequence x H +
    head), the tile's feature and value indices and masks, the offsets 0..BT-1 within a chunk, and
    the tile's offsets and mask within one ``(C, M)`` state."""
    i_v = pid % tl.cdiv(M, BV)
    i_k = (pid // tl.cdiv(M, BV)) % tl.cdiv(C, BK)
    i_sh = pid // (tl.cdiv(M, BV) * tl.cdiv(C, BK))
    s = i_sh // H
    h = i_sh % H
    if VARLEN:
        bos = tl.load(CU + s).to(tl.int32)
        length = tl.load(CU + s + 1).to(tl.int32) - bos
        b = i_sh * 0
        g0 = tl.load(CHUNK_OFF + s)
    else:
        bos = i_sh * 0
        length = T
        b = s
        g0 = s * tl.cdiv(T, BT)
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    kmask = ck < C
    vmask = cv < M
    state_offs = ck[:, None] * M + cv[None, :]
    state_mask = kmask[:, None] & vmask[None, :]
    return (i_v, b, h, bos, length, g0, i_sh.to(tl.int64), ck, cv, kmask, vmask, tl.arange(0, BT), state_offs,
            state_mask)


@triton.jit
def base_offset(b, h, position, sb, sh, st):
    """64-bit offset of (batch row b, head h, position)."""
    return b.to(tl.int64) * sb + h.to(tl.int64) * sh + position.to(tl.int64) * st


def chunk_states_forward(
    K, V, S0, Z0, STATES, ZSTATES, SN, ZN, CU, CHUNK_OFF,
    T, H, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, HAS_INIT: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    INTERPRET: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) cdiv(C, BK) sequences H,)``. STATES ``(chunks, H, C, M)``, ZSTATES
    ``(chunks, H, C)``, SN/ZN and S0/Z0 ``(sequences, H, C, M / -)``, all fp32. MAX_CHUNKS
    (interpreter only): a bound on any sequence's chunks."""
    i_v, b, h, bos, length, g0, row, ck, cv, kmask, vmask, tt, state_offs, state_mask = walk_program(
        tl.program_id(0), CU, CHUNK_OFF, T, H, C, M, BT, BK, BV, VARLEN)
    DT = K.dtype.element_ty
    if HAS_INIT:
        acc = tl.load(S0 + row * (C * M) + state_offs, mask=state_mask, other=0.0).to(tl.float32)
        z = tl.load(Z0 + row * C + ck, mask=kmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)
    k_tile = tt[:, None] * sk_t + ck[None, :] * sk_d
    v_tile = tt[:, None] * sv_t + cv[None, :] * sv_d
    n_chunks = tl.cdiv(length, BT)
    # numpy 2 refuses range() over the interpreter's scalars (and the interpreter makes every
    # assigned value one): there the bound is a constant and the chunks past the end are masked
    for c in range(0, MAX_CHUNKS if INTERPRET else n_chunks):
        live = c < n_chunks
        g = (g0 + c) * H + h
        tl.store(STATES + g.to(tl.int64) * (C * M) + state_offs, acc, mask=state_mask & live)
        if i_v == 0:
            tl.store(ZSTATES + g.to(tl.int64) * C + ck, z, mask=kmask & live)
        tmask = (c * BT + tt < length) & live
        x = tl.load(K + base_offset(b, h, bos + c * BT, sk_b, sk_h, sk_t) + k_tile,
                    mask=tmask[:, None] & kmask[None, :], other=0.0)
        if ELU:
            x = elu_plus_one(x, tmask[:, None] & kmask[None, :], tiny, DT)
        vt = tl.load(V + base_offset(b, h, bos + c * BT, sv_b, sv_h, sv_t) + v_tile,
                     mask=tmask[:, None] & vmask[None, :], other=0.0)
        acc += tl.dot(tl.trans(x), vt, input_precision=PREC)
        z += tl.sum(x.to(tl.float32), axis=0)
    tl.store(SN + row * (C * M) + state_offs, acc, mask=state_mask)
    if i_v == 0:
        tl.store(ZN + row * C + ck, z, mask=kmask)


def chunk_output_forward(
    Q, K, V, O, DEN, STATES, ZSTATES, CU, CHUNK_OFF, CHUNK_TABLE,
    T, H, NT, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    so_b, so_h, so_t, so_d, tiny, eps,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) NT rows,)``: value tile, chunk (NT per row), row (sequence x head,
    or with VARLEN the head; see ``chunk_program``). O like V; DEN ``(B, H, T)`` fp32: the
    denominator q_i^T z_i + eps of every position."""
    i_v, b, h, start, g, tt, tmask = chunk_program(tl.program_id(0), tl.cdiv(M, BV), CU, CHUNK_OFF, CHUNK_TABLE,
                                                  T, H, NT, BT, VARLEN)
    DT = Q.dtype.element_ty
    cv = i_v * BV + tl.arange(0, BV)
    vmask = cv < M
    q_base = Q + base_offset(b, h, start, sq_b, sq_h, sq_t)
    k_base = K + base_offset(b, h, start, sk_b, sk_h, sk_t)
    num = tl.zeros([BT, BV], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    qz = tl.zeros([BT], dtype=tl.float32)
    for kk in tl.static_range(0, C, BK):
        ck = kk + tl.arange(0, BK)
        kmask = ck < C
        mask = tmask[:, None] & kmask[None, :]
        q = tl.load(q_base + tt[:, None] * sq_t + ck[None, :] * sq_d, mask=mask, other=0.0)
        k = tl.load(k_base + tt[:, None] * sk_t + ck[None, :] * sk_d, mask=mask, other=0.0)
        if ELU:
            q = elu_plus_one(q, mask, tiny, DT)
            k = elu_plus_one(k, mask, tiny, DT)
        state = tl.load(STATES + g.to(tl.int64) * (C * M) + ck[:, None] * M + cv[None, :],
                        mask=kmask[:, None] & vmask[None, :], other=0.0)
        zc = tl.load(ZSTATES + g.to(tl.int64) * C + ck, mask=kmask, other=0.0)
        num += tl.dot(q.to(tl.float32), state, input_precision=PREC)
        scores += tl.dot(q, tl.trans(k), input_precision=PREC)
        qz += tl.sum(q.to(tl.float32) * zc[None, :], axis=1)
    scores = tl.where(tt[:, None] >= tt[None, :], scores, 0.0)
    den = qz + tl.sum(scores, axis=1) + eps
    vmask2 = tmask[:, None] & vmask[None, :]
    vt = tl.load(V + base_offset(b, h, start, sv_b, sv_h, sv_t) + tt[:, None] * sv_t + cv[None, :] * sv_d,
                 mask=vmask2, other=0.0)
    num += tl.dot(scores, vt.to(tl.float32), input_precision=PREC)
    out = num / den[:, None]
    tl.store(O + base_offset(b, h, start, so_b, so_h, so_t) + tt[:, None] * so_t + cv[None, :] * so_d,
             out.to(O.dtype.element_ty), mask=vmask2)
    if i_v == 0:
        tl.store(DEN + (b * H + h).to(tl.int64) * T + start + tt, den, mask=tmask)
