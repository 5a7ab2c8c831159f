// The causal numerator of linear attention (eq. 9) on CPU as a register-resident recurrence,
// forward and backward (eq. 13-15):
//
//   out_t = q_t^T S_t,   S_t = S_0 + sum_{s <= t} k_s v_s^T      q, k (rows, N, C), v (rows, N, M)
//
// Every pass is one loop, `sweep`: a tile of a state (P <= 16 rows of one register each) stays in
// registers while positions stream past; per position, a rank-1 update of the tile (one
// broadcast FMA per row), then the tile's contribution to one output row (one broadcast FMA per
// row). 2 P FMAs per position, no shuffles, no scratch: this is the plain recurrence's 4 C M
// flops per position and pass, against the chunked algorithm's extra l (4 C + 3 M) per position
// (ops/linear_attention/chunk.py), which at small D is most of the work and runs as inefficiently
// small GEMMs.
//
//   forward  S  (C x M, rows over C) += k_t v_t^T    out_t  = q_t^T S      (in order)
//   grad q   S' (M x C) = S^T        += v_t k_t^T    gq_t   = g_t^T S'     (in order)
//   grad v   R  (C x M)              += q_t g_t^T    gv_t   = k_t^T R      (reversed)
//   grad k   R' (M x C) = R^T        += g_t q_t^T    gk_t   = v_t^T R'     (reversed)
//
// with R = grad S_N + sum_{s >= t} q_s g_s^T, so grad S_0 = R after the last (reversed) step.
// The transposed copies S', R' make every output a broadcast FMA again (a state row times a
// scalar) instead of a horizontal sum. Positions run in blocks of kBlock: the forward keeps S
// at every block start ((N / kBlock, C, M), O(N M C / kBlock), no larger than an input for
// M <= kBlock), so the backward walks the blocks from last to first and runs all three passes
// on one block while its inputs are in cache (one read of q, k, v, grad from memory).
//
// Threads: both passes split rows where they share out evenly; else the forward splits each row's
// columns (one piece per thread, or per register tile) and the backward (row, pass) pairs (grad q;
// grad v with grad k). Loops under ~4 MFLOP run on one thread. Registers: the widest of the
// instruction set in use that divides C and M (AVX-512: 16 floats, else 8 or 4; 8, 4 or 2
// doubles), so C and M must be multiples of 4 floats or 2 doubles; cpu_kernel.py zero-pads other
// C, M up to whole registers (zero columns add nothing). Outputs of 4 MiB and more come from a pool of
// reused buffers (output_pool.h): no page faults per call.
//
// Compiled for AVX-512, AVX2 + FMA and SSE2 (target attributes, no -march) and picked at load
// (simd.h). Built by linformer_lab/ops/cpu/__init__.py; registered as torch.library operators by
// linformer_lab/ops/custom_ops.py, called from linformer_lab/ops/linear_attention/cpu_kernel.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
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
template <typename T, int B, int P>
INLINE void sweep(int64_t t0, int64_t t1, bool reverse, const T* a, int64_t ld_a, const T* b, int64_t ld_b, const T* c,
                  int64_t ld_c, T* out, int64_t ld_out, bool accumulate, T* state, int64_t lds) {
  using V = typename Vec<T, B>::type;
  constexpr int kAcc = P < 4 ? P : 4;
  V x[P];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) x[p] = load<T, B>(state + p * lds);
  // pointers stepped by +-1 row: GCC then addresses a[t, p] as a fixed offset from one register
  const int64_t first = reverse ? t1 - 1 : t0, step = reverse ? -1 : 1;
  const T *at = a + first * ld_a, *bt = b + first * ld_b, *ct = c + first * ld_c;
  T* ot = out + first * ld_out;
  const int64_t ahead = kAheadBytes / sizeof(T);
  const int64_t ahead_a = step * std::max(ld_a, ahead), ahead_b = step * std::max(ld_b, ahead);
  const int64_t ahead_c = step * std::max(ld_c, ahead);
  for (int64_t i = t0; i < t1; ++i, at += step * ld_a, bt += step * ld_b, ct += step * ld_c, ot += step * ld_out) {
    __builtin_prefetch(at + ahead_a, 0, 3), __builtin_prefetch(bt + ahead_b, 0, 3), __builtin_prefetch(ct + ahead_c, 0, 3);
    const V bv = load<T, B>(bt);
    V acc[kAcc];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      x[p] += at[p] * bv;
      acc[p % kAcc] = p < kAcc ? ct[p] * x[p] : acc[p % kAcc] + ct[p] * x[p];
    }
#pragma GCC unroll 4
    for (int u = 1; u < kAcc; ++u) acc[0] += acc[u];
    store<T, B>(ot, accumulate ? acc[0] + load<T, B>(ot) : acc[0]);
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) store<T, B>(state + p * lds, x[p]);
}

// One pass over positions [t0, t1) for every tile of a (rows x cols) state, rows over a's and c's
// dim, cols over b's and out's (both multiples of the register width): per column tile, the row
// tiles add into the same out columns.
template <typename T, int B>
INLINE void pass(int64_t t0, int64_t t1, bool reverse, int64_t rows, int64_t cols, const T* a, const T* b,
                 const T* c, T* out, T* state, int64_t col0, int64_t col1) {
  constexpr int W = Vec<T, B>::kWidth, kRows = Vec<T, B>::kRows;
  for (int64_t j = col0; j < col1; j += W) {
    for (int64_t p = 0, r; p < rows; p += r) {
      // the tallest tile that fits: kRows, then 8, 4, 2 rows at the end (rows is a multiple of W >= 2;
      // a tile of 16 rows runs only where kRows is 16)
      const int64_t left = rows - p;
      r = left >= kRows ? kRows : left >= 8 ? 8 : left >= 4 ? 4 : 2;
      const bool acc = p > 0;
#define ROWS(R) case R: sweep<T, B, R>(t0, t1, reverse, a + p, rows, b + j, cols, c + p, rows, out + j, cols, acc, \
                                       state + p * cols + j, cols); break;
      switch (r) { ROWS(16) ROWS(8) ROWS(4) default: ROWS(2) }
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
// cpu_kernel.py pads C and M).
int width_bytes(int64_t c, int64_t m, int64_t size) {
  for (int b = kIsa == Isa::kAvx512 ? 64 : kIsa == Isa::kAvx2 ? 32 : 16; b >= 16; b /= 2)
    if (c > 0 && m > 0 && c % (b / size) == 0 && m % (b / size) == 0) return b;
  return 0;
}

#define DEFINE_FOR(NAME, ATTR, B)                                                                               \
  template <typename T>                                                                                         \
  ATTR void pass_##NAME(int64_t t0, int64_t t1, bool reverse, int64_t rows, int64_t cols, const T* a,          \
                        const T* b, const T* c, T* out, T* state, int64_t col0, int64_t col1) {                 \
    pass<T, B>(t0, t1, reverse, rows, cols, a, b, c, out, state, col0, col1);                                   \
  }
DEFINE_FOR(avx512, TARGET_AVX512, 64)
DEFINE_FOR(avx2, TARGET_AVX2, 32)
DEFINE_FOR(baseline, , 16)
#undef DEFINE_FOR

// One pass in the version for registers of `bytes` (width_bytes).
template <typename... A>
void run_pass(int bytes, A&&... a) {
  switch (bytes) {
    case 64: return pass_avx512(std::forward<A>(a)...);
    case 32: return pass_avx2(std::forward<A>(a)...);
    default: return pass_baseline(std::forward<A>(a)...);
  }
}

// Outputs and saved states: large ones from this module's pool of reused buffers (output_pool.h).
at::Tensor empty_outputs(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return OutputPool::get().empty(sizes, options);
}

// The grain of a parallel loop over `tasks` that do `flops` in all: all of them (one thread, no
// wake-up of the others) below ~4 MFLOP, about as long as waking the other threads takes with
// OMP_WAIT_POLICY=PASSIVE; else 1.
int64_t grain(int64_t tasks, int64_t flops) { return flops < (int64_t{4} << 20) ? std::max<int64_t>(tasks, 1) : 1; }

// Whether whole rows (each one thread's) keep every thread busy: many rows, or a multiple of the
// threads. Both passes then give a task whole rows, which read each input from memory once.
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

// -> (out (rows, N, M), final state S_N (rows, C, M), states (rows, blocks, C, M): S before each block).
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& initial) {
  check(q, q, -1, "q");
  check(k, q, q.size(2), "k");
  check(v, q, -1, "v");
  const int64_t rows = q.size(0), n = q.size(1), c = q.size(2), m = v.size(2), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(fits(c, m, q.scalar_type()), "C and M must be multiples of the register width");
  auto out = empty_outputs({rows, n, m}, q.options());
  // contiguous whatever the strides of S_0 (clone keeps a transposed one's)
  at::Tensor final = initial ? initial->to(q.scalar_type()).reshape({rows, c, m}).clone(at::MemoryFormat::Contiguous)
                             : at::zeros({rows, c, m}, q.options());
  auto states = empty_outputs({rows, blocks, c, m}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_recurrence_forward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    T *op = out.data_ptr<T>(), *fp = final.data_ptr<T>(), *sp = states.data_ptr<T>();
    const int bytes = width_bytes(c, m, sizeof(T));
    const int64_t w = bytes / sizeof(T), tiles = m / w, threads = at::get_num_threads();
    // Tasks of whole rows, else of a row's columns in one piece per thread (or per register tile): a
    // task runs its column tiles block by block, so only the first reads q and k from memory. One
    // task per (row, tile) read them once per tile, which was slower on long rows.
    const int64_t pieces = rows_share_out(rows) ? 1 : tiles % threads == 0 ? threads : tiles;
    const int64_t span = m / pieces;
    at::parallel_for(0, rows * pieces, grain(rows * pieces, 4 * rows * n * c * m), [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const int64_t row = e / pieces, j = e % pieces * span;
        T* s = fp + row * c * m;  // the running state, S_0 to start with; this task's columns j..j+span
        for (int64_t blk = 0; blk < blocks; ++blk) {
          T* saved = sp + (row * blocks + blk) * c * m;
          for (int64_t i = 0; i < c; ++i) std::memcpy(saved + i * m + j, s + i * m + j, span * sizeof(T));
          const int64_t t0 = row * n + blk * kBlock, t1 = row * n + std::min(n, (blk + 1) * kBlock);
          run_pass(bytes, t0, t1, false, c, m, kp, vp, qp, op, s, j, j + span);
        }
      }
    });
  });
  return {out, final, states};
}

// -> (grad q, grad k, grad v, grad S_0) from the inputs, the forward's states, the gradient of
// out and that of the final state (or None).
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& states, const c10::optional<at::Tensor>& grad_final) {
  check(q, q, -1, "q");
  check(k, q, q.size(2), "k");
  check(v, q, -1, "v");
  check(g, q, v.size(2), "grad");
  const int64_t rows = q.size(0), n = q.size(1), c = q.size(2), m = v.size(2), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(fits(c, m, q.scalar_type()), "C and M must be multiples of the register width");
  TORCH_CHECK(states.is_contiguous() && states.sizes() == at::IntArrayRef({rows, blocks, c, m}) &&
              states.scalar_type() == q.scalar_type(), "states do not fit the inputs");
  auto gq = empty_outputs(q.sizes(), q.options()), gk = empty_outputs(k.sizes(), k.options());
  auto gv = empty_outputs(v.sizes(), v.options());
  at::Tensor r_all = grad_final ? grad_final->to(q.scalar_type()).reshape({rows, c, m}).clone(at::MemoryFormat::Contiguous)
                                : at::zeros({rows, c, m}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_recurrence_backward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>();
    const T* sp = states.data_ptr<T>();
    T *gqp = gq.data_ptr<T>(), *gkp = gk.data_ptr<T>(), *gvp = gv.data_ptr<T>(), *rp = r_all.data_ptr<T>();
    const int64_t cm = c * m;
    const int bytes = width_bytes(c, m, sizeof(T));
    // Rows in parallel when they share out evenly: each row walks its blocks from last to first and
    // runs grad q (in order, from the saved S), then grad v and grad k (reversed) on one block while
    // it is in cache. Otherwise (fewer rows than threads, say) 2 tasks per row, grad q and
    // (grad v, grad k), which read the inputs from memory twice but keep 2 threads busy on one row.
    const bool fused = rows_share_out(rows);
    const int64_t tasks = fused ? rows : 2 * rows;
    at::parallel_for(0, tasks, grain(tasks, 12 * rows * n * c * m), [&](int64_t begin, int64_t end) {
      std::vector<T> st(cm), rt(cm);  // S' and R' (M x C)
      for (int64_t e = begin; e < end; ++e) {
        const int64_t row = fused ? e : e / 2;
        const bool do_q = fused || e % 2 == 0, do_kv = fused || e % 2 == 1;
        T* r = rp + row * cm;
        if (do_kv) transpose(r, c, m, rt.data());
        for (int64_t i = 0; i < blocks; ++i) {
          const int64_t blk = fused || do_kv ? blocks - 1 - i : i;  // grad q alone: in memory order
          const int64_t t0 = row * n + blk * kBlock, t1 = row * n + std::min(n, (blk + 1) * kBlock);
          if (do_q) {
            transpose(sp + (row * blocks + blk) * cm, c, m, st.data());
            run_pass(bytes, t0, t1, false, m, c, vp, kp, gp, gqp, st.data(), int64_t{0}, c);
          }
          if (do_kv) {
            run_pass(bytes, t0, t1, true, c, m, qp, gp, kp, gvp, r, int64_t{0}, m);
            run_pass(bytes, t0, t1, true, m, c, gp, qp, vp, gkp, rt.data(), int64_t{0}, c);
          }
        }
      }
    });
  });
  return {gq, gk, gv, r_all};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Causal linear-attention numerator on CPU as a recurrence (linformer_lab/ops/cpu/causal_recurrence.cpp)";
  module.def("forward", &forward, "(q, k, v, initial_state or None) -> [out, final_state, states]");
  module.def("backward", &backward, "(q, k, v, grad_out, states, grad_final or None) -> [gq, gk, gv, grad_initial]");
  module.def("fits", [](int64_t c, int64_t m, const at::Tensor& like) { return fits(c, m, like.scalar_type()); },
             "whether (C, M) in like's dtype runs here (multiples of the register width)");
  module.def("block", [] { return kBlock; }, "positions per saved forward state");
  module.def("set_pool_limit", [](int64_t bytes) { return OutputPool::get().set_limit(bytes); },
             "the most bytes of freed large outputs kept for reuse (0: none); returns the limit before");
  module.def("pool_stats", [] { return OutputPool::get().stats(); },
             "[bytes held free, buffers handed out again, buffers made fresh] of the output pool");
  module.def("width", [](int64_t c, int64_t m, const at::Tensor& like) { return width_bytes(c, m, like.element_size()); },
             "the register width (bytes) the loops use for (C, M) in like's dtype; 0: does not run here");
  bind_instruction_set(module);
}
