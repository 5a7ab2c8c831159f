// Causal linear attention on CPU (eq. 7, 9-12), forward and backward (eq. 13-15), the numerator
// and the normaliser in one pass each, phi = elu + 1 computed here too unless `mapped` (then q and
// k are phi(q), phi(k) of any other feature map, applied by PyTorch, which differentiates it, and
// the backward leaves out elu's derivative):
//
//   out_t = phi(q_t)^T S_t / den_t,   den_t = phi(q_t)^T z_t + eps      q, k (rows, N, C), v (rows, N, M)
//   S_t = S_0 + sum_{s <= t} phi(k_s) v_s^T,   z_t = z_0 + sum_{s <= t} phi(k_s)
//
// Every product with a state is one loop, `sweep`: a tile of the state (P <= 16 rows of one
// register each) stays in registers while positions stream past; per position, a rank-1 update of
// the tile (one broadcast FMA per row), then the tile's contribution to one output row (one
// broadcast FMA per row). 2 P FMAs per position, no shuffles, no scratch: the plain recurrence's
// 4 C M flops per position and pass, against the chunked algorithm's extra l (4 C + 3 M) per
// position (ops/linear_attention/chunk.py), which at small D is most of the work and runs as
// inefficiently small GEMMs. With gn_t = g_t / den_t, gd_t = -(g_t . out_t) / den_t and
// phi' = min(phi, 1) (exp(x) = phi below 0, 1 above; applied in a pass's last store):
//
//   forward  S  (C x M, rows over C) += phi(k_t) v_t^T    out_t = S^T phi(q_t) / den_t          (in order)
//   grad q   S' (M x C) = S^T        += v_t phi(k_t)^T    gq_t = phi'(q_t) (S'^T gn_t + gd_t z_t)  (in order)
//   grad v   R  (C x M)              += phi(q_t) gn_t^T   gv_t = R^T phi(k_t)                    (reversed)
//   grad k   R' (M x C) = R^T        += gn_t phi(q_t)^T   gk_t = phi'(k_t) (R'^T v_t + r_t)       (reversed)
//
// with R_t = grad S_N + sum_{s >= t} phi(q_s) gn_s^T and r_t = grad z_N + sum_{s >= t} gd_s phi(q_s),
// so grad S_0 = R_0 and grad z_0 = r_0. The transposed copies S', R' make every output a broadcast
// FMA again (a state row times a scalar) instead of a horizontal sum. z is the column S would get
// from a value column of ones, carried beside S as one register row over C (z += phi(k_t),
// den_t = phi(q_t) . z; in registers where C <= 4 registers): as a column of S it would add a whole
// register of columns to every pass (a quarter more FMAs at M = 64).
//
// Positions run in blocks of kBlock. Per block the forward maps q and k into its outputs phi(q),
// phi(k) (phi(k) zeroed past a row's key length, both zeroed in C's padding columns), walks z to
// get den_t and runs its pass on phi(q_t) / den_t (scaled_by_inverse says how). It keeps S and z at
// every block start ((N / kBlock, C, M): no larger than an input for M <= kBlock), den, and phi(q),
// phi(k) in place of q and k (no more memory unless q, k are kept alive elsewhere): the backward
// maps nothing, walks the blocks from last to first and runs its three passes on one block while
// its inputs are in cache (one read of them from memory). Rows hold one sequence each, or
// (cu_seqlens) segments that are sequences of their own: an item is a (segment, row) pair with its
// own state, states[item = segment * rows + row].
//
// Threads: both directions split items where they share out evenly; else the forward splits each
// item's columns (one piece per thread, or per register tile) and the backward (item, pass) pairs
// (grad q; grad v with grad k). Loops under ~4 MFLOP run on one thread. Registers: the widest of
// the instruction set in use that divides C and M (AVX-512: 16 floats, else 8 or 4; 8, 4 or 2
// doubles), so C and M must be multiples of 4 floats or 2 doubles; causal_recurrence.py zero-pads
// other C, M up to whole registers (zero columns add nothing). Outputs of 4 MiB and more come from a
// pool of reused buffers (output_pool.h): no page faults per call.
//
// Compiled for AVX-512, AVX2 + FMA and SSE2 (target attributes, no -march) and picked at load
// (simd.h). Built by linformer_lab/ops/cpu/__init__.py; registered as torch.library operators by
// linformer_lab/ops/custom_ops.py, called from linformer_lab/ops/cpu/causal_recurrence.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#include "output_pool.h"
#include "simd.h"

namespace {

// Positions per block: the unit of the saved forward states and of the backward's walk. 256, not
// 128: half the saved states and half the per-block work (a state copy, a transpose), and a block's
// q, k, v, grad still fit L2 at D = 128 (512 KiB); faster at every shape measured.
constexpr int64_t kBlock = 256;

// How far ahead each position asks for its operands (bytes of a, b and c; at least one position).
// The hardware prefetchers alone left the passes waiting on memory once the rows outgrow the cache:
// a sweep reads one 64-byte line of every a, b, c row (a register's columns) and the rows are up to
// 512 bytes apart. Prefetching gains on long rows and leaves shapes in cache unchanged; 1024 and
// 4096 bytes, or 16 positions whatever the row, were slower at some shapes. It also
// replaced the backward's prefetch of each next block (a block's inputs at once), which added nothing.
constexpr int64_t kAheadBytes = 2048;

// One SIMD register of B bytes (GCC's vector extension), and the tile height: a tile of
// kRows state rows, one register each, plus the broadcast operand and 4 accumulators fit the
// register file (32 zmm on AVX-512: 16 + 5; 16 ymm / xmm otherwise: 8 + 5).
template <typename T, int B>
struct Vec {
  using type = typename Register<T, B>::type;
  static constexpr int kWidth = B / sizeof(T);
  static constexpr int kRows = B == 64 ? 16 : 8;
};

// Positions [t0, t1) (from t1 - 1 down with `reverse`) of one tile of P state rows x one register
// of columns, x[p] = state[p * lds + (0..W)]:
//   x[p] += a[t, p] * b[t, :];   out[t, :] (+)= sum_p c[t, p] x[p]
// with a[t, p] = a[t * ld_a + p] (likewise b, c, out). The sum runs in 4 partial accumulators
// (a dependency chain of P / 4 FMAs); the positions are independent of each other but for the
// one FMA per row of the update, so out-of-order execution overlaps consecutive positions.
// kDerivative (the gradients of q and k): the stored row is multiplied by min(phi[t, :], 1), the
// derivative of elu + 1 given its value (phi laid out as out). kScale (1 / den_t, so that no scaled
// copy of an operand is written): kScaleSum, the sum is multiplied by scale[t] before it is stored
// or added; kScaleB, b[t, :] is.
enum Scale { kScaleNone, kScaleSum, kScaleB };
template <typename T, int B, int P, bool kDerivative = false, int kScale = kScaleNone>
INLINE void sweep(int64_t t0, int64_t t1, bool reverse, const T* a, int64_t ld_a, const T* b, int64_t ld_b, const T* c,
                  int64_t ld_c, T* out, int64_t ld_out, bool accumulate, T* state, int64_t lds,
                  const T* phi = nullptr, const T* scale = nullptr) {
  using V = typename Vec<T, B>::type;
  constexpr int kAcc = P < 4 ? P : 4;
  V x[P];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) x[p] = load<T, B>(state + p * lds);
  // pointers stepped by +-1 row: GCC then addresses a[t, p] as a fixed offset from one register
  const int64_t first = reverse ? t1 - 1 : t0, step = reverse ? -1 : 1;
  const T *at = a + first * ld_a, *bt = b + first * ld_b, *ct = c + first * ld_c;
  const T* pt = kDerivative ? phi + first * ld_out : nullptr;
  const T* st = kScale != kScaleNone ? scale + first : nullptr;
  T* ot = out + first * ld_out;
  const int64_t ahead = kAheadBytes / sizeof(T);
  const int64_t ahead_a = step * std::max(ld_a, ahead), ahead_b = step * std::max(ld_b, ahead);
  const int64_t ahead_c = step * std::max(ld_c, ahead);
  for (int64_t i = t0; i < t1; ++i, at += step * ld_a, bt += step * ld_b, ct += step * ld_c, ot += step * ld_out,
               pt += kDerivative ? step * ld_out : 0, st += kScale != kScaleNone ? step : 0) {
    __builtin_prefetch(at + ahead_a, 0, 3), __builtin_prefetch(bt + ahead_b, 0, 3), __builtin_prefetch(ct + ahead_c, 0, 3);
    const V bv = kScale == kScaleB ? load<T, B>(bt) * *st : load<T, B>(bt);
    V acc[kAcc];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      x[p] += at[p] * bv;
      acc[p % kAcc] = p < kAcc ? ct[p] * x[p] : acc[p % kAcc] + ct[p] * x[p];
    }
#pragma GCC unroll 4
    for (int u = 1; u < kAcc; ++u) acc[0] += acc[u];
    if (kScale == kScaleSum) acc[0] *= *st;
    V result = accumulate ? acc[0] + load<T, B>(ot) : acc[0];
    if (kDerivative) {
      const V p = load<T, B>(pt), one = V{} + T(1);
      result *= p >= one ? one : p;  // min(phi, 1), a NaN phi kept
    }
    store<T, B>(ot, result);
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) store<T, B>(state + p * lds, x[p]);
}

// One pass over positions [t0, t1) for every tile of a (rows x cols) state, rows over a's and c's
// dim, cols over b's and out's (both multiples of the register width): per column tile, the row
// tiles add into the same out columns. `prefilled`: out already holds a term to add to (the fused
// attention's normaliser gradient); `phi`: the last row tile multiplies by min(phi, 1) (sweep); `scale`
// (unless null): every tile's sum (kScaleSum) or b (kScaleB) is multiplied by scale[t] (sweep).
template <typename T, int B>
INLINE void pass(int64_t t0, int64_t t1, bool reverse, int64_t rows, int64_t cols, const T* a, const T* b,
                 const T* c, T* out, T* state, int64_t col0, int64_t col1, bool prefilled = false,
                 const T* phi = nullptr, const T* scale = nullptr, Scale how = kScaleSum) {
  constexpr int W = Vec<T, B>::kWidth, kRows = Vec<T, B>::kRows;
  for (int64_t j = col0; j < col1; j += W) {
    for (int64_t p = 0, r; p < rows; p += r) {
      // the tallest tile that fits: kRows, then 8, 4, 2 rows at the end (rows is a multiple of W >= 2;
      // a tile of 16 rows runs only where kRows is 16)
      const int64_t left = rows - p;
      r = left >= kRows ? kRows : left >= 8 ? 8 : left >= 4 ? 4 : 2;
      const bool acc = prefilled || p > 0, derivative = phi != nullptr && p + r == rows;
      const int mode = scale == nullptr ? kScaleNone : how;
      const T* phi_j = derivative ? phi + j : nullptr;
#define ROWS(R, D, S) case R: sweep<T, B, R, D, S>(t0, t1, reverse, a + p, rows, b + j, cols, c + p, rows, out + j, \
                                                   cols, acc, state + p * cols + j, cols, phi_j, scale); break;
#define TILES(D, S) switch (r) { ROWS(16, D, S) ROWS(8, D, S) ROWS(4, D, S) default: ROWS(2, D, S) }
      if (derivative) {
        if (mode == kScaleSum) { TILES(true, kScaleSum) } else if (mode == kScaleB) { TILES(true, kScaleB) }
        else { TILES(true, kScaleNone) }
      } else {
        if (mode == kScaleSum) { TILES(false, kScaleSum) } else if (mode == kScaleB) { TILES(false, kScaleB) }
        else { TILES(false, kScaleNone) }
      }
#undef TILES
#undef ROWS
    }
  }
}

// dst (cols x rows) = src (rows x cols)^T, in 16 x 16 tiles: a whole row of src at once writes to
// `cols` lines of dst, 512 bytes apart at D = 128, which thrashes L1 (once per block, this copy was
// a large part of the backward at D = 128 before it was tiled).
template <typename T>
void transpose(const T* src, int64_t rows, int64_t cols, T* dst) {
  constexpr int64_t kTile = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile)
      for (int64_t i = i0; i < std::min(rows, i0 + kTile); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + kTile); ++j) dst[j * rows + i] = src[i * cols + j];
}

// The register width (bytes) for (C, M) in elements of `size` bytes: the widest one of the
// instruction set in use, or a narrower one (a version for a lower instruction set, which the CPU
// also runs) that divides both, so that D = 24 runs 8-float registers on AVX-512; 0 for none (then
// causal_recurrence.py pads C and M).
int width_bytes(int64_t c, int64_t m, int64_t size) {
  for (int b = kIsa == Isa::kAvx512 ? 64 : kIsa == Isa::kAvx2 ? 32 : 16; b >= 16; b /= 2)
    if (c > 0 && m > 0 && c % (b / size) == 0 && m % (b / size) == 0) return b;
  return 0;
}

// Outputs and saved states: large ones from this module's pool of reused buffers (output_pool.h).
at::Tensor empty_outputs(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return OutputPool::get().empty(sizes, options);
}

// The grain of a parallel loop over `tasks` that do `flops` in all: all of them (one thread, no
// wake-up of the others) below ~4 MFLOP, about as long as waking the other threads takes with
// OMP_WAIT_POLICY=PASSIVE; else 1.
int64_t grain(int64_t tasks, int64_t flops) { return flops < (int64_t{4} << 20) ? std::max<int64_t>(tasks, 1) : 1; }

// Whether whole rows (items) keep every thread busy: many, or a multiple of the threads. The forward
// and the backward then give a task whole ones, which read each input from memory once.
bool rows_share_out(int64_t rows) {
  const int64_t threads = at::get_num_threads();
  return rows >= 4 * threads || rows % threads == 0;
}

void check(const at::Tensor& t, const at::Tensor& like, int64_t dim, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == like.scalar_type(),
              what, " must be a contiguous CPU tensor (rows, N, D) of q's dtype");
  TORCH_CHECK(t.size(0) == like.size(0) && t.size(1) == like.size(1) && (dim < 0 || t.size(2) == dim), what,
              " has the wrong shape");
}

// Whether (C, M) in this dtype runs here: whole registers in both dims.
bool fits(int64_t c, int64_t m, at::ScalarType dtype) {
  return (dtype == at::kFloat || dtype == at::kDouble) && width_bytes(c, m, dtype == at::kDouble ? 8 : 4) > 0;
}

// ------------------------------------------------------------------ the attention

// exp(x) for x <= 0 in float: 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by a polynomial
// of degree 5 fitted for the least relative error there (~2e-7, as the degree-6 Taylor polynomial;
// p(0) = 1 exactly, so exp(0) = 1). x is clamped at -87, where exp is still a normal float (1.6e-38):
// below that torch's exp gives denormals or 0, a difference no sum can see.
template <int B>
INLINE typename Register<float, B>::type exp_nonpositive(typename Register<float, B>::type x) {
  using V = typename Register<float, B>::type;
  using I = typename Register<int32_t, B>::type;
  const V low = V{} - 87.0f;
  x = x > low ? x : low;
  const V shifted = x * 1.44269504f + 12582912.0f;  // 1.5 * 2^23: the sum's rounding rounds to an integer
  const V n = shifted - 12582912.0f;
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  V p = r * 0.0082903150f + 0.041897930f;
  p = p * r + 0.16667636f;
  p = p * r + 0.49999151f;
  p = p * r + 0.99999970f;
  p = p * r + 1.0f;
  // times 2^n: n sits in shifted's lowest mantissa bits (shifted = 1.5 * 2^23 + n, n >= -126), so
  // those bits shifted 23 places left add n to p's exponent field (p >= 1 where n = -126: no underflow)
  const I bits = reinterpret_cast<const I&>(p) + (reinterpret_cast<const I&>(shifted) << 23);
  return reinterpret_cast<const V&>(bits);
}

// out[i] = elu(x[i]) + 1 = exp(min(x, 0)) + max(x, 0) for `count` numbers (a multiple of the register width).
template <typename T, int B>
INLINE void elu_plus_one(const T* x, int64_t count, T* out) {
  using V = typename Vec<T, B>::type;
  constexpr int W = Vec<T, B>::kWidth;
  if constexpr (std::is_same<T, float>::value) {
    for (int64_t i = 0; i < count; i += W) {
      // x is the block's first touch of q or k (read from memory at long rows): asked for ahead as the passes do
      __builtin_prefetch(x + i + kAheadBytes / sizeof(T), 0, 3);
      const V v = load<T, B>(x + i), zero = V{};
      // max(x, 0) as "x <= 0 ? 0 : x", so that a NaN x gives a NaN phi, as in the reference
      store<T, B>(out + i, exp_nonpositive<B>(v < zero ? v : zero) + (v <= zero ? zero : v));
    }
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = x[i] > 0 ? x[i] + 1 : std::exp(x[i]);
  }
}

// One register whose lane i is the sum of x[i]'s lanes, x[0..W): pairs of registers summed into
// their even and odd lanes, halving the count per round (W - 1 additions and 2 (W - 1) shuffles for W
// sums, where W horizontal sums take W log2 W shuffles and lane extractions besides).
template <typename V, size_t... I>
INLINE V even_lanes(V a, V b, std::index_sequence<I...>) { return __builtin_shufflevector(a, b, (2 * I)...); }
template <typename V, size_t... I>
INLINE V odd_lanes(V a, V b, std::index_sequence<I...>) { return __builtin_shufflevector(a, b, (2 * I + 1)...); }

template <typename T, int B>
INLINE typename Vec<T, B>::type lane_sums(typename Vec<T, B>::type* x) {
  constexpr int W = Vec<T, B>::kWidth;
  const auto lanes = std::make_index_sequence<W>{};
#pragma GCC unroll 4
  for (int count = W; count > 1; count /= 2)
#pragma GCC unroll 8
    for (int i = 0; i < count / 2; ++i)
      x[i] = even_lanes(x[2 * i], x[2 * i + 1], lanes) + odd_lanes(x[2 * i], x[2 * i + 1], lanes);
  return x[0];
}

// phi of a block's `len` positions of q and k (c numbers each) into qf, kf (`mapped`: q and k are
// phi(q), phi(k) already, mapped by PyTorch, and are copied): phi(k) zero at positions >= `keys`
// (past the row's key length) and both zero in the columns >= `features` (C's padding).
template <typename T, int B>
INLINE void map_block(int64_t len, int64_t c, int64_t features, int64_t keys, bool mapped, const T* q, const T* k,
                      T* qf, T* kf) {
  const int64_t valid = std::min(len, std::max<int64_t>(keys, 0));
  if (mapped) {
    std::copy(q, q + len * c, qf);
    std::copy(k, k + valid * c, kf);
  } else {
    elu_plus_one<T, B>(q, len * c, qf);
    elu_plus_one<T, B>(k, valid * c, kf);
  }
  std::fill(kf + valid * c, kf + len * c, T(0));
  if (features < c)
    for (int64_t t = 0; t < len; ++t) std::fill(qf + t * c + features, qf + (t + 1) * c, T(0)),
                                      std::fill(kf + t * c + features, kf + (t + 1) * c, T(0));
}

// Whether the passes scale by 1 / den_t themselves (one product per position and
// register tile) rather than read a copy of phi(q) or g divided by den (C / W or M / W products and
// stores per position): at most two row tiles each way, where the copy was the larger cost.
template <typename T, int B>
INLINE bool scaled_by_inverse(int64_t c, int64_t m) {
  return c <= 2 * Vec<T, B>::kRows && m <= 2 * Vec<T, B>::kRows;
}
template <typename T>
bool scaled_by_inverse(int bytes, int64_t c, int64_t m) {
  return bytes == 64 ? scaled_by_inverse<T, 64>(c, m) : bytes == 32 ? scaled_by_inverse<T, 32>(c, m)
                                                                    : scaled_by_inverse<T, 16>(c, m);
}

// A vector of `count` registers carried along positions (z, r): in registers where NC > 0 (NC = count,
// known when compiled: unrolled loops keep it there), else in memory. As a store and a reload per
// position it made a chain of store-to-load forwards, one per position, that the short passes of a
// small head size could not hide.
template <typename V, int NC>
struct Carried {
  V regs[NC > 0 ? NC : 1];
  V* x;
  explicit Carried(int64_t count)
      : x(NC > 0 ? regs : static_cast<V*>(std::aligned_alloc(sizeof(V), count * sizeof(V)))) {
    TORCH_CHECK(x != nullptr, "out of memory");
  }
  ~Carried() {
    if (NC == 0) std::free(x);
  }
  Carried(const Carried&) = delete;
  Carried& operator=(const Carried&) = delete;
};

// The forward of one block of `len` positions: qf, kf from map_block; z (c) and the state tile's
// columns [col0, col1) of s (c x m) carried across blocks; den (len) written unless null. The pass
// needs phi(q_t) / den_t: at small C and M (scaled_by_inverse) scratch (len) takes 1 / den_t, by which
// the pass scales its sums (one product per tile and position), else scratch (len x c) takes
// phi(q_t) / den_t (C / W products and stores per position, fewer than the tiles' at large C, M).
// den in groups of W positions: the W products phi(q_t) * z_t summed at once (lane_sums), one division for W.
template <typename T, int B, int NC>
INLINE void attention_forward_block(int64_t len, int64_t c, int64_t m, const T* v, const T* qf, const T* kf, T eps,
                                    T* z, T* den, T* s, T* scratch, T* out, int64_t col0, int64_t col1) {
  using V = typename Vec<T, B>::type;
  constexpr int W = Vec<T, B>::kWidth;
  const int64_t nc = NC > 0 ? NC : c / W;
  const bool scaled = scaled_by_inverse<T, B>(c, m);
  Carried<V, NC> carried(nc);
  V* zr = carried.x;
#pragma GCC unroll 4
  for (int64_t i = 0; i < nc; ++i) zr[i] = load<T, B>(z + i * W);
  for (int64_t t0 = 0; t0 < len; t0 += W) {
    const int count = static_cast<int>(std::min<int64_t>(W, len - t0));
    V products[W];
#pragma GCC unroll 16
    for (int u = 0; u < W; ++u) {
      V sum = V{};
      const int64_t t = t0 + u;
      if (u < count)
#pragma GCC unroll 4
        for (int64_t i = 0; i < nc; ++i) {
          zr[i] += load<T, B>(kf + t * c + i * W);
          sum += load<T, B>(qf + t * c + i * W) * zr[i];
        }
      products[u] = sum;
    }
    const V d = lane_sums<T, B>(products) + eps;  // lanes from count on: eps, unused
    T inverse[W];
    store<T, B>(inverse, T(1) / d);
    if (scaled) {
      if (count == W) store<T, B>(scratch + t0, load<T, B>(inverse));
      else std::copy(inverse, inverse + count, scratch + t0);
    } else {
      for (int u = 0; u < count; ++u)
#pragma GCC unroll 4
        for (int64_t i = 0; i < nc; ++i)
          store<T, B>(scratch + (t0 + u) * c + i * W, load<T, B>(qf + (t0 + u) * c + i * W) * inverse[u]);
    }
    if (den != nullptr) {
      if (count == W) store<T, B>(den + t0, d);
      else for (int u = 0; u < count; ++u) den[t0 + u] = d[u];
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < nc; ++i) store<T, B>(z + i * W, zr[i]);
  if (scaled) pass<T, B>(0, len, false, c, m, kf, v, qf, out, s, col0, col1, false, nullptr, scratch);
  else pass<T, B>(0, len, false, c, m, kf, v, scratch, out, s, col0, col1);
}

// inv_t = 1 / den_t and gd_t = -(g_t . out_t) / den_t of one block (len rounded up to W numbers each),
// in groups of W positions as the forward's den, and gn_t = g_t inv_t (m numbers each) unless gn is null:
// at small C and M (scaled_by_inverse) the passes take g with inv_t as a scale instead.
template <typename T, int B>
INLINE void output_gradients(int64_t len, int64_t m, const T* g, const T* out, const T* den, T* inv, T* gd, T* gn) {
  using V = typename Vec<T, B>::type;
  constexpr int W = Vec<T, B>::kWidth;
  for (int64_t t0 = 0; t0 < len; t0 += W) {
    const int count = static_cast<int>(std::min<int64_t>(W, len - t0));
    V products[W];
    T inverse[W];
    for (int u = 0; u < W; ++u) {
      V sum = V{};
      for (int64_t i = 0, t = t0 + u; u < count && i < m; i += W) {
        // the block's first touch of g and out: asked for ahead as the passes do
        __builtin_prefetch(g + t * m + i + kAheadBytes / sizeof(T), 0, 3);
        __builtin_prefetch(out + t * m + i + kAheadBytes / sizeof(T), 0, 3);
        sum += load<T, B>(g + t * m + i) * load<T, B>(out + t * m + i);
      }
      products[u] = sum;
      inverse[u] = u < count ? den[t0 + u] : T(1);
    }
    const V scale = T(1) / load<T, B>(inverse);
    store<T, B>(inv + t0, scale);
    store<T, B>(gd + t0, -lane_sums<T, B>(products) * scale);
    if (gn != nullptr)
      for (int u = 0; u < count; ++u)
        for (int64_t i = 0, t = t0 + u; i < m; i += W) store<T, B>(gn + t * m + i, load<T, B>(g + t * m + i) * inv[t]);
  }
}

// grad q of one block: z (c, the saved z at the block start; advanced here) gives the normaliser's
// term gd_t z_t, then the pass from st = S^T (m x c) adds S_t g_t inv_t and applies phi' (given phi's
// values in `derivative`, qf; null for mapped inputs, whose gradient is the one wanted).
template <typename T, int B, int NC>
INLINE void attention_grad_q_block(int64_t len, int64_t c, int64_t m, const T* v, const T* qf, const T* kf,
                                   const T* g, const T* inv, const T* gd, const T* derivative, T* z, T* st, T* gq) {
  using V = typename Vec<T, B>::type;
  constexpr int W = Vec<T, B>::kWidth;
  const int64_t nc = NC > 0 ? NC : c / W;
  Carried<V, NC> carried(nc);
  V* zr = carried.x;
#pragma GCC unroll 4
  for (int64_t i = 0; i < nc; ++i) zr[i] = load<T, B>(z + i * W);
  for (int64_t t = 0; t < len; ++t) {
    const V scale = V{} + gd[t];
#pragma GCC unroll 4
    for (int64_t i = 0; i < nc; ++i) {
      zr[i] += load<T, B>(kf + t * c + i * W);
      store<T, B>(gq + t * c + i * W, zr[i] * scale);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < nc; ++i) store<T, B>(z + i * W, zr[i]);
  pass<T, B>(0, len, false, m, c, v, kf, g, gq, st, 0, c, true, derivative, inv, kScaleSum);
}

// grad v and grad k of one block, positions reversed: R (c x m), rt = R^T (m x c) and r (c) carried
// from the block after; gn_t = g_t inv_t as the b operand of R's update (grad v) and phi(q_t) inv_t
// as that of R^T's (grad k); phi' from `derivative` (kf, or null) as grad q's.
template <typename T, int B, int NC>
INLINE void attention_grad_kv_block(int64_t len, int64_t c, int64_t m, const T* v, const T* qf, const T* kf,
                                    const T* g, const T* inv, const T* gd, const T* derivative, T* r_state, T* rt,
                                    T* r, T* gk, T* gv) {
  using V = typename Vec<T, B>::type;
  constexpr int W = Vec<T, B>::kWidth;
  pass<T, B>(0, len, true, c, m, qf, g, kf, gv, r_state, 0, m, false, nullptr, inv, kScaleB);
  const int64_t nc = NC > 0 ? NC : c / W;
  Carried<V, NC> carried(nc);
  V* rr = carried.x;
#pragma GCC unroll 4
  for (int64_t i = 0; i < nc; ++i) rr[i] = load<T, B>(r + i * W);
  for (int64_t t = len - 1; t >= 0; --t) {
    const V scale = V{} + gd[t];
#pragma GCC unroll 4
    for (int64_t i = 0; i < nc; ++i) {
      rr[i] += scale * load<T, B>(qf + t * c + i * W);
      store<T, B>(gk + t * c + i * W, rr[i]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < nc; ++i) store<T, B>(r + i * W, rr[i]);
  pass<T, B>(0, len, true, m, c, g, qf, v, gk, rt, 0, c, true, derivative, inv, kScaleB);
}

// The block functions above with the carried vector's register count fixed where it is small (C <= 4 W)
// (no lambda: it would not inherit the caller's target attribute, which the inlined loops need)
#define WITH_CARRIED(FUNCTION)                                                                  \
  template <typename T, int B, typename... A>                                                 \
  INLINE void FUNCTION##_carried(int64_t len, int64_t c, A... a) {                             \
    switch (c / Vec<T, B>::kWidth) {                                                          \
      case 1: return FUNCTION<T, B, 1>(len, c, a...);                                         \
      case 2: return FUNCTION<T, B, 2>(len, c, a...);                                         \
      case 3: return FUNCTION<T, B, 3>(len, c, a...);                                         \
      case 4: return FUNCTION<T, B, 4>(len, c, a...);                                         \
      default: return FUNCTION<T, B, 0>(len, c, a...);                                        \
    }                                                                                         \
  }
WITH_CARRIED(attention_forward_block)
WITH_CARRIED(attention_grad_q_block)
WITH_CARRIED(attention_grad_kv_block)
#undef WITH_CARRIED

#define DEFINE_FOR(NAME, ATTR, B)                                                                                 \
  template <typename T, typename... A> ATTR void map_block_##NAME(A... a) { map_block<T, B>(a...); }             \
  template <typename T, typename... A> ATTR void forward_block_##NAME(A... a) {                                  \
    attention_forward_block_carried<T, B>(a...);                                                                          \
  }                                                                                                               \
  template <typename T, typename... A> ATTR void output_gradients_##NAME(A... a) { output_gradients<T, B>(a...); } \
  template <typename T, typename... A> ATTR void grad_q_block_##NAME(A... a) { attention_grad_q_block_carried<T, B>(a...); } \
  template <typename T, typename... A> ATTR void grad_kv_block_##NAME(A... a) { attention_grad_kv_block_carried<T, B>(a...); }
DEFINE_FOR(avx512, TARGET_AVX512, 64)
DEFINE_FOR(avx2, TARGET_AVX2, 32)
DEFINE_FOR(baseline, , 16)
#undef DEFINE_FOR

// The block functions in the version for registers of `bytes` (width_bytes).
#define DISPATCH(FUNCTION)                                                                  \
  template <typename T, typename... A>                                                      \
  void run_##FUNCTION(int bytes, A... a) {                                                  \
    switch (bytes) {                                                                        \
      case 64: return FUNCTION##_avx512<T>(a...);                                           \
      case 32: return FUNCTION##_avx2<T>(a...);                                             \
      default: return FUNCTION##_baseline<T>(a...);                                         \
    }                                                                                       \
  }
DISPATCH(map_block)
DISPATCH(forward_block)
DISPATCH(output_gradients)
DISPATCH(grad_q_block)
DISPATCH(grad_kv_block)
#undef DISPATCH

// Where each item's positions and saved blocks lie: items (segment, row), segment s = positions
// [start[s], start[s] + length[s]) of every row, its blocks from first_block[s] of the row's saved ones.
struct Segments {
  std::vector<int64_t> start, length, first_block;
  int64_t count() const { return static_cast<int64_t>(start.size()); }
};

// Saved blocks per row: sum over segments of ceil(length / kBlock), at most this bound, which
// depends on shapes alone (what the operator's fake function can compute): ceil(a) + ceil(b) <=
// ceil(a + b) + 1.
int64_t saved_blocks(int64_t n, int64_t segments) { return (n + kBlock - 1) / kBlock + std::max<int64_t>(segments - 1, 0); }

Segments segments_of(const c10::optional<at::Tensor>& cu_seqlens, int64_t n) {
  Segments s;
  if (!cu_seqlens) {
    s.start = {0}, s.length = {n}, s.first_block = {0};
    return s;
  }
  const at::Tensor cu = cu_seqlens->to(at::kLong).contiguous();
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be [0, n_1, n_1 + n_2, ..., T] (1-d, >= 2 entries)");
  const int64_t* e = cu.data_ptr<int64_t>();
  TORCH_CHECK(e[0] == 0 && e[cu.size(0) - 1] == n, "cu_seqlens must run from 0 to the sequence length ", n);
  int64_t blocks = 0;
  for (int64_t i = 0; i + 1 < cu.size(0); ++i) {
    TORCH_CHECK(e[i + 1] >= e[i], "cu_seqlens must not decrease");
    s.start.push_back(e[i]), s.length.push_back(e[i + 1] - e[i]), s.first_block.push_back(blocks);
    blocks += (e[i + 1] - e[i] + kBlock - 1) / kBlock;
  }
  return s;
}

// Each row's key length (positions of the row from it on are masked keys): key_lengths (rows,), or n.
std::vector<int64_t> key_counts(const c10::optional<at::Tensor>& key_lengths, int64_t rows, int64_t n) {
  if (!key_lengths) return std::vector<int64_t>(rows, n);
  const at::Tensor lengths = key_lengths->to(at::kLong).contiguous();
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == rows, "key lengths must be one per row");
  return std::vector<int64_t>(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + rows);
}

at::Tensor state_or_zeros(const c10::optional<at::Tensor>& given, at::IntArrayRef sizes, const at::Tensor& like) {
  return given ? given->to(like.scalar_type()).reshape(sizes).clone(at::MemoryFormat::Contiguous)
               : at::zeros(sizes, like.options());
}

// -> (out (rows, N, M), den (rows, N), S_N (items, C, M), z_N (items, C), states (rows, blocks, C, M),
// z states (rows, blocks, C), phi(q), phi(k) (rows, N, C)); q, k (rows, N, C) unmapped (phi = elu + 1
// here), or with `mapped` phi(q), phi(k) of any feature map; C's columns >= `features` padding (phi 0
// there, and phi(k) 0 at masked keys).
std::vector<at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const c10::optional<at::Tensor>& s0, const c10::optional<at::Tensor>& z0,
                                          const c10::optional<at::Tensor>& cu_seqlens,
                                          const c10::optional<at::Tensor>& key_lengths, int64_t features, double eps,
                                          bool mapped) {
  check(q, q, -1, "q");
  check(k, q, q.size(2), "k");
  check(v, q, -1, "v");
  const int64_t rows = q.size(0), n = q.size(1), c = q.size(2), m = v.size(2);
  TORCH_CHECK(fits(c, m, q.scalar_type()), "C and M must be multiples of the register width");
  TORCH_CHECK(features >= 0 && features <= c, "features must lie in [0, C]");
  const Segments seg = segments_of(cu_seqlens, n);
  const std::vector<int64_t> keys = key_counts(key_lengths, rows, n);
  const int64_t items = seg.count() * rows, blocks = saved_blocks(n, seg.count());
  auto out = empty_outputs({rows, n, m}, q.options());
  auto den = at::empty({rows, n}, q.options());
  // z_0 apart from z_N: an item's column pieces each start from z_0, and the first writes z_N
  at::Tensor s_final = state_or_zeros(s0, {items, c, m}, q), z_first = state_or_zeros(z0, {items, c}, q);
  auto z_final = at::empty({items, c}, q.options());
  auto states = empty_outputs({rows, blocks, c, m}, q.options());
  auto z_states = at::empty({rows, blocks, c}, q.options());
  auto phi_q = empty_outputs({rows, n, c}, q.options()), phi_k = empty_outputs({rows, n, c}, q.options());
  // the bound's spare blocks (packed sequences) are zero, not whatever the buffer held: a result is a value
  const int64_t used = seg.count() == 0 ? 0 : seg.first_block.back() + (seg.length.back() + kBlock - 1) / kBlock;
  states.narrow(1, used, blocks - used).zero_(), z_states.narrow(1, used, blocks - used).zero_();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention_forward", [&] {
    using T = scalar_t;
    const int bytes = width_bytes(c, m, sizeof(T));
    const int64_t w = bytes / sizeof(T), tiles = m / w, threads = at::get_num_threads();
    // Tasks of whole items, else of an item's columns in one piece per thread (or per register tile): a
    // task runs its column tiles block by block, so only the first reads q and k from memory (one task
    // per (item, tile) read them once per tile, slower on long rows). Each piece maps the block and
    // walks z itself; the first writes den, z and the maps, the others map into scratch.
    const int64_t pieces = rows_share_out(items) ? 1 : tiles % threads == 0 ? threads : tiles;
    const int64_t span = m / pieces;
    at::parallel_for(0, items * pieces, grain(items * pieces, 4 * rows * n * c * m), [&](int64_t begin, int64_t end) {
      // one buffer, the parts a cache line apart from a multiple of 4 KiB (addresses that agree in their
      // low 12 bits make a load wait on an unrelated store)
      const int64_t part = kBlock * c + 16;
      std::vector<T> scratch(3 * part + c + 16);
      T *qs = scratch.data(), *q_scratch = qs + part, *k_scratch = q_scratch + part, *z = k_scratch + part;
      for (int64_t e = begin; e < end; ++e) {
        const int64_t item = e / pieces, j = e % pieces * span, s = item / rows, row = item % rows;
        const bool first = j == 0;
        T* state = s_final.data_ptr<T>() + item * c * m;
        const T* z_in = z_first.data_ptr<T>() + item * c;
        std::copy(z_in, z_in + c, z);
        for (int64_t t0 = 0, i = 0; t0 < seg.length[s]; t0 += kBlock, ++i) {
          const int64_t len = std::min(kBlock, seg.length[s] - t0), at = row * n + seg.start[s] + t0;
          const int64_t saved = row * blocks + seg.first_block[s] + i;
          T* saved_s = states.data_ptr<T>() + saved * c * m;
          for (int64_t x = 0; x < c; ++x) std::memcpy(saved_s + x * m + j, state + x * m + j, span * sizeof(T));
          if (first) std::copy(z, z + c, z_states.data_ptr<T>() + saved * c);
          T* qf = first ? phi_q.data_ptr<T>() + at * c : q_scratch;
          T* kf = first ? phi_k.data_ptr<T>() + at * c : k_scratch;
          run_map_block<T>(bytes, len, c, features, keys[row] - seg.start[s] - t0, mapped, q.data_ptr<T>() + at * c,
                           k.data_ptr<T>() + at * c, qf, kf);
          run_forward_block<T>(bytes, len, c, m, static_cast<const T*>(v.data_ptr<T>() + at * m),
                               static_cast<const T*>(qf), static_cast<const T*>(kf), static_cast<T>(eps), z,
                               first ? den.data_ptr<T>() + at : static_cast<T*>(nullptr), state, qs,
                               out.data_ptr<T>() + at * m, j, j + span);
        }
        if (first) std::copy(z, z + c, z_final.data_ptr<T>() + item * c);
      }
    });
  });
  return {out, den, s_final, z_final, states, z_states, phi_q, phi_k};
}

// -> (grad q, grad k, grad v, grad S_0 (items, C, M), grad z_0 (items, C)) from the forward's maps
// phi(q), phi(k) (masked keys and padding columns already 0 in them), v, out, den and saved states,
// the gradient of out and those of S_N, z_N (or None); `mapped` (the forward's): grad q and grad k
// are those of phi(q) and phi(k), without elu's derivative.
std::vector<at::Tensor> attention_backward(const at::Tensor& phi_q, const at::Tensor& phi_k, const at::Tensor& v,
                                           const at::Tensor& out, const at::Tensor& den, const at::Tensor& g,
                                           const at::Tensor& states, const at::Tensor& z_states,
                                           const c10::optional<at::Tensor>& cu_seqlens,
                                           const c10::optional<at::Tensor>& grad_s, const c10::optional<at::Tensor>& grad_z,
                                           bool mapped) {
  const at::Tensor& q = phi_q;  // shapes and dtype
  check(q, q, -1, "phi(q)");
  check(phi_k, q, q.size(2), "phi(k)");
  check(v, q, -1, "v");
  check(out, q, v.size(2), "out");
  check(g, q, v.size(2), "grad");
  const int64_t rows = q.size(0), n = q.size(1), c = q.size(2), m = v.size(2);
  TORCH_CHECK(fits(c, m, q.scalar_type()), "C and M must be multiples of the register width");
  const Segments seg = segments_of(cu_seqlens, n);
  const int64_t items = seg.count() * rows, blocks = saved_blocks(n, seg.count());
  TORCH_CHECK(den.is_contiguous() && den.sizes() == at::IntArrayRef({rows, n}) && den.scalar_type() == q.scalar_type(),
              "den does not fit the inputs");
  TORCH_CHECK(states.is_contiguous() && states.sizes() == at::IntArrayRef({rows, blocks, c, m}) &&
              z_states.is_contiguous() && z_states.sizes() == at::IntArrayRef({rows, blocks, c}) &&
              states.scalar_type() == q.scalar_type() && z_states.scalar_type() == q.scalar_type(),
              "states do not fit the inputs");
  auto gq = empty_outputs(q.sizes(), q.options()), gk = empty_outputs(q.sizes(), q.options());
  auto gv = empty_outputs(v.sizes(), v.options());
  at::Tensor gs = state_or_zeros(grad_s, {items, c, m}, q), gz = state_or_zeros(grad_z, {items, c}, q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention_backward", [&] {
    using T = scalar_t;
    const int bytes = width_bytes(c, m, sizeof(T));
    // Whole items where they share out evenly, each walking its blocks from last to first with all
    // three passes on one block; else two tasks per item (grad q; grad v with grad k), which read the
    // inputs from memory twice but keep two threads busy on one item, each scaling g itself.
    const bool fused = rows_share_out(items);
    const int64_t tasks = fused ? items : 2 * items;
    at::parallel_for(0, tasks, grain(tasks, 12 * rows * n * c * m), [&](int64_t begin, int64_t end) {
      // gn_t = g_t / den_t written out only where the passes do not scale by 1 / den_t themselves
      const bool scaled = scaled_by_inverse<T>(bytes, c, m);
      std::vector<T> inv(kBlock), gd(kBlock), gn(scaled ? 0 : kBlock * m), st(c * m), rt(c * m), z(c);
      for (int64_t e = begin; e < end; ++e) {
        const int64_t item = fused ? e : e / 2, s = item / rows, row = item % rows;
        const bool do_q = fused || e % 2 == 0, do_kv = fused || e % 2 == 1;
        T* r_state = gs.data_ptr<T>() + item * c * m;  // R, from grad S_N to grad S_0
        T* r = gz.data_ptr<T>() + item * c;           // r, from grad z_N to grad z_0
        if (do_kv) transpose(r_state, c, m, rt.data());
        const int64_t count = (seg.length[s] + kBlock - 1) / kBlock;
        for (int64_t i = count - 1; i >= 0; --i) {
          const int64_t t0 = i * kBlock, len = std::min(kBlock, seg.length[s] - t0);
          const int64_t at = row * n + seg.start[s] + t0, saved = row * blocks + seg.first_block[s] + i;
          run_output_gradients<T>(bytes, len, m, static_cast<const T*>(g.data_ptr<T>() + at * m),
                                  static_cast<const T*>(out.data_ptr<T>() + at * m),
                                  static_cast<const T*>(den.data_ptr<T>() + at), inv.data(), gd.data(),
                                  scaled ? static_cast<T*>(nullptr) : gn.data());
          const T *vp = v.data_ptr<T>() + at * m, *gdp = gd.data();
          const T *gp = scaled ? g.data_ptr<T>() + at * m : gn.data(), *ip = scaled ? inv.data() : nullptr;
          const T *qfp = phi_q.data_ptr<T>() + at * c, *kfp = phi_k.data_ptr<T>() + at * c;
          if (do_q) {
            transpose(states.data_ptr<T>() + saved * c * m, c, m, st.data());
            const T* zs = z_states.data_ptr<T>() + saved * c;
            std::copy(zs, zs + c, z.data());
            run_grad_q_block<T>(bytes, len, c, m, vp, qfp, kfp, gp, ip, gdp, mapped ? nullptr : qfp, z.data(), st.data(),
                                gq.data_ptr<T>() + at * c);
          }
          if (do_kv)
            run_grad_kv_block<T>(bytes, len, c, m, vp, qfp, kfp, gp, ip, gdp, mapped ? nullptr : kfp, r_state, rt.data(), r,
                                 gk.data_ptr<T>() + at * c, gv.data_ptr<T>() + at * m);
        }
      }
    });
  });
  return {gq, gk, gv, gs, gz};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Causal linear attention on CPU as a recurrence (linformer_lab/ops/cpu/causal_recurrence.cpp)";
  module.def("fits", [](int64_t c, int64_t m, const at::Tensor& like) { return fits(c, m, like.scalar_type()); },
             "whether (C, M) in like's dtype runs here (multiples of the register width)");
  module.def("block", [] { return kBlock; }, "positions per saved forward state");
  module.def("set_pool_limit", [](int64_t bytes) { return OutputPool::get().set_limit(bytes); },
             "the most bytes of freed large outputs kept for reuse (0: none); returns the limit before");
  module.def("pool_stats", [] { return OutputPool::get().stats(); },
             "[bytes held free, buffers handed out again, buffers made fresh] of the output pool");
  module.def("width", [](int64_t c, int64_t m, const at::Tensor& like) { return width_bytes(c, m, like.element_size()); },
             "the register width (bytes) the loops use for (C, M) in like's dtype; 0: does not run here");
  module.def("attention_forward", &attention_forward,
             "(q, k, v, S_0, z_0, cu_seqlens, key_lengths (per row), features, eps, mapped), each optional one or None "
             "-> [out, den, S_N, z_N, states, z_states, phi(q), phi(k)]: causal attention, phi = elu + 1 fused unless "
             "mapped (q, k are phi(q), phi(k))");
  module.def("attention_backward", &attention_backward,
             "(phi(q), phi(k), v, out, den, grad_out, states, z_states, cu_seqlens, grad S_N, grad z_N, mapped) "
             "-> [gq, gk, gv, grad S_0, grad z_0]");
  module.def("saved_blocks", &saved_blocks, "(N, segments) -> the blocks of states the fused forward saves per row");
  bind_instruction_set(module);
}
