"""Forward Triton kernels of chunk-parallel causal linear attention (eq. 9-12), walking super-chunks.

Split each sequence into super-chunks of LS positions, each into chunks of BT. With S_c, z_c the
state of eq. 10-11 before chunk c (the initial state S_0, z_0 plus every earlier chunk), a query i
of chunk c reads

    out_i = (q_i^T S_c + sum_{j in c, j <= i} (q_i . k_j) v_j) / (q_i^T z_c + sum_{j in c, j <= i} q_i . k_j + eps)

where q, k are the feature-mapped queries and keys (phi = elu + 1 applied as they are loaded, or
the inputs as given). Two kernels:

* ``superchunk_deltas`` (only with more than one super-chunk per sequence): one program per
  (value tile, super-chunk, sequence x head) sums dS_s = sum phi(k_j) v_j^T and dz_s = sum phi(k_j)
  over its super-chunk. No program waits for another.
* ``superchunk_forward``: one program per (value tile, super-chunk, sequence x head) starts from
  S_0 plus the deltas of the super-chunks before its own and walks its chunks in order with the
  running state in registers: each chunk's output and denominator, then the state moves past the
  chunk. The program of a sequence's last super-chunk stores S_N, z_N.

So no per-chunk state ever reaches memory: the state walk that a chunk-parallel kernel runs
serially over the whole sequence is split into as many independent walks as it takes to fill the
GPU (``launch.superchunk_length``), and the backward recomputes the states the same way from the
saved deltas.

The kernels are plain Python: ``launch.py`` compiles them with ``triton.jit`` when first used; the
helpers they call (``elu_plus_one``, ``superchunk_program``, the products below) are jitted here,
in the mode of the import (``TRITON_INTERPRET`` must be set before triton is imported anyway).

Addressing: every grid is one-dimensional (CUDA caps its y and z at 65,535), each program
unfolding its index into (tile, super-chunk, sequence x head). Every tensor comes with its four
strides (batch, head, position, feature), so views are read and written in place; each program adds
a 64-bit offset of its first position to 32-bit offsets within a chunk.

Dtypes: ``DT`` is the input dtype; a product of two loaded tiles runs in it (exact products, fp32
accumulation). States, scores and normalisers are fp32. A product of an input tile with an fp32
tile (a state, the scores) keeps fp32's accuracy: for bf16 inputs by splitting the fp32 operand into
``PARTS`` bf16 parts (hi + lo [+ lo2]) and adding their bf16 products, since the other operand is
already bf16-exact (one bf16 product per part, against six for ``tf32x3``); for fp16 and fp32
inputs at ``PREC`` (``launch.dot_precision``). Sequences are addressed by (batch row b, first
position bos, length): one per batch row, or one per entry of ``cu_seqlens`` in a packed
(1, T, H, .) tensor (VARLEN). Delta rows are indexed by the global super-chunk and the head.
"""

# no ``from __future__ import annotations``: Triton's interpreter reads ``tl.constexpr`` from
# the annotations as objects, not strings
import triton
import triton.language as tl


@triton.jit
def elu_plus_one(x, mask, tiny, DT: tl.constexpr):
    """phi = elu + 1 in fp32, rounded to DT: x + 1 for x > 0, exp(x) otherwise (no cancellation
    of (exp(x) - 1) + 1), at least ``tiny`` so that half-precision phi stays > 0; 0 off the mask. A
    NaN stays a NaN (the GPU's max would return ``tiny``): the reference's outputs hold it too."""
    x = x.to(tl.float32)
    phi = tl.maximum(tl.where(x > 0, x + 1.0, tl.exp(x)), tiny, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(mask, phi, 0.0).to(DT)


@triton.jit
def dot_exact_fp32(a, b, acc, PREC: tl.constexpr, PARTS: tl.constexpr):
    """acc + a @ b for ``a`` exact in the input dtype and ``b`` fp32. PARTS > 0 (bf16 inputs):
    b = hi + lo (+ lo2) in bf16, each an exact bf16 product with a: 2 parts carry 16 of fp32's 24
    bits, 3 all of them; the smallest part first, so the sum rounds once at the end."""
    if PARTS == 0:  # (an if / else: Triton's compiler does not stop at a return inside an if)
        acc = tl.dot(a.to(tl.float32), b, acc, input_precision=PREC)
    else:
        hi = b.to(tl.bfloat16)
        rest = b - hi.to(tl.float32)
        lo = rest.to(tl.bfloat16)
        if PARTS == 3:
            acc = tl.dot(a, (rest - lo.to(tl.float32)).to(tl.bfloat16), acc)
        acc = tl.dot(a, lo, acc)
        acc = tl.dot(a, hi, acc)
    return acc


@triton.jit
def dot_fp32_exact(a, b, acc, PREC: tl.constexpr, PARTS: tl.constexpr):
    """acc + a @ b for ``a`` fp32 and ``b`` exact in the input dtype (``dot_exact_fp32`` mirrored),
    at most 2 parts: ``a`` is here always one chunk's scores or B (``backward.py``), numbers
    without the cancelling terms of the states, and a third part costs registers that spill at
    C = M = 128 (16 bits pass the accuracy tests)."""
    if PARTS == 0:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision=PREC)
    else:
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(lo, b, acc)
        acc = tl.dot(hi, b, acc)
    return acc


@triton.jit
def dot_inputs(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b for two tiles exact in the input dtype: one product, exact in any precision but
    tf32's (fp32 inputs: what ``PREC`` asks)."""
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def superchunk_program(pid, TILES, CU, SC_OFF, SC_TABLE, T, H, NSC, LS: tl.constexpr, VARLEN: tl.constexpr):
    """The preamble of every kernel: a program's index ``pid`` over (tile, super-chunk slot,
    row), TILES tiles per super-chunk, NSC slots per row, unfolded -> (tile, b, h, seq, bos,
    length, s, g0, n_sc): the tile, batch row, head, sequence, its first position and length,
    the super-chunk within the sequence, the sequence's first global super-chunk and its count
    of super-chunks. Rows are sequences x heads, or with VARLEN the heads, and SC_TABLE ``(NSC, 2)``
    maps a global super-chunk to (sequence, super-chunk in it); NSC is then an upper bound, and
    the slots past a sequence's end find every position masked."""
    tile = pid % TILES
    rest = pid // TILES
    i_s = rest % NSC
    row = rest // NSC
    if VARLEN:
        seq = tl.load(SC_TABLE + 2 * i_s).to(tl.int32)
        s = tl.load(SC_TABLE + 2 * i_s + 1).to(tl.int32)
        h = row
        bos = tl.load(CU + seq).to(tl.int32)
        length = tl.load(CU + seq + 1).to(tl.int32) - bos
        b = row * 0  # a tensor like the other branch's, so .to() applies
        g0 = tl.load(SC_OFF + seq).to(tl.int32)
    else:
        seq = row // H
        h = row % H
        s = i_s
        bos = row * 0
        length = T + row * 0
        b = seq
        g0 = seq * NSC
    return tile, b, h, seq, bos, length, s, g0, tl.cdiv(length, LS)


@triton.jit
def tile_columns(i, TILE: tl.constexpr, N: tl.constexpr, ALL: tl.constexpr, N_ALL: tl.constexpr):
    """A program's columns, ``(TILE,)`` and ``(ALL,)``, and their masks: its tile i of a dimension N
    wide (values or features) and the whole of the other, N_ALL wide (ALL >= N_ALL) ->
    (tiled, whole, tiled < N, whole < N_ALL)."""
    tiled = i * TILE + tl.arange(0, TILE)
    whole = tl.arange(0, ALL)
    return tiled, whole, tiled < N, whole < N_ALL


@triton.jit
def walk_chunks(first, end, BT: tl.constexpr, LS: tl.constexpr, INTERPRET: tl.constexpr):
    """How many chunks of BT the walk of the super-chunk from position ``first`` takes: those that
    start before ``end``. In the interpreter all LS // BT, the ones past ``end`` masked: numpy 2
    refuses range() over the interpreter's scalars, so there the count is a plain int, and a range()
    bound only as the call itself (the interpreter turns a value assigned to a name into a scalar)."""
    return LS // BT if INTERPRET else tl.cdiv(tl.minimum(end - first, LS), BT)


@triton.jit
def walk_chunk(bos, first, c, tt, end, BT: tl.constexpr):
    """Chunk c of the walk from ``first`` (rows first + c BT + tt of the sequence at ``bos``) ->
    (start, tmask): the position of its first row, and ``(BT,)`` its rows before ``end``."""
    return bos + first + c * BT, first + c * BT + tt < end


@triton.jit
def base_offset(b, h, position, sb, sh, st):
    """64-bit offset of (batch row b, head h, position)."""
    return b.to(tl.int64) * sb + h.to(tl.int64) * sh + position.to(tl.int64) * st


@triton.jit
def load_rows(X, b, h, start, tt, cols, tmask, cmask, sb, sh, st, sd):
    """The ``(BT, width)`` tile of rows start + tt and columns ``cols`` of a strided tensor; 0 off the masks."""
    return tl.load(X + base_offset(b, h, start, sb, sh, st) + tt[:, None] * st + cols[None, :] * sd,
                   mask=tmask[:, None] & cmask[None, :], other=0.0)


@triton.jit
def feature_rows(X, b, h, start, tt, ck, tmask, kmask, sb, sh, st, sd, tiny, ELU: tl.constexpr):
    """``load_rows`` of a query or key tile, mapped by phi = elu + 1 (in the input dtype) when ELU."""
    x = load_rows(X, b, h, start, tt, ck, tmask, kmask, sb, sh, st, sd)
    if ELU:
        x = elu_plus_one(x, tmask[:, None] & kmask[None, :], tiny, X.dtype.element_ty)
    return x


@triton.jit
def delta_sum(acc, z, DS, DZ, g0, h, H, lo, hi, ck, cv, kmask, vmask, C: tl.constexpr, M: tl.constexpr,
              NS_MAX: tl.constexpr, INTERPRET: tl.constexpr):
    """acc, z plus the deltas ``(C, M)`` / ``(C,)`` of the sequence's super-chunks lo..hi-1 (global
    super-chunk g0 + p, head h): the state before a super-chunk from S_0 and the ones before it,
    or the state gradient after one from those after it. NS_MAX (interpreter only) bounds hi."""
    smask = kmask[:, None] & vmask[None, :]
    offs = ck[:, None] * M + cv[None, :]
    # numpy 2 refuses range() over the interpreter's scalars: there a constant bound, masked
    for p in range(0 if INTERPRET else lo, NS_MAX if INTERPRET else hi):
        live = (p >= lo) & (p < hi)
        g = ((g0 + p) * H + h).to(tl.int64)
        acc += tl.load(DS + g * (C * M) + offs, mask=smask & live, other=0.0)
        z += tl.load(DZ + g * C + ck, mask=kmask & live, other=0.0)
    return acc, z


@triton.jit
def initial_state(S0, Z0, row, ck, cv, kmask, vmask, C: tl.constexpr, M: tl.constexpr, HAS: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr):
    """The ``(BK, BV)`` tile of a per-sequence state ``(S, H, C, M)`` at ``row`` (sequence x H +
    head) and its ``(BK,)`` vector ``(S, H, C)``, fp32; zeros when there is none."""
    if HAS:
        acc = tl.load(S0 + row.to(tl.int64) * (C * M) + ck[:, None] * M + cv[None, :],
                      mask=kmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        z = tl.load(Z0 + row.to(tl.int64) * C + ck, mask=kmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)
    return acc, z


def superchunk_deltas(
    K, V, DS, DZ, CU, SC_OFF, SC_TABLE, T, H, NSC, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, tiny,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) NSC rows,)``: DS ``(slots H, C, M)``, DZ ``(slots H, C)`` fp32, the sums
    of phi(k_j) v_j^T and phi(k_j) over each super-chunk but a sequence's last (row (global
    super-chunk) H + head; the last's row holds zeros)."""
    i_v, b, h, seq, bos, length, s, g0, n_sc = superchunk_program(tl.program_id(0), tl.cdiv(M, BV), CU, SC_OFF,
                                                                  SC_TABLE, T, H, NSC, LS, VARLEN)
    cv, ck, vmask, kmask = tile_columns(i_v, BV, M, BK, C)
    tt = tl.arange(0, BT)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    first = s * LS
    # a sequence's last super-chunk: no later walk starts from its delta, so none is summed
    end = tl.where(s < n_sc - 1, length, first)
    for c in range(0, walk_chunks(first, end, BT, LS, INTERPRET)):
        start, tmask = walk_chunk(bos, first, c, tt, end, BT)
        k = feature_rows(K, b, h, start, tt, ck, tmask, kmask, sk_b, sk_h, sk_t, sk_d, tiny, ELU)
        v = load_rows(V, b, h, start, tt, cv, tmask, vmask, sv_b, sv_h, sv_t, sv_d)
        acc = dot_inputs(tl.trans(k), v, acc, PREC)
        z += tl.sum(k.to(tl.float32), axis=0)
    g = ((g0 + s) * H + h).to(tl.int64)
    tl.store(DS + g * (C * M) + ck[:, None] * M + cv[None, :], acc, mask=kmask[:, None] & vmask[None, :])
    if i_v == 0:
        tl.store(DZ + g * C + ck, z, mask=kmask)


def superchunk_forward(
    Q, K, V, O, O32, DEN, S0, Z0, DS, DZ, SN, ZN, CU, SC_OFF, SC_TABLE, T, H, NSC,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, so_b, so_h, so_t, so_d, tiny, eps,
    C: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, LS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU: tl.constexpr, HAS_INIT: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr,
    NS_MAX: tl.constexpr, INTERPRET: tl.constexpr, STORE_F32: tl.constexpr,
):
    """Grid ``(cdiv(M, BV) NSC rows,)``: O like V; STORE_F32 (half inputs): O32 ``(B, H, T, M)``
    fp32, the output before its rounding, from which the backward takes r (``backward.py``); DEN
    ``(B, H, T)`` fp32, the denominator of every position; SN, ZN ``(S, H, C, M / -)`` fp32, the
    state after the last position (from the program of each sequence's last super-chunk). DS, DZ:
    ``superchunk_deltas``' sums."""
    i_v, b, h, seq, bos, length, s, g0, n_sc = superchunk_program(tl.program_id(0), tl.cdiv(M, BV), CU, SC_OFF,
                                                                  SC_TABLE, T, H, NSC, LS, VARLEN)
    cv, ck, vmask, kmask = tile_columns(i_v, BV, M, BK, C)
    tt = tl.arange(0, BT)
    causal = tt[:, None] >= tt[None, :]
    row = seq * H + h
    state, z = initial_state(S0, Z0, row, ck, cv, kmask, vmask, C, M, HAS_INIT, BK, BV)
    state, z = delta_sum(state, z, DS, DZ, g0, h, H, 0, tl.where(s < n_sc, s, 0), ck, cv, kmask, vmask, C, M, NS_MAX, INTERPRET)
    first = s * LS
    for c in range(0, walk_chunks(first, length, BT, LS, INTERPRET)):
        start, tmask = walk_chunk(bos, first, c, tt, length, BT)
        q = feature_rows(Q, b, h, start, tt, ck, tmask, kmask, sq_b, sq_h, sq_t, sq_d, tiny, ELU)
        k = feature_rows(K, b, h, start, tt, ck, tmask, kmask, sk_b, sk_h, sk_t, sk_d, tiny, ELU)
        v = load_rows(V, b, h, start, tt, cv, tmask, vmask, sv_b, sv_h, sv_t, sv_d)
        scores = tl.where(causal, dot_inputs(q, tl.trans(k), tl.zeros([BT, BT], dtype=tl.float32), PREC), 0.0)
        num = dot_exact_fp32(q, state, tl.zeros([BT, BV], dtype=tl.float32), PREC, PARTS)
        num = dot_fp32_exact(scores, v, num, PREC, PARTS)
        den = tl.sum(q.to(tl.float32) * z[None, :], axis=1) + tl.sum(scores, axis=1) + eps
        out = num / den[:, None]
        tl.store(O + base_offset(b, h, start, so_b, so_h, so_t) + tt[:, None] * so_t + cv[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=tmask[:, None] & vmask[None, :])
        if STORE_F32:
            tl.store(O32 + ((b * H + h).to(tl.int64) * T + start + tt[:, None]) * M + cv[None, :], out,
                     mask=tmask[:, None] & vmask[None, :])
        if i_v == 0:
            tl.store(DEN + (b * H + h).to(tl.int64) * T + start + tt, den, mask=tmask)
        state = dot_inputs(tl.trans(k), v, state, PREC)
        z += tl.sum(k.to(tl.float32), axis=0)
    if s == n_sc - 1:
        tl.store(SN + row.to(tl.int64) * (C * M) + ck[:, None] * M + cv[None, :], state,
                 mask=kmask[:, None] & vmask[None, :])
        if i_v == 0:
            tl.store(ZN + row.to(tl.int64) * C + ck, z, mask=kmask)
