"""Backward Triton kernels of chunk-parallel causal linear attention.

With out_i = n_i / d_i (numerator n_i = q_i^T S_i, denominator d_i = q_i^T z_i + eps) and the
incoming gradient o_i = dL/d out_i, the gradients of the numerator and of the denominator are

    g_i = o_i / d_i        (M numbers)        r_i = -(o_i . out_i) / d_i        (one number),

and the denominator is a numerator whose value is the constant 1, so eq. 13-15 give, with the
forward states S_c, z_c before chunk c and the suffix states after it,
dH_c = dS_N + sum_{i after c} q_i g_i^T and dh_c = dz_N + sum_{i after c} r_i q_i:

    dq_i = sum_{j in c, j <= i} B_ij k_j + S_c g_i + r_i z_c,          B_ij = g_i . v_j + r_i,
    dk_j = sum_{i in c, i >= j} B_ij q_i + dH_c v_j + dh_c,
    dv_j = sum_{i in c, i >= j} (q_i . k_j) g_i + dH_c^T k_j,
    dS_0 = dH_{-1},  dz_0 = dh_{-1}   (the suffix states before the first chunk),

then through phi = elu + 1: dx = dphi * min(phi, 1). g is never rounded to the input dtype: the
products use o and divide by d afterwards (in fp16, o / d underflows on long sequences).

Half precision: when v has a nonzero mean, S_c g_i and r_i z_c nearly cancel in dq (S_c ~ z_c
vbar^T, out_i ~ vbar), and so do dH_c v_j and dh_c in dk; the difference is what remains of
numbers as large as the terms, so every factor of those terms keeps fp32's accuracy: r from the
fp32 numerator recomputed (never from the output rounded to the input dtype), the states and
their gradients stored in fp32, and every product with an fp32 operand in three tf32 products
(``tf32x3``: one would truncate the operand to tf32's 10 bits). Products of two input tiles are
exact in any precision.

Kernels: ``chunk_numerator_backward`` (r; fp32 inputs: ``backward_prepare`` from the output),
``chunk_states_backward`` (dH_c, dh_c, dS_0, dz_0; the
forward states are recomputed by ``chunk_states_forward``, never saved),
``chunk_dq_dk_backward`` and ``chunk_dv_backward``, parallel over chunks. Layout, dtypes and
sequence addressing (one-dimensional grids, strided tensors, 64-bit offsets of each program's
first position) as in ``forward.py``.
"""

# no ``from __future__ import annotations``: Triton's interpreter reads ``tl.constexpr`` from
# the annotations as objects, not strings
import triton.language as tl

from linformer_lab.ops.cuda.triton_chunk.forward import base_offset, chunk_program, elu_plus_one, walk_program


def backward_prepare(
    DO, O, DEN, R, T, H, sd_b, sd_h, sd_t, sd_d, so_b, so_h, so_t, so_d,
    M: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
):
    """Grid ``(cdiv(T, BT) B H,)``: R ``(B, H, T)`` fp32 = -(do_i . out_i) / d_i from the stored
    output: for fp32 inputs only (a half-precision output would lose r to rounding; see
    ``chunk_numerator_backward``). Position-wise, so packed sequences need no table."""
    pid = tl.program_id(0)
    i_t = pid % tl.cdiv(T, BT)
    i_bh = pid // tl.cdiv(T, BT)
    b = i_bh // H
    h = i_bh % H
    tt = tl.arange(0, BT)
    tmask = i_t * BT + tt < T
    do_base = DO + base_offset(b, h, i_t * BT, sd_b, sd_h, sd_t)
    o_base = O + base_offset(b, h, i_t * BT, so_b, so_h, so_t)
    dot = tl.zeros([BT], dtype=tl.float32)
    for vv in tl.static_range(0, M, BV):
        cv = vv + tl.arange(0, BV)
        mask = tmask[:, None] & (cv < M)[None, :]
        do = tl.load(do_base + tt[:, None] * sd_t + cv[None, :] * sd_d, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(o_base + tt[:, None] * so_t + cv[None, :] * so_d, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(do * o, axis=1)
    pos = i_bh.to(tl.int64) * T + i_t * BT + tt
    den = tl.load(DEN + pos, mask=tmask, other=1.0)
    tl.store(R + pos, -dot / den, mask=tmask)


def chunk_numerator_backward(
    Q, K, V, DO, DEN, R, STATES, CU, CHUNK_OFF, CHUNK_TABLE,
    T, H, NT, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sd_b, sd_h, sd_t, sd_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(NT rows,)`` (chunks as ``chunk_output_forward``): R ``(B, H, T)`` fp32 =
    -(do_i . n_i) / d_i^2 with the numerator n_i = q_i^T S_c + sum_j (q_i . k_j) v_j, as
    do_i . n_i = q_i . (S_c do_i) + sum_j (q_i . k_j) (do_i . v_j): the only product with an fp32
    operand is S_c do_i, the others multiply input tiles. For half inputs: dq and dk add r_i z to
    terms it nearly cancels when v has a nonzero mean (S_c o_i ~ z_c (o_i . out_i)), so r must
    carry fp32's accuracy, which an output rounded to 8 or 11 bits does not."""
    _, b, h, start, g, tt, tmask = chunk_program(tl.program_id(0), 1, CU, CHUNK_OFF, CHUNK_TABLE, T, H, NT, BT, VARLEN)
    DT = Q.dtype.element_ty
    q_base = Q + base_offset(b, h, start, sq_b, sq_h, sq_t)
    k_base = K + base_offset(b, h, start, sk_b, sk_h, sk_t)
    v_base = V + base_offset(b, h, start, sv_b, sv_h, sv_t)
    do_base = DO + base_offset(b, h, start, sd_b, sd_h, sd_t)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for kk in tl.static_range(0, C, BK):
        ck = kk + tl.arange(0, BK)
        mask = tmask[:, None] & (ck < C)[None, :]
        q = tl.load(q_base + tt[:, None] * sq_t + ck[None, :] * sq_d, mask=mask, other=0.0)
        k = tl.load(k_base + tt[:, None] * sk_t + ck[None, :] * sk_d, mask=mask, other=0.0)
        if ELU:
            q = elu_plus_one(q, mask, tiny, DT)
            k = elu_plus_one(k, mask, tiny, DT)
        scores += tl.dot(q, tl.trans(k), input_precision=PREC)
    do_v = tl.zeros([BT, BT], dtype=tl.float32)
    dot = tl.zeros([BT], dtype=tl.float32)
    # value tiles outside: each do tile's fp32 split lives for one iteration (outside, the
    # compiler keeps every tile's split at once and spills)
    for vv in tl.static_range(0, M, BV):
        cv = vv + tl.arange(0, BV)
        vmask = cv < M
        do = tl.load(do_base + tt[:, None] * sd_t + cv[None, :] * sd_d, mask=tmask[:, None] & vmask[None, :], other=0.0)
        vt = tl.load(v_base + tt[:, None] * sv_t + cv[None, :] * sv_d, mask=tmask[:, None] & vmask[None, :], other=0.0)
        do_v += tl.dot(do, tl.trans(vt), input_precision=PREC)
        for kk in tl.static_range(0, C, BK):
            ck = kk + tl.arange(0, BK)
            kmask = ck < C
            mask = tmask[:, None] & kmask[None, :]
            q = tl.load(q_base + tt[:, None] * sq_t + ck[None, :] * sq_d, mask=mask, other=0.0)
            if ELU:
                q = elu_plus_one(q, mask, tiny, DT)
            state = tl.load(STATES + g.to(tl.int64) * (C * M) + ck[:, None] * M + cv[None, :],
                            mask=kmask[:, None] & vmask[None, :], other=0.0)
            state_do = tl.dot(do.to(tl.float32), tl.trans(state), input_precision=PREC)  # (S_c do_i) on the tile
            dot += tl.sum(q.to(tl.float32) * state_do, axis=1)
    dot += tl.sum(tl.where(tt[:, None] >= tt[None, :], scores * do_v, 0.0), axis=1)
    pos = (b * H + h).to(tl.int64) * T + start + tt
    den = tl.load(DEN + pos, mask=tmask, other=1.0)
    tl.store(R + pos, -dot / (den * den), mask=tmask)


def chunk_states_backward(
    Q, DO, DEN, R, DSN, DZN, DSTATES, DZSTATES, DS0, DZ0, CU, CHUNK_OFF,
    T, H, sq_b, sq_h, sq_t, sq_d, sd_b, sd_h, sd_t, sd_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, HAS_DFINAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    INTERPRET: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) cdiv(C, BK) sequences H,)``: walks the chunks last to first and
    writes dH_c, dh_c after each (DSTATES, DZSTATES like the forward STATES, ZSTATES), then
    dS_0, dz_0 (DS0, DZ0), all fp32."""
    i_v, b, h, bos, length, g0, row, ck, cv, kmask, vmask, tt, state_offs, state_mask = walk_program(
        tl.program_id(0), CU, CHUNK_OFF, T, H, C, M, BT, BK, BV, VARLEN)
    DT = Q.dtype.element_ty
    if HAS_DFINAL:
        acc = tl.load(DSN + row * (C * M) + state_offs, mask=state_mask, other=0.0).to(tl.float32)
        dz = tl.load(DZN + row * C + ck, mask=kmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        dz = tl.zeros([BK], dtype=tl.float32)
    q_tile = tt[:, None] * sq_t + ck[None, :] * sq_d
    do_tile = tt[:, None] * sd_t + cv[None, :] * sd_d
    pos_base = (b * H + h).to(tl.int64) * T + bos
    n_chunks = tl.cdiv(length, BT)
    # numpy 2 refuses range() over the interpreter's scalars (and the interpreter makes every
    # assigned value one): there the bound is a constant and the chunks past the end are masked
    for i in range(0, MAX_CHUNKS if INTERPRET else n_chunks):
        c = n_chunks - 1 - i
        live = c >= 0
        g = (g0 + c) * H + h
        tl.store(DSTATES + g.to(tl.int64) * (C * M) + state_offs, acc, mask=state_mask & live)
        if i_v == 0:
            tl.store(DZSTATES + g.to(tl.int64) * C + ck, dz, mask=kmask & live)
        t = c * BT + tt
        tmask = (t < length) & live
        mask = tmask[:, None] & kmask[None, :]
        q = tl.load(Q + base_offset(b, h, bos + c * BT, sq_b, sq_h, sq_t) + q_tile, mask=mask, other=0.0)
        if ELU:
            q = elu_plus_one(q, mask, tiny, DT)
        do = tl.load(DO + base_offset(b, h, bos + c * BT, sd_b, sd_h, sd_t) + do_tile,
                     mask=tmask[:, None] & vmask[None, :], other=0.0)
        den = tl.load(DEN + pos_base + t, mask=tmask, other=1.0)
        r = tl.load(R + pos_base + t, mask=tmask, other=0.0)
        grad_num = do.to(tl.float32) / den[:, None]  # g_i
        acc += tl.dot(tl.trans(q.to(tl.float32)), grad_num, input_precision=PREC)
        dz += tl.sum(q.to(tl.float32) * r[:, None], axis=0)
    tl.store(DS0 + row * (C * M) + state_offs, acc, mask=state_mask)
    if i_v == 0:
        tl.store(DZ0 + row * C + ck, dz, mask=kmask)


def chunk_dq_dk_backward(
    Q, K, V, DO, DEN, R, STATES, ZSTATES, DSTATES, DZSTATES, DQ, DK, CU, CHUNK_OFF, CHUNK_TABLE,
    T, H, NT, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d,
    sdq_b, sdq_h, sdq_t, sdq_d, sdk_b, sdk_h, sdk_t, sdk_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(cdiv(C, BK) NT rows,)`` (chunks as ``chunk_output_forward``): dq and dk of one
    feature tile of one chunk; loops over the value dim for B = do v^T and the state terms."""
    i_k, b, h, start, g, tt, tmask = chunk_program(tl.program_id(0), tl.cdiv(C, BK), CU, CHUNK_OFF, CHUNK_TABLE,
                                                  T, H, NT, BT, VARLEN)
    DT = Q.dtype.element_ty
    ck = i_k * BK + tl.arange(0, BK)
    kmask = ck < C
    mask = tmask[:, None] & kmask[None, :]
    q = tl.load(Q + base_offset(b, h, start, sq_b, sq_h, sq_t) + tt[:, None] * sq_t + ck[None, :] * sq_d,
                mask=mask, other=0.0)
    k = tl.load(K + base_offset(b, h, start, sk_b, sk_h, sk_t) + tt[:, None] * sk_t + ck[None, :] * sk_d,
                mask=mask, other=0.0)
    if ELU:  # phi in the input dtype (fewer registers); its derivative min(phi, 1) is taken from it
        q = elu_plus_one(q, mask, tiny, DT)
        k = elu_plus_one(k, mask, tiny, DT)
    v_base = V + base_offset(b, h, start, sv_b, sv_h, sv_t)
    do_base = DO + base_offset(b, h, start, sd_b, sd_h, sd_t)
    bmat = tl.zeros([BT, BT], dtype=tl.float32)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    state_base = g.to(tl.int64) * (C * M)
    for vv in tl.static_range(0, M, BV):
        cv = vv + tl.arange(0, BV)
        vmask = cv < M
        vt = tl.load(v_base + tt[:, None] * sv_t + cv[None, :] * sv_d, mask=tmask[:, None] & vmask[None, :], other=0.0)
        do = tl.load(do_base + tt[:, None] * sd_t + cv[None, :] * sd_d, mask=tmask[:, None] & vmask[None, :], other=0.0)
        s_offs = state_base + ck[:, None] * M + cv[None, :]
        s_mask = kmask[:, None] & vmask[None, :]
        state = tl.load(STATES + s_offs, mask=s_mask, other=0.0)
        dstate = tl.load(DSTATES + s_offs, mask=s_mask, other=0.0)
        bmat += tl.dot(do, tl.trans(vt), input_precision=PREC)
        dq += tl.dot(do.to(tl.float32), tl.trans(state), input_precision=PREC)
        dk += tl.dot(vt.to(tl.float32), tl.trans(dstate), input_precision=PREC)
    pos = (b * H + h).to(tl.int64) * T + start + tt
    den = tl.load(DEN + pos, mask=tmask, other=1.0)
    r = tl.load(R + pos, mask=tmask, other=0.0)
    zc = tl.load(ZSTATES + g.to(tl.int64) * C + ck, mask=kmask, other=0.0)
    dzc = tl.load(DZSTATES + g.to(tl.int64) * C + ck, mask=kmask, other=0.0)
    bmat = tl.where(tt[:, None] >= tt[None, :], bmat / den[:, None] + r[:, None], 0.0)
    dq = dq / den[:, None] + r[:, None] * zc[None, :]
    dq += tl.dot(bmat, k.to(tl.float32), input_precision=PREC)
    dk += tl.dot(tl.trans(bmat), q.to(tl.float32), input_precision=PREC) + dzc[None, :]
    if ELU:
        dq = dq * tl.minimum(q.to(tl.float32), 1.0)
        dk = dk * tl.minimum(k.to(tl.float32), 1.0)
    tl.store(DQ + base_offset(b, h, start, sdq_b, sdq_h, sdq_t) + tt[:, None] * sdq_t + ck[None, :] * sdq_d,
             dq.to(DQ.dtype.element_ty), mask=mask)
    tl.store(DK + base_offset(b, h, start, sdk_b, sdk_h, sdk_t) + tt[:, None] * sdk_t + ck[None, :] * sdk_d,
             dk.to(DK.dtype.element_ty), mask=mask)


def chunk_dv_backward(
    Q, K, DO, DEN, DSTATES, DV, CU, CHUNK_OFF, CHUNK_TABLE,
    T, H, NT, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sd_b, sd_h, sd_t, sd_d,
    sdv_b, sdv_h, sdv_t, sdv_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) NT rows,)`` (chunks as ``chunk_output_forward``): dv of one value
    tile of one chunk; loops over the feature dim for the scores q k^T and dH_c^T k."""
    i_v, b, h, start, g, tt, tmask = chunk_program(tl.program_id(0), tl.cdiv(M, BV), CU, CHUNK_OFF, CHUNK_TABLE,
                                                  T, H, NT, BT, VARLEN)
    DT = Q.dtype.element_ty
    cv = i_v * BV + tl.arange(0, BV)
    vmask = cv < M
    q_base = Q + base_offset(b, h, start, sq_b, sq_h, sq_t)
    k_base = K + base_offset(b, h, start, sk_b, sk_h, sk_t)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    dv = tl.zeros([BT, BV], dtype=tl.float32)
    for kk in tl.static_range(0, C, BK):
        ck = kk + tl.arange(0, BK)
        kmask = ck < C
        mask = tmask[:, None] & kmask[None, :]
        q = tl.load(q_base + tt[:, None] * sq_t + ck[None, :] * sq_d, mask=mask, other=0.0)
        k = tl.load(k_base + tt[:, None] * sk_t + ck[None, :] * sk_d, mask=mask, other=0.0)
        if ELU:
            q = elu_plus_one(q, mask, tiny, DT)
            k = elu_plus_one(k, mask, tiny, DT)
        dstate = tl.load(DSTATES + g.to(tl.int64) * (C * M) + ck[:, None] * M + cv[None, :],
                         mask=kmask[:, None] & vmask[None, :], other=0.0)
        scores += tl.dot(q, tl.trans(k), input_precision=PREC)
        dv += tl.dot(k.to(tl.float32), dstate, input_precision=PREC)
    den = tl.load(DEN + (b * H + h).to(tl.int64) * T + start + tt, mask=tmask, other=1.0)
    scores = tl.where(tt[:, None] >= tt[None, :], scores / den[:, None], 0.0)  # (q_i . k_j) / d_i
    vmask2 = tmask[:, None] & vmask[None, :]
    do = tl.load(DO + base_offset(b, h, start, sd_b, sd_h, sd_t) + tt[:, None] * sd_t + cv[None, :] * sd_d,
                 mask=vmask2, other=0.0)
    dv += tl.dot(tl.trans(scores), do.to(tl.float32), input_precision=PREC)
    tl.store(DV + base_offset(b, h, start, sdv_b, sdv_h, sdv_t) + tt[:, None] * sdv_t + cv[None, :] * sdv_d,
             dv.to(DV.dtype.element_ty), mask=vmask2)
