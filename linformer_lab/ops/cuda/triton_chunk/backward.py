"""Backward Triton kernels of chunk-parallel causal linear attention, walking super-chunks.

With out_i = n_i / d_i (numerator n_i = q_i^T S_i, denominator d_i = q_i^T z_i + eps) and the
incoming gradient o_i = dL/d out_i, the gradients of the numerator and of the denominator are

    g_i = o_i / d_i        (M numbers)        r_i = -(o_i . n_i) / d_i^2        (one number),

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
their gradients in fp32, and every product with an fp32 operand split into bf16 parts (bf16
inputs) or at ``PREC`` (``forward.py``). Products of two input tiles are exact in any precision.

r comes from the output before its rounding (the forward's fp32 copy for half inputs, the output
itself for fp32): as exact as a recomputed numerator, and it frees dq's program from holding the
whole state (r sums over all of M, dq over all of M, and a whole C x M fp32 state with its bf16
parts does not fit one program's registers at C = M = 128).

Three kernels, over the super-chunks of ``forward.py`` (``LS`` positions, the forward's deltas saved):

* ``superchunk_backward_prepare``: per (value tile, super-chunk, sequence x head), with more than
  one super-chunk per sequence, dH_s = sum_{i in s} q_i g_i^T on the tile; the programs of the
  first value tile also r_i (stored per position) and dh_s = sum_{i in s} r_i q_i.
* ``superchunk_dq``: per (feature tile, super-chunk, sequence x head), walks its chunks forward
  from S_0 plus the earlier super-chunks' deltas, the state's rows of the tile in registers: dq.
* ``superchunk_dk_dv``: per (feature tile or value tile, super-chunk, sequence x head), walks its
  chunks last to first from dS_N plus the later super-chunks' dH_s, dh_s: a feature tile's program
  holds dH's rows of the tile and computes dk (and the first super-chunk's stores dS_0, dz_0), a
  value tile's holds dH's columns of the tile and computes dv.
"""

# no ``from __future__ import annotations``: Triton's interpreter reads ``tl.constexpr`` from
# the annotations as objects, not strings
import triton
import triton.language as tl

from linformer_lab.ops.cuda.triton_chunk.forward import (
    base_offset,
    delta_sum,
    dot_exact_fp32,
    dot_fp32_exact,
    dot_inputs,
    feature_rows,
    initial_state,
    load_rows,
    superchunk_program,
    tile_columns,
    walk_chunk,
    walk_chunks,
)


def superchunk_backward_prepare(
    Q, DO, O32, DEN, R, DH, DHZ, CU, SC_OFF, SC_TABLE, T, H, NSC,
    sq_b, sq_h, sq_t, sq_d, sd_b, sd_h, sd_t, sd_d, so_b, so_h, so_t, so_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MF: tl.constexpr, ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr,
    DELTAS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) NSC rows,)``, BK >= C, MF >= M: R ``(B, H, T)`` fp32 = -(do_i . out_i) / d_i
    from O32 (the output before rounding); DHZ ``(slots H, C)`` fp32, sum r_i q_i over each
    super-chunk; DELTAS: DH ``(slots H, C, M)`` fp32, sum q_i g_i^T over each super-chunk."""
    i_v, b, h, seq, bos, length, s, g0, n_sc = superchunk_program(tl.program_id(0), tl.cdiv(M, BV), CU, SC_OFF,
                                                                  SC_TABLE, T, H, NSC, LS, VARLEN)
    cv, ck, vmask, kmask = tile_columns(i_v, BV, M, BK, C)
    cm = tl.arange(0, MF)
    mmask = cm < M
    tt = tl.arange(0, BT)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    dh = tl.zeros([BK], dtype=tl.float32)
    first = s * LS
    for c in range(0, walk_chunks(first, length, BT, LS, INTERPRET)):
        start, tmask = walk_chunk(bos, first, c, tt, length, BT)
        q = feature_rows(Q, b, h, start, tt, ck, tmask, kmask, sq_b, sq_h, sq_t, sq_d, tiny, ELU)
        pos = (b * H + h).to(tl.int64) * T + start + tt
        den = tl.load(DEN + pos, mask=tmask, other=1.0)
        if DELTAS:
            do = load_rows(DO, b, h, start, tt, cv, tmask, vmask, sd_b, sd_h, sd_t, sd_d)
            acc = dot_exact_fp32(tl.trans(q), do.to(tl.float32) / den[:, None], acc, PREC, PARTS)
        if i_v == 0:
            do_all = load_rows(DO, b, h, start, tt, cm, tmask, mmask, sd_b, sd_h, sd_t, sd_d).to(tl.float32)
            out = load_rows(O32, b, h, start, tt, cm, tmask, mmask, so_b, so_h, so_t, so_d).to(tl.float32)
            r = -tl.sum(do_all * out, axis=1) / den
            tl.store(R + pos, r, mask=tmask)
            dh += tl.sum(q.to(tl.float32) * r[:, None], axis=0)
    g = ((g0 + s) * H + h).to(tl.int64)
    if DELTAS:
        tl.store(DH + g * (C * M) + ck[:, None] * M + cv[None, :], acc, mask=kmask[:, None] & vmask[None, :])
    if i_v == 0:
        tl.store(DHZ + g * C + ck, dh, mask=kmask)


@triton.jit
def chunk_gradient_rows(DO, V, DEN, R, b, h, start, tt, tmask, cm, mmask, T, H, sv_b, sv_h, sv_t, sv_d,
                        sd_b, sd_h, sd_t, sd_d, BT: tl.constexpr, PREC: tl.constexpr):
    """One chunk's do, v ``(BT, MF)``, den, r ``(BT,)`` and B = tril(do v^T / d + r) ``(BT, BT)`` fp32."""
    v = load_rows(V, b, h, start, tt, cm, tmask, mmask, sv_b, sv_h, sv_t, sv_d)
    do = load_rows(DO, b, h, start, tt, cm, tmask, mmask, sd_b, sd_h, sd_t, sd_d)
    pos = (b * H + h).to(tl.int64) * T + start + tt
    den = tl.load(DEN + pos, mask=tmask, other=1.0)
    r = tl.load(R + pos, mask=tmask, other=0.0)
    causal = tt[:, None] >= tt[None, :]
    product = dot_inputs(do, tl.trans(v), tl.zeros([BT, BT], dtype=tl.float32), PREC)
    return do, v, den, r, tl.where(causal, product / den[:, None] + r[:, None], 0.0)


def superchunk_dq(
    Q, K, V, DO, DEN, R, S0, Z0, DS, DZ, DQ, CU, SC_OFF, SC_TABLE, T, H, NSC,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d,
    sdq_b, sdq_h, sdq_t, sdq_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, BK: tl.constexpr, MF: tl.constexpr,
    ELU: tl.constexpr, HAS_INIT: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr,
    NS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid ``(cdiv(C, BK) NSC rows,)``, MF >= M: DQ like Q, on the feature tile
    dq_i = sum_j B_ij k_j + S_c g_i + r_i z_c. DS, DZ: the forward's deltas."""
    i_k, b, h, seq, bos, length, s, g0, n_sc = superchunk_program(tl.program_id(0), tl.cdiv(C, BK), CU, SC_OFF,
                                                                  SC_TABLE, T, H, NSC, LS, VARLEN)
    ck, cm, kmask, mmask = tile_columns(i_k, BK, C, MF, M)
    tt = tl.arange(0, BT)
    state, z = initial_state(S0, Z0, seq * H + h, ck, cm, kmask, mmask, C, M, HAS_INIT, BK, MF)
    state, z = delta_sum(state, z, DS, DZ, g0, h, H, 0, tl.where(s < n_sc, s, 0), ck, cm, kmask, mmask, C, M, NS_MAX, INTERPRET)
    first = s * LS
    for c in range(0, walk_chunks(first, length, BT, LS, INTERPRET)):
        start, tmask = walk_chunk(bos, first, c, tt, length, BT)
        kq_mask = tmask[:, None] & kmask[None, :]
        k = feature_rows(K, b, h, start, tt, ck, tmask, kmask, sk_b, sk_h, sk_t, sk_d, tiny, ELU)
        do, v, den, r, bmat = chunk_gradient_rows(DO, V, DEN, R, b, h, start, tt, tmask, cm, mmask, T, H,
                                                  sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d, BT, PREC)
        dq = dot_exact_fp32(do, tl.trans(state), tl.zeros([BT, BK], dtype=tl.float32), PREC, PARTS)
        dq = dq / den[:, None] + r[:, None] * z[None, :]
        dq = dot_fp32_exact(bmat, k, dq, PREC, PARTS)
        if ELU:
            q = feature_rows(Q, b, h, start, tt, ck, tmask, kmask, sq_b, sq_h, sq_t, sq_d, tiny, ELU)
            dq = dq * tl.minimum(q.to(tl.float32), 1.0, propagate_nan=tl.PropagateNan.ALL)  # NaN kept
        tl.store(DQ + base_offset(b, h, start, sdq_b, sdq_h, sdq_t) + tt[:, None] * sdq_t + ck[None, :] * sdq_d,
                 dq.to(DQ.dtype.element_ty), mask=kq_mask)
        state = dot_inputs(tl.trans(k), v, state, PREC)
        z += tl.sum(k.to(tl.float32), axis=0)


@triton.jit
def dk_walk(Q, K, V, DO, DEN, R, DSN, DZN, DH, DHZ, DK, DS0, DZ0, i_k, b, h, row, bos, length, s, g0, n_sc, T, H,
            sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d,
            sdk_b, sdk_h, sdk_t, sdk_d, tiny,
            C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, BK: tl.constexpr, MF: tl.constexpr,
            ELU: tl.constexpr, HAS_DFINAL: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr,
            NS_MAX: tl.constexpr, INTERPRET: tl.constexpr):
    """``superchunk_dk_dv``'s feature-tile programs: dk_j = sum_i B_ij q_i + dH_c v_j + dh_c on the
    tile, dH's rows of the tile and dh on it carried from the last chunk to the first."""
    ck, cm, kmask, mmask = tile_columns(i_k, BK, C, MF, M)
    tt = tl.arange(0, BT)
    dstate, dz = initial_state(DSN, DZN, row, ck, cm, kmask, mmask, C, M, HAS_DFINAL, BK, MF)
    dstate, dz = delta_sum(dstate, dz, DH, DHZ, g0, h, H, s + 1, n_sc, ck, cm, kmask, mmask, C, M, NS_MAX,
                           INTERPRET)
    first = s * LS
    n_chunks = walk_chunks(first, length, BT, LS, INTERPRET)
    # the interpreter's range() takes no assigned count (walk_chunks): there the constant bound
    for i in range(0, LS // BT if INTERPRET else n_chunks):
        c = n_chunks - 1 - i  # last chunk first
        start, tmask = walk_chunk(bos, first, c, tt, length, BT)
        kq_mask = tmask[:, None] & kmask[None, :]
        q = feature_rows(Q, b, h, start, tt, ck, tmask, kmask, sq_b, sq_h, sq_t, sq_d, tiny, ELU)
        do, v, den, r, bmat = chunk_gradient_rows(DO, V, DEN, R, b, h, start, tt, tmask, cm, mmask, T, H,
                                                  sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d, BT, PREC)
        dk = dot_exact_fp32(v, tl.trans(dstate), tl.zeros([BT, BK], dtype=tl.float32), PREC, PARTS) + dz[None, :]
        dk = dot_fp32_exact(tl.trans(bmat), q, dk, PREC, PARTS)
        if ELU:
            k = feature_rows(K, b, h, start, tt, ck, tmask, kmask, sk_b, sk_h, sk_t, sk_d, tiny, ELU)
            dk = dk * tl.minimum(k.to(tl.float32), 1.0, propagate_nan=tl.PropagateNan.ALL)  # NaN kept
        tl.store(DK + base_offset(b, h, start, sdk_b, sdk_h, sdk_t) + tt[:, None] * sdk_t + ck[None, :] * sdk_d,
                 dk.to(DK.dtype.element_ty), mask=kq_mask)
        dstate = dot_exact_fp32(tl.trans(q), do.to(tl.float32) / den[:, None], dstate, PREC, PARTS)
        dz += tl.sum(q.to(tl.float32) * r[:, None], axis=0)
    if (s == 0) & (n_sc > 0):
        tl.store(DS0 + row.to(tl.int64) * (C * M) + ck[:, None] * M + cm[None, :], dstate,
                 mask=kmask[:, None] & mmask[None, :])
        tl.store(DZ0 + row.to(tl.int64) * C + ck, dz, mask=kmask)


@triton.jit
def dv_walk(Q, K, DO, DEN, DSN, DZN, DH, DHZ, DV, i_v, b, h, row, bos, length, s, g0, n_sc, T, H,
            sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sd_b, sd_h, sd_t, sd_d, sdv_b, sdv_h, sdv_t, sdv_d, tiny,
            C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, KF: tl.constexpr, BV: tl.constexpr,
            ELU: tl.constexpr, HAS_DFINAL: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr,
            NS_MAX: tl.constexpr, INTERPRET: tl.constexpr):
    """``superchunk_dk_dv``'s value-tile programs: dv_j = sum_i (q_i . k_j) g_i + dH_c^T k_j on the
    tile, dH's columns of the tile carried from the last chunk to the first."""
    cv, ck, vmask, kmask = tile_columns(i_v, BV, M, KF, C)
    tt = tl.arange(0, BT)
    causal = tt[:, None] >= tt[None, :]
    dstate, _ = initial_state(DSN, DZN, row, ck, cv, kmask, vmask, C, M, HAS_DFINAL, KF, BV)
    dstate, _ = delta_sum(dstate, tl.zeros([KF], dtype=tl.float32), DH, DHZ, g0, h, H, s + 1, n_sc, ck, cv, kmask,
                          vmask, C, M, NS_MAX, INTERPRET)
    first = s * LS
    n_chunks = walk_chunks(first, length, BT, LS, INTERPRET)
    # the interpreter's range() takes no assigned count (walk_chunks): there the constant bound
    for i in range(0, LS // BT if INTERPRET else n_chunks):
        c = n_chunks - 1 - i  # last chunk first
        start, tmask = walk_chunk(bos, first, c, tt, length, BT)
        q = feature_rows(Q, b, h, start, tt, ck, tmask, kmask, sq_b, sq_h, sq_t, sq_d, tiny, ELU)
        k = feature_rows(K, b, h, start, tt, ck, tmask, kmask, sk_b, sk_h, sk_t, sk_d, tiny, ELU)
        do = load_rows(DO, b, h, start, tt, cv, tmask, vmask, sd_b, sd_h, sd_t, sd_d)
        den = tl.load(DEN + (b * H + h).to(tl.int64) * T + start + tt, mask=tmask, other=1.0)
        scores = dot_inputs(q, tl.trans(k), tl.zeros([BT, BT], dtype=tl.float32), PREC)
        scores = tl.where(causal, scores / den[:, None], 0.0)  # (q_i . k_j) / d_i
        dv = dot_exact_fp32(k, dstate, tl.zeros([BT, BV], dtype=tl.float32), PREC, PARTS)
        dv = dot_fp32_exact(tl.trans(scores), do, dv, PREC, PARTS)
        tl.store(DV + base_offset(b, h, start, sdv_b, sdv_h, sdv_t) + tt[:, None] * sdv_t + cv[None, :] * sdv_d,
                 dv.to(DV.dtype.element_ty), mask=tmask[:, None] & vmask[None, :])
        dstate = dot_exact_fp32(tl.trans(q), do.to(tl.float32) / den[:, None], dstate, PREC, PARTS)


def superchunk_dk_dv(
    Q, K, V, DO, DEN, R, DSN, DZN, DH, DHZ, DK, DV, DS0, DZ0, CU, SC_OFF, SC_TABLE, T, H, NSC,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d,
    sdk_b, sdk_h, sdk_t, sdk_d, sdv_b, sdv_h, sdv_t, sdv_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    KF: tl.constexpr, MF: tl.constexpr, ELU: tl.constexpr, HAS_DFINAL: tl.constexpr, VARLEN: tl.constexpr,
    PREC: tl.constexpr, PARTS: tl.constexpr, NS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid ``((cdiv(C, BK) + cdiv(M, BV)) NSC rows,)``, KF >= C, MF >= M: the first cdiv(C, BK)
    tiles of a super-chunk compute DK (like K) and, in the first super-chunk, DS0, DZ0 ``(S, H,
    C, M / -)`` fp32; the others DV (like V). DH, DHZ: ``superchunk_backward_prepare``'s sums;
    DSN, DZN the gradient of the final state."""
    tile, b, h, seq, bos, length, s, g0, n_sc = superchunk_program(tl.program_id(0), tl.cdiv(C, BK) + tl.cdiv(M, BV),
                                                                   CU, SC_OFF, SC_TABLE, T, H, NSC, LS, VARLEN)
    row = seq * H + h
    if tile < tl.cdiv(C, BK):
        dk_walk(Q, K, V, DO, DEN, R, DSN, DZN, DH, DHZ, DK, DS0, DZ0, tile, b, h, row, bos, length, s, g0, n_sc, T, H,
                sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sd_b, sd_h, sd_t, sd_d,
                sdk_b, sdk_h, sdk_t, sdk_d, tiny, C, M, BT, LS, BK, MF, ELU, HAS_DFINAL, PREC, PARTS, NS_MAX, INTERPRET)
    else:
        dv_walk(Q, K, DO, DEN, DSN, DZN, DH, DHZ, DV, tile - tl.cdiv(C, BK), b, h, row, bos, length, s, g0, n_sc, T, H,
                sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sd_b, sd_h, sd_t, sd_d, sdv_b, sdv_h, sdv_t, sdv_d, tiny,
                C, M, BT, LS, KF, BV, ELU, HAS_DFINAL, PREC, PARTS, NS_MAX, INTERPRET)
