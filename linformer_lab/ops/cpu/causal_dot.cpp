// The causal numerator of linear attention (eq. 9) on CPU, forward and backward (eq. 13-15):
//
//   out_i = q_i^T (S_0 + sum_{j <= i} k_j v_j^T)      q, k (rows, N, C), v (rows, N, M)
//
// chunked as linformer_lab/ops/linear_attention/chunk.py (the pure-PyTorch reference): per chunk of
// L positions an (L x L) masked product inside the chunk plus the product with the state S before
// it, each a small cache-resident loop nest. Threads split the rows when they share out evenly
// (each row runs its chunks in order with a running state), else the chunks (each chunk's K^T V,
// a prefix sum of chunk states, then the outputs, all in parallel). The backward is the same with
// suffix states R = grad S_N + sum_{j >= i} q_j g_j^T. Kept between the passes: the inputs, and
// the (N / L, C, M) chunk states only where chunks ran in parallel; otherwise the backward
// recomputes one row's (one K^T V per chunk) per thread. O(N max(C, M)) for L >= min(C, M).
//
// Built without -march (one cached build serves every x86-64 CPU), so the hot loops are compiled
// three times, for AVX-512, AVX2 + FMA and the SSE2 baseline (target attributes), and the CPU's
// best is picked when the library loads. Built by linformer_lab/ops/cpu/__init__.py; cpu_kernel.py calls it where
// causal_recurrence.cpp does not run (C or M not a multiple of 4 floats / 2 doubles, or switched off).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

// The hot loops are templates over B, the bytes of one SIMD register (GCC's vector extension):
// compiled once per instruction set with B = 64 (AVX-512), 32 (AVX2 + FMA) and 16 (the x86-64
// baseline, SSE2), each under its own target attribute, and picked at run time (`Isa`, simd.h).
// A register tile is 16 floats (8 doubles) wide in every version: one AVX-512 register, two AVX2
// ones, four SSE ones per row. (64-byte vectors lowered to AVX2 spill registers: much slower.)
template <typename T, int B>
struct Vec {
  using type = typename Register<T, B>::type;
  static constexpr int kPerTile = 64 / B;             // registers per row of a tile
  static constexpr int kWidth = 64 / sizeof(T);       // columns of a tile
  static constexpr int kRows = B == 16 ? 3 : 6;       // rows of a tile: 6 (AVX-512), 12 (AVX2), 12 (SSE) accumulators
};

// c[r][j] (+)= sum_{p in [p0, p1)} a[r * ar + p * ap] * b[p * ldb + j] for R rows and one tile
// width of columns: the accumulators stay in registers over p.
template <typename T, int B, int R>
INLINE void tile(const T* a, int64_t ar, int64_t ap, const T* b, int64_t ldb, T* c, int64_t ldc, int64_t p0,
                 int64_t p1, bool accumulate) {
  using V = typename Vec<T, B>::type;
  constexpr int kPer = Vec<T, B>::kPerTile, kLanes = B / sizeof(T);
  V acc[R][kPer];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < kPer; ++u) acc[r][u] = accumulate ? load<T, B>(c + r * ldc + u * kLanes) : V{};
  for (int64_t p = p0; p < p1; ++p) {
    V bp[kPer];
#pragma GCC unroll 4
    for (int u = 0; u < kPer; ++u) bp[u] = load<T, B>(b + p * ldb + u * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const T x = a[r * ar + p * ap];
#pragma GCC unroll 4
      for (int u = 0; u < kPer; ++u) acc[r][u] += x * bp[u];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < kPer; ++u) store<T, B>(c + r * ldc + u * kLanes, acc[r][u]);
}

// The columns past the last full tile: the same sum with a run-time width.
template <typename T, int R>
INLINE void tail(const T* a, int64_t ar, int64_t ap, const T* b, int64_t ldb, T* c, int64_t ldc, int64_t p0,
                 int64_t p1, int64_t w, bool accumulate) {
  for (int r = 0; r < R; ++r) {
    T* cr = c + r * ldc;
    if (!accumulate)
      for (int64_t j = 0; j < w; ++j) cr[j] = T(0);
    for (int64_t p = p0; p < p1; ++p) {
      const T x = a[r * ar + p * ap];
      const T* bp = b + p * ldb;
      for (int64_t j = 0; j < w; ++j) cr[j] += x * bp[j];
    }
  }
}

template <typename T, int B, int R>
INLINE void row_block(const T* a, int64_t ar, int64_t ap, const T* b, int64_t ldb, T* c, int64_t ldc, int64_t n,
                      int64_t p0, int64_t p1, bool accumulate) {
  constexpr int width = Vec<T, B>::kWidth;
  int64_t j = 0;
  for (; j + width <= n; j += width) tile<T, B, R>(a, ar, ap, b + j, ldb, c + j, ldc, p0, p1, accumulate);
  if (j < n) tail<T, R>(a, ar, ap, b + j, ldb, c + j, ldc, p0, p1, n - j, accumulate);
}

// Which p a block of rows [i, i + r) sums over: all, or (triangular operands) only p < i + r
// (a lower-triangular left operand) or p >= i (an upper-triangular one, the transposed lower).
enum Range { kAll, kLower, kUpper };

// C (rows x n) (+)= A (rows x K) B (K x n), A(i, p) = a[i * ar + p * ap], B and C row-major.
// With kLower / kUpper, A is triangular and its zero part is skipped.
template <typename T, int B>
INLINE void gemm(int64_t rows, int64_t n, int64_t k, const T* a, int64_t ar, int64_t ap, const T* b, int64_t ldb,
                 T* c, int64_t ldc, Range range, bool accumulate) {
  constexpr int64_t kRows = Vec<T, B>::kRows;
  for (int64_t i = 0; i < rows; i += kRows) {
    const int r = static_cast<int>(std::min<int64_t>(kRows, rows - i));
    const int64_t p0 = range == kUpper ? i : 0, p1 = range == kLower ? std::min(k, i + r) : k;
    const T* ai = a + i * ar;
    T* ci = c + i * ldc;
#define ROWS(R) case R: row_block<T, B, R>(ai, ar, ap, b, ldb, ci, ldc, n, p0, p1, accumulate); break;
    switch (r) { ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) default: ROWS(1) }  // R: a compile-time tile height
#undef ROWS
  }
}

// dst (cols x rows) = src (rows x cols)^T: right operands must be row-major over their columns.
template <typename T>
INLINE void transpose(const T* src, int64_t rows, int64_t cols, T* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
}

// s (l x l) = tril(x y^T) for x, y (l x d); yt (d x l) is scratch. Only tiles on or below the
// diagonal are computed; the entries above it are then zeroed.
template <typename T, int B>
INLINE void masked_scores(const T* x, const T* y, int64_t l, int64_t d, T* yt, T* s) {
  transpose(y, l, d, yt);
  constexpr int64_t kRows = Vec<T, B>::kRows, kWidth = Vec<T, B>::kWidth;
  for (int64_t i = 0; i < l; i += kRows) {
    const int64_t r = std::min<int64_t>(kRows, l - i);
    // whole tiles of columns up to the diagonal (a run-time tail would be scalar code)
    const int64_t cols = std::min(l, (i + r + kWidth - 1) / kWidth * kWidth);
    gemm<T, B>(r, cols, d, x + i * d, d, 1, yt, l, s + i * l, l, kAll, false);
    for (int64_t ii = i; ii < i + r; ++ii) std::fill(s + ii * l + ii + 1, s + (ii + 1) * l, T(0));
  }
}

// The scratch of one thread: a few (L x L), (L x D) and (D x D) buffers, cache-resident.
template <typename T>
struct Scratch {
  std::vector<T> t1, t2, s1, s2, m1, m2;
  Scratch(int64_t l, int64_t c, int64_t m)
      : t1(std::max(c, m) * l), t2(std::max(c, m) * l), s1(l * l), s2(l * l), m1(c * m), m2(c * m) {}
};

// out (l x M) = tril(Q K^T) V + Q S for one chunk; s (C x M) is the state before the chunk.
template <typename T, int B>
INLINE void chunk_forward(int64_t l, int64_t c, int64_t m, const T* q, const T* k, const T* v, const T* s, T* out,
                          Scratch<T>& w) {
  masked_scores<T, B>(q, k, l, c, w.t1.data(), w.s1.data());
  gemm<T, B>(l, m, c, q, c, 1, s, m, out, m, kAll, false);
  gemm<T, B>(l, m, l, w.s1.data(), l, 1, v, m, out, m, kLower, true);
}

// u (C x M) (+)= x^T y for one chunk's x (l x C), y (l x M): K^T V (forward) or Q^T G (backward).
template <typename T, int B>
INLINE void chunk_outer(int64_t l, int64_t c, int64_t m, const T* x, const T* y, T* u, bool accumulate) {
  gemm<T, B>(c, m, l, x, 1, c, y, m, u, m, kAll, accumulate);
}

// Gradients of one chunk (eq. 13-15), s = S before the chunk, r = R after it (C x M):
//   grad q = tril(G V^T) K + G S^T,  grad k = tril(G V^T)^T Q + V R^T,  grad v = tril(Q K^T)^T G + K R.
template <typename T, int B>
INLINE void chunk_backward(int64_t l, int64_t c, int64_t m, const T* q, const T* k, const T* v, const T* g,
                           const T* s, const T* r, T* gq, T* gk, T* gv, Scratch<T>& w) {
  T *gv_scores = w.s1.data(), *qk_scores = w.s2.data(), *st = w.m1.data(), *rt = w.m2.data();
  masked_scores<T, B>(g, v, l, m, w.t1.data(), gv_scores);
  masked_scores<T, B>(q, k, l, c, w.t2.data(), qk_scores);
  transpose(s, c, m, st);
  transpose(r, c, m, rt);
  gemm<T, B>(l, c, m, g, m, 1, st, c, gq, c, kAll, false);
  gemm<T, B>(l, c, l, gv_scores, l, 1, k, c, gq, c, kLower, true);
  gemm<T, B>(l, c, m, v, m, 1, rt, c, gk, c, kAll, false);
  gemm<T, B>(l, c, l, gv_scores, 1, l, q, c, gk, c, kUpper, true);
  gemm<T, B>(l, m, c, k, c, 1, r, m, gv, m, kAll, false);
  gemm<T, B>(l, m, l, qk_scores, 1, l, g, m, gv, m, kUpper, true);
}

// The entry points of the parallel loops: one machine-code version per instruction set, and a
// run-time choice among them (simd.h's kIsa).
#define DEFINE_FOR(NAME, ATTR, B)                                                                             \
  template <typename T>                                                                                       \
  ATTR void forward_##NAME(int64_t l, int64_t c, int64_t m, const T* q, const T* k, const T* v, const T* s,   \
                           T* out, Scratch<T>& w) {                                                           \
    chunk_forward<T, B>(l, c, m, q, k, v, s, out, w);                                                         \
  }                                                                                                           \
  template <typename T>                                                                                       \
  ATTR void outer_##NAME(int64_t l, int64_t c, int64_t m, const T* x, const T* y, T* u, bool accumulate) {    \
    chunk_outer<T, B>(l, c, m, x, y, u, accumulate);                                                          \
  }                                                                                                           \
  template <typename T>                                                                                       \
  ATTR void backward_##NAME(int64_t l, int64_t c, int64_t m, const T* q, const T* k, const T* v, const T* g,  \
                            const T* s, const T* r, T* gq, T* gk, T* gv, Scratch<T>& w) {                     \
    chunk_backward<T, B>(l, c, m, q, k, v, g, s, r, gq, gk, gv, w);                                           \
  }
DEFINE_FOR(avx512, TARGET_AVX512, 64)
DEFINE_FOR(avx2, TARGET_AVX2, 32)
DEFINE_FOR(baseline, , 16)
#undef DEFINE_FOR

// forward_chunk, outer_chunk, backward_chunk: the version of the CPU's instruction set.
#define DISPATCH(NAME)                                                    \
  template <typename... A>                                                \
  void NAME##_chunk(A&&... a) {                                           \
    switch (kIsa) {                                                       \
      case Isa::kAvx512: return NAME##_avx512(std::forward<A>(a)...);     \
      case Isa::kAvx2: return NAME##_avx2(std::forward<A>(a)...);         \
      default: return NAME##_baseline(std::forward<A>(a)...);             \
    }                                                                     \
  }
DISPATCH(forward)
DISPATCH(outer)
DISPATCH(backward)
#undef DISPATCH

// The loops below prefetch (simd.h): without it, inputs larger than the L2 cache wait on memory.

// Rows run in parallel with their chunks in order when there are enough of them to share out
// evenly; otherwise the chunks of all rows run in parallel (two passes and a scan).
bool by_rows(int64_t rows) {
  const int64_t threads = at::get_num_threads();
  return rows >= 4 * threads || rows % threads == 0;
}

// An exclusive scan over chunks, in place, for all rows at once: x (rows, n, size) holds each
// chunk's own sum (K^T V, or Q^T G) and becomes the sum of `start` (rows, size; null: zero) and
// the chunks before it (after it, with `reverse`): the state S before each chunk, or the suffix
// state R after it. `total` (rows, size) gets start + all. In parallel over blocks of entries,
// each walking the chunks with a running sum of the block (contiguous, vectorised).
template <typename T>
void scan(T* x, const T* start, T* total, int64_t rows, int64_t n, int64_t size, bool reverse) {
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (size + kBlock - 1) / kBlock;
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    T running[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / blocks, i0 = task % blocks * kBlock, w = std::min(kBlock, size - i0);
      const int64_t e0 = row * size + i0;
      for (int64_t i = 0; i < w; ++i) running[i] = start ? start[e0 + i] : T(0);
      for (int64_t t = 0; t < n; ++t) {
        T* cell = x + (row * n + (reverse ? n - 1 - t : t)) * size + i0;
        for (int64_t i = 0; i < w; ++i) {
          const T own = cell[i];
          cell[i] = running[i];
          running[i] += own;
        }
      }
      std::memcpy(total + e0, running, w * sizeof(T));
    }
  });
}

void check(const at::Tensor& t, const at::Tensor& like, int64_t dim, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == like.scalar_type(),
              what, " must be a contiguous CPU tensor (rows, N, D) of q's dtype");
  TORCH_CHECK(t.size(0) == like.size(0) && t.size(1) == like.size(1) && (dim < 0 || t.size(2) == dim), what,
              " has the wrong shape");
}

// The state S before every chunk of every row, sp (rows, chunks, C, M), from S_0 = start (rows, C, M;
// null: zero), in parallel over chunks: each chunk's K^T V, then the scan; total (rows, C, M) gets S_N.
template <typename T>
void all_states(const T* kp, const T* vp, const T* start, T* sp, T* total, int64_t rows, int64_t n, int64_t c,
                int64_t m, int64_t chunk) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t t = e % chunks, off = (e / chunks) * n + t * chunk;
      outer_chunk(std::min(chunk, n - t * chunk), c, m, kp + off * c, vp + off * m, sp + e * c * m, false);
    }
  });
  scan(sp, start, total, rows, chunks, c * m, false);
}

// -> (out (rows, N, M), final state S_N (rows, C, M), states). The backward needs only the inputs: it
// recomputes the chunk states (one K^T V per chunk) where the forward ran rows in parallel, which
// keeps none (states is empty); where chunks ran in parallel, states holds S before each chunk.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& initial, int64_t chunk) {
  check(q, q, -1, "q");
  check(k, q, q.size(2), "k");
  check(v, q, -1, "v");
  TORCH_CHECK(chunk > 0, "chunk must be positive");
  const int64_t rows = q.size(0), n = q.size(1), c = q.size(2), m = v.size(2), chunks = (n + chunk - 1) / chunk;
  auto out = at::empty({rows, n, m}, q.options());
  at::Tensor final = initial ? initial->to(q.scalar_type()).reshape({rows, c, m}).clone() : at::zeros({rows, c, m}, q.options());
  at::Tensor states = at::empty({0}, q.options());  // kept only where computed anyway (chunks in parallel)
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_dot_forward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    T *op = out.data_ptr<T>(), *fp = final.data_ptr<T>();
    const int64_t cm = c * m;
    if (by_rows(rows)) {
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        Scratch<T> w(chunk, c, m);
        for (int64_t row = begin; row < end; ++row) {
          T* s = fp + row * cm;  // the running state, S_0 to start with
          for (int64_t t = 0; t < chunks; ++t) {
            const int64_t off = row * n + t * chunk, l = std::min(chunk, n - t * chunk);
            const int64_t next = t + 1 < chunks ? std::min(chunk, n - (t + 1) * chunk) : 0;  // the next chunk, next
            const int64_t at = t + 1 < chunks ? off + chunk : off;
            prefetch(qp + at * c, next * c), prefetch(kp + at * c, next * c), prefetch(vp + at * m, next * m);
            forward_chunk(l, c, m, qp + off * c, kp + off * c, vp + off * m, s, op + off * m, w);
            outer_chunk(l, c, m, kp + off * c, vp + off * m, s, true);
          }
        }
      });
    } else {
      states = at::empty({rows, chunks, c, m}, q.options());
      T* sp = states.data_ptr<T>();
      const at::Tensor start = initial ? final.clone() : at::Tensor();
      all_states(kp, vp, initial ? start.data_ptr<T>() : nullptr, sp, fp, rows, n, c, m, chunk);
      at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {  // the outputs
        Scratch<T> w(chunk, c, m);
        for (int64_t e = begin; e < end; ++e) {
          const int64_t t = e % chunks, off = (e / chunks) * n + t * chunk, l = std::min(chunk, n - t * chunk);
          forward_chunk(l, c, m, qp + off * c, kp + off * c, vp + off * m, sp + e * cm, op + off * m, w);
        }
      });
    }
  });
  return {out, final, states};
}

// -> (grad q, grad k, grad v, grad S_0 = R before position 0) from the inputs, S_0 (rows, C, M) or
// None, the forward's states (or empty), the gradients of out and of the final state (or None).
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const c10::optional<at::Tensor>& initial, const at::Tensor& kept,
                                 const c10::optional<at::Tensor>& grad_final, int64_t chunk) {
  check(q, q, -1, "q");
  check(k, q, q.size(2), "k");
  check(v, q, -1, "v");
  check(g, q, v.size(2), "grad");
  TORCH_CHECK(chunk > 0, "chunk must be positive");
  const int64_t rows = q.size(0), n = q.size(1), c = q.size(2), m = v.size(2), chunks = (n + chunk - 1) / chunk;
  const bool have = kept.numel() > 0;
  TORCH_CHECK(!have || (kept.is_contiguous() && kept.sizes() == at::IntArrayRef({rows, chunks, c, m}) &&
                        kept.scalar_type() == q.scalar_type()), "states do not fit the inputs");
  auto gq = at::empty_like(q), gk = at::empty_like(k), gv = at::empty_like(v);
  const at::Tensor start = initial ? initial->to(q.scalar_type()).reshape({rows, c, m}).contiguous() : at::Tensor();
  at::Tensor r_all = grad_final ? grad_final->to(q.scalar_type()).reshape({rows, c, m}).clone()
                                : at::zeros({rows, c, m}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_dot_backward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>();
    const T* s0 = initial ? start.data_ptr<T>() : nullptr;
    T *gqp = gq.data_ptr<T>(), *gkp = gk.data_ptr<T>(), *gvp = gv.data_ptr<T>(), *rp = r_all.data_ptr<T>();
    const int64_t cm = c * m;
    auto run = [&](int64_t e, const T* s, const T* r, Scratch<T>& w) {  // chunk e = row * chunks + t: S before, R after
      const int64_t t = e % chunks, off = (e / chunks) * n + t * chunk, l = std::min(chunk, n - t * chunk);
      backward_chunk(l, c, m, qp + off * c, kp + off * c, vp + off * m, gp + off * m, s, r, gqp + off * c,
                     gkp + off * c, gvp + off * m, w);
    };
    auto own = [&](int64_t e, const T* x, const T* y, T* u, bool accumulate) {  // u (+)= X^T Y of chunk e
      const int64_t t = e % chunks, off = (e / chunks) * n + t * chunk, l = std::min(chunk, n - t * chunk);
      outer_chunk(l, c, m, x + off * c, y + off * m, u, accumulate);
    };
    if (by_rows(rows)) {
      at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        Scratch<T> w(chunk, c, m);
        std::vector<T> states(have ? 0 : chunks * cm), s(cm);  // one row's S before each chunk, recomputed
        for (int64_t row = begin; row < end; ++row) {
          if (s0) std::copy(s0 + row * cm, s0 + (row + 1) * cm, s.begin());
          else std::fill(s.begin(), s.end(), T(0));
          for (int64_t t = 0; t < chunks && !have; ++t) {
            std::copy(s.begin(), s.end(), states.begin() + t * cm);
            own(row * chunks + t, kp, vp, s.data(), true);
          }
          const T* row_states = have ? kept.data_ptr<T>() + row * chunks * cm : states.data();
          T* r = rp + row * cm;  // the running suffix state, grad S_N to start with
          for (int64_t t = chunks - 1; t >= 0; --t) {
            const int64_t prev = row * n + std::max<int64_t>(t - 1, 0) * chunk, size = t > 0 ? chunk : 0;  // the one before, next
            prefetch(qp + prev * c, size * c), prefetch(kp + prev * c, size * c);
            prefetch(vp + prev * m, size * m), prefetch(gp + prev * m, size * m);
            run(row * chunks + t, row_states + t * cm, r, w);
            own(row * chunks + t, qp, gp, r, true);
          }
        }
      });
    } else {
      auto states = have ? kept : at::empty({rows, chunks, c, m}, q.options()), suffix = at::empty_like(states);
      T *sp = states.data_ptr<T>(), *up = suffix.data_ptr<T>();
      if (!have) {
        auto total = at::empty({rows, c, m}, q.options());
        all_states(kp, vp, s0, sp, total.data_ptr<T>(), rows, n, c, m, chunk);
      }
      at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {  // each chunk's Q^T G
        for (int64_t e = begin; e < end; ++e) own(e, qp, gp, up + e * cm, false);
      });
      const at::Tensor end_grad = grad_final ? r_all.clone() : at::Tensor();
      scan(up, grad_final ? end_grad.data_ptr<T>() : nullptr, rp, rows, chunks, cm, true);
      at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {  // the gradients
        Scratch<T> w(chunk, c, m);
        for (int64_t e = begin; e < end; ++e) run(e, sp + e * cm, up + e * cm, w);
      });
    }
  });
  return {gq, gk, gv, r_all};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Causal linear-attention numerator on CPU (linformer_lab/ops/cpu/causal_dot.cpp)";
  module.def("forward", &forward, "(q, k, v, initial_state or None, chunk) -> [out, final_state, states]");
  module.def("backward", &backward,
             "(q, k, v, grad_out, initial_state or None, states, grad_final or None, chunk) -> [gq, gk, gv, grad_initial]");
  bind_instruction_set(module);
}
