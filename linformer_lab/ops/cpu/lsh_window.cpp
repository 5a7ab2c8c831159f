// The inner step of Reformer's LSH attention (linformer_lab/ops/lsh.py, step 4): in the sorted,
// chunked layout every chunk's queries attend to a window of keys, the chunk itself and the chunk
// before it (wrapping around), with the future (causal), padding and the token itself masked, and
// each key's weight divided by N, the number of the query's windows (all rounds) it stands in.
// One block = one chunk's S queries against its W = 2 S keys (W = S when there is one chunk).
//
// In PyTorch this step is some twenty passes over (G, chunks, S, W) tensors of scores, masks and
// counts, and as many again in the backward; here a block's scores, masks and counts stay in cache.
// The forward keeps the probabilities for the backward, so the backward computes no exponential.
// Threads take whole blocks in the forward and whole rows of G in the backward (a chunk's keys
// stand in two windows, so the two blocks adding into its dk, dv run in one thread, in turn).
//
//   forward(q (G, C, S, D), k (G, C, S, D), v (G, C, S, M), positions int64 (G, C, S),
//           valid bool (G, C, S), chunks int32 (G, C, S, R), causal)
//     -> out (G, C, S, M), lse (G, C, S), p (G, C, S, W)
//   backward(q, k, v, p, out, grad_out, grad_lse) -> dq, dk, dv
//
// chunks[g, c, i, r] is the chunk in which round r placed slot i's position (R = 0 for one round,
// where N = 1). A row whose window is wholly masked has lse = -inf, zero probabilities and a zero
// output, and passes no gradient. The reference is window_attention_torch in lsh.py.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "simd.h"

namespace {

struct Shape {
  int64_t blocks, chunks, S, W, D, M, R;  // blocks = G * chunks; R rounds of chunk ids (0: one round)
};

// The slots' sequence positions, validity and chunk ids per round: what masks and counts need.
struct Slots {
  const int64_t* positions;
  const bool* valid;
  const int32_t* chunks;
  bool causal;
};

// The index of the chunk before a block's (wrapping around within the same row of G).
INLINE int64_t previous_block(int64_t block, const Shape& s) {
  const int64_t chunk = block % s.chunks;
  return block - chunk + (chunk + s.chunks - 1) % s.chunks;
}

// Copies the W rows of x (width values each) that a block's window reads into window (W, width):
// the chunk's own S rows, then the previous chunk's (wrapping around within the same row of G).
template <typename T>
INLINE void gather_window(const T* x, int64_t block, const Shape& s, int64_t width, T* window) {
  const int64_t rows = s.S * width;
  std::memcpy(window, x + block * rows, rows * sizeof(T));
  if (s.W > s.S) std::memcpy(window + rows, x + previous_block(block, s) * rows, rows * sizeof(T));
}

// The reverse of gather_window for gradients: adds a window's W rows into the rows of x they came from.
template <typename T>
INLINE void scatter_window(const T* window, int64_t block, const Shape& s, int64_t width, T* x) {
  const int64_t rows = s.S * width;
  T* own = x + block * rows;
  for (int64_t e = 0; e < rows; ++e) own[e] += window[e];
  if (s.W > s.S) {
    T* previous = x + previous_block(block, s) * rows;
    for (int64_t e = 0; e < rows; ++e) previous[e] += window[rows + e];
  }
}

// exp(x) for x <= 0 (a score minus its row's maximum, or -inf), in operations the compiler
// vectorises: std::exp is a library call per element, which took most of the forward's time.
// float: 2^n e^r with n = round(x / ln 2), ln 2 split in two for an exact r = x - n ln 2, and a
// degree-7 Taylor-like polynomial for e^r on |r| <= ln 2 / 2 (within 2 ulp of std::exp); exactly
// 0 below -87, where e^x underflows float's normal range. double keeps std::exp (the reference dtype).
INLINE float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in round-to-nearest
  const float n = (clamped * 1.44269504088896341f + shifter) - shifter;
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n for n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}
INLINE double exp_nonpositive(double x) { return std::exp(x); }

// A row's sum and maximum over W values in 8 running lanes: a fixed order (the same result on
// every instruction set) that the compiler turns into vector operations, where a plain running
// sum or maximum is one serial dependency chain.
template <typename T>
INLINE T row_sum(const T* x, int64_t n) {
  T lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) lane[u] += x[j + u];
  for (; j < n; ++j) lane[0] += x[j];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
template <typename T>
INLINE T row_max(const T* x, int64_t n) {
  T lane[8];
  for (int u = 0; u < 8; ++u) lane[u] = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) lane[u] = x[j + u] > lane[u] ? x[j + u] : lane[u];
  for (; j < n; ++j) lane[0] = x[j] > lane[0] ? x[j] : lane[0];
  T top = lane[0];
  for (int u = 1; u < 8; ++u) top = lane[u] > top ? lane[u] : top;
  return top;
}

// kD, kM, kW: D, M and W known at compile time (0: read from s). The compiler then unrolls the
// short loops along D, M and W and keeps a row's scores and sums in registers.
template <typename T, int kD, int kM, int kW>
INLINE void forward_block(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const Slots& slots,
                          T* __restrict__ out, T* __restrict__ lse, T* __restrict__ p, int64_t block, const Shape& s,
                          T* __restrict__ k_w, T* __restrict__ k_t, T* __restrict__ v_w,
                          int64_t* __restrict__ key_positions, bool* __restrict__ key_valid,
                          int32_t* __restrict__ key_position32, T* __restrict__ key_padding,
                          int32_t* __restrict__ key_chunks, int32_t* __restrict__ counts) {
  const int64_t S = s.S, W = kW ? kW : s.W, D = kD ? kD : s.D, M = kM ? kM : s.M, R = s.R;
  // the window's keys transposed (the score loops run along keys), its values, and its slots'
  // positions, validity and chunk ids (these transposed too: the count loops run along keys)
  gather_window(k, block, s, D, k_w);
  for (int64_t j = 0; j < W; ++j)
    for (int64_t d = 0; d < D; ++d) k_t[d * W + j] = k_w[j * D + d];
  gather_window(v, block, s, M, v_w);
  gather_window(slots.positions, block, s, 1, key_positions);
  gather_window(slots.valid, block, s, 1, key_valid);
  const bool causal = slots.causal;
  for (int64_t j = 0; j < W; ++j) {  // int32 positions (checked in forward): as wide as a float score
    key_position32[j] = static_cast<int32_t>(key_positions[j]);
    key_padding[j] = key_valid[j] ? T(0) : -std::numeric_limits<T>::infinity();
  }
  gather_window(slots.chunks, block, s, R, key_chunks + R * W);
  for (int64_t j = 0; j < W; ++j)
    for (int64_t r = 0; r < R; ++r) key_chunks[r * W + j] = key_chunks[R * W + j * R + r];
  for (int64_t i = 0; i < S; ++i) {
    const int64_t row = block * S + i;
    const int32_t position = static_cast<int32_t>(slots.positions[row]);
    const T* qi = q + row * D;
    T* pi = p + row * W;
    T* oi = out + row * M;
    for (int64_t j = 0; j < W; ++j) pi[j] = 0;
    for (int64_t d = 0; d < D; ++d) {
      const T qd = qi[d];
      const T* kd = k_t + d * W;
      for (int64_t j = 0; j < W; ++j) pi[j] += qd * kd[j];
    }
    for (int64_t j = 0; j < W; ++j) {  // bitwise, not short-circuit, operators: a loop without branches
      const bool hidden = (key_position32[j] == position) | (causal & (key_position32[j] > position));
      pi[j] = hidden ? -std::numeric_limits<T>::infinity() : pi[j] + key_padding[j];
    }
    T top = row_max(pi, W);
    for (int64_t m = 0; m < M; ++m) oi[m] = 0;
    // the maximum passes over NaN scores (a NaN query): where nothing else is visible, the row goes
    // on with a NaN maximum, so that its output is NaN, as in the reference, not "nothing visible"
    if (std::isinf(top) && std::any_of(pi, pi + W, [](T x) { return std::isnan(x); }))
      top = std::numeric_limits<T>::quiet_NaN();
    if (std::isinf(top)) {  // nothing visible: -inf normaliser, zero weights
      lse[row] = top;
      for (int64_t j = 0; j < W; ++j) pi[j] = 0;
      continue;
    }
    // N_ij: round r's chunk ids are one contiguous range, so key j stands in the query's round-r
    // window (its chunk c and c - 1) as its own round-r chunk, or (c - 1 being the previous
    // round's last chunk) as its round r - 1 chunk
    for (int64_t j = 0; j < W; ++j) counts[j] = R > 0 ? 0 : 1;
    for (int64_t r = 0; r < R; ++r) {
      const int32_t chunk = slots.chunks[row * R + r];
      const int32_t previous = static_cast<int32_t>((chunk + s.chunks - 1) % s.chunks);
      const int32_t* same_round = key_chunks + r * W;
      const int32_t* round_before = key_chunks + ((r + R - 1) % R) * W;
      for (int64_t j = 0; j < W; ++j)
        counts[j] += (same_round[j] == chunk) + (same_round[j] == previous) + (round_before[j] == previous);
    }
    for (int64_t j = 0; j < W; ++j) pi[j] = exp_nonpositive(pi[j] - top) / static_cast<T>(counts[j] > 0 ? counts[j] : 1);
    const T total = row_sum(pi, W);
    const T inverse = T(1) / total;
    for (int64_t j = 0; j < W; ++j) pi[j] *= inverse;
    lse[row] = top + std::log(total);
    for (int64_t j = 0; j < W; ++j) {
      if (pi[j] == 0) continue;  // masked keys (about half of them under a causal mask)
      const T pj = pi[j];
      const T* vj = v_w + j * M;
      for (int64_t m = 0; m < M; ++m) oi[m] += pj * vj[m];
    }
  }
}

// Gradients of one block: dq for its queries, and the window's dk, dv rows (dk_window, dv_window:
// W rows each), which the caller adds into the chunks they came from.
template <typename T, int kD, int kM, int kW>
INLINE void backward_block(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const T* __restrict__ p, const T* __restrict__ out, const T* __restrict__ grad_out,
                           const T* __restrict__ grad_lse, T* __restrict__ dq, T* __restrict__ dk_window,
                           T* __restrict__ dv_window, int64_t block, const Shape& s, T* __restrict__ k_w,
                           T* __restrict__ v_w, T* __restrict__ v_t, T* __restrict__ ds) {
  const int64_t S = s.S, W = kW ? kW : s.W, D = kD ? kD : s.D, M = kM ? kM : s.M;
  gather_window(k, block, s, D, k_w);
  gather_window(v, block, s, M, v_w);
  for (int64_t j = 0; j < W; ++j)  // transposed: the dp loop runs along keys
    for (int64_t m = 0; m < M; ++m) v_t[m * W + j] = v_w[j * M + m];
  for (int64_t x = 0; x < W * D; ++x) dk_window[x] = 0;
  for (int64_t x = 0; x < W * M; ++x) dv_window[x] = 0;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t r = block * S + i;
    const T* pi = p + r * W;
    const T* gi = grad_out + r * M;
    const T* qi = q + r * D;
    T* dqi = dq + r * D;
    for (int64_t d = 0; d < D; ++d) dqi[d] = 0;
    // d lse / d score = p and d out / d score = p (v_j - out): ds = p (g.v_j - g.out + g_lse)
    T shift = grad_lse[r];
    for (int64_t m = 0; m < M; ++m) shift -= gi[m] * out[r * M + m];
    for (int64_t j = 0; j < W; ++j) ds[j] = shift;
    for (int64_t m = 0; m < M; ++m) {
      const T gm = gi[m];
      const T* vm = v_t + m * W;
      for (int64_t j = 0; j < W; ++j) ds[j] += gm * vm[j];
    }
    for (int64_t j = 0; j < W; ++j) {
      if (pi[j] == 0) continue;  // masked: no gradient (and a -inf row's g_lse stays out)
      const T pj = pi[j], dsj = pj * ds[j];
      const T* kj = k_w + j * D;
      T* dvj = dv_window + j * M;
      T* dkj = dk_window + j * D;
      for (int64_t m = 0; m < M; ++m) dvj[m] += pj * gi[m];
      for (int64_t d = 0; d < D; ++d) dqi[d] += dsj * kj[d];
      for (int64_t d = 0; d < D; ++d) dkj[d] += dsj * qi[d];
    }
  }
}

// The block loops, compiled once per instruction set (simd.h); the blocks inline into each.
#define LSH_WINDOW_LOOPS(SUFFIX, ATTRIBUTES)                                                                     \
  template <typename T, int kD, int kM, int kW>                                                                   \
  ATTRIBUTES void forward_blocks##SUFFIX(const T* q, const T* k, const T* v, const Slots& slots, T* out, T* lse,   \
                                         T* p, const Shape& s, int64_t begin, int64_t end) {                      \
    std::vector<T> k_w(s.W * s.D), k_t(s.D * s.W), v_w(s.W * s.M);                                                \
    std::vector<int64_t> key_positions(s.W);                                                                      \
    std::unique_ptr<bool[]> key_valid(new bool[s.W]);                                                             \
    std::vector<int32_t> key_position32(s.W), key_chunks(2 * s.R * s.W + 1), counts(s.W);                         \
    std::vector<T> key_padding(s.W);                                                                              \
    for (int64_t block = begin; block < end; ++block)                                                             \
      forward_block<T, kD, kM, kW>(q, k, v, slots, out, lse, p, block, s, k_w.data(), k_t.data(), v_w.data(),     \
                                   key_positions.data(), key_valid.get(), key_position32.data(),                  \
                                   key_padding.data(), key_chunks.data(), counts.data());                         \
  }                                                                                                               \
  template <typename T, int kD, int kM, int kW>                                                                   \
  ATTRIBUTES void backward_rows##SUFFIX(const T* q, const T* k, const T* v, const T* p, const T* out, const T* g,  \
                                        const T* g_lse, T* dq, T* dk, T* dv, const Shape& s, int64_t begin,       \
                                        int64_t end) {                                                            \
    std::vector<T> k_w(s.W * s.D), v_w(s.W * s.M), v_t(s.M * s.W), ds(s.W), dk_w(s.W * s.D), dv_w(s.W * s.M);     \
    for (int64_t row = begin; row < end; ++row) {                                                                 \
      const int64_t first = row * s.chunks;                                                                       \
      std::fill(dk + first * s.S * s.D, dk + (first + s.chunks) * s.S * s.D, T(0));                              \
      std::fill(dv + first * s.S * s.M, dv + (first + s.chunks) * s.S * s.M, T(0));                              \
      for (int64_t block = first; block < first + s.chunks; ++block) {                                            \
        backward_block<T, kD, kM, kW>(q, k, v, p, out, g, g_lse, dq, dk_w.data(), dv_w.data(), block, s,          \
                                      k_w.data(), v_w.data(), v_t.data(), ds.data());                             \
        scatter_window(dk_w.data(), block, s, s.D, dk);                                                           \
        scatter_window(dv_w.data(), block, s, s.M, dv);                                                           \
      }                                                                                                           \
    }                                                                                                             \
  }
LSH_WINDOW_LOOPS(_avx512, TARGET_AVX512)
LSH_WINDOW_LOOPS(_avx2, TARGET_AVX2)
LSH_WINDOW_LOOPS(_baseline, )
#undef LSH_WINDOW_LOOPS

// The block loop for this CPU's instruction set and these sizes: compile-time D = M and W for the
// common heads (chunks of 32, D = M = 32 or 64), run-time sizes for the rest.
template <typename T, typename Loop>
Loop choose(const Shape& s, Loop avx512_32, Loop avx512_64, Loop avx512_any, Loop avx2_32, Loop avx2_64, Loop avx2_any,
            Loop baseline_32, Loop baseline_64, Loop baseline_any) {
  const int fixed = s.W == 64 && s.D == s.M && (s.D == 32 || s.D == 64) ? static_cast<int>(s.D) : 0;
  if (kIsa == Isa::kAvx512) return fixed == 32 ? avx512_32 : fixed == 64 ? avx512_64 : avx512_any;
  if (kIsa == Isa::kAvx2) return fixed == 32 ? avx2_32 : fixed == 64 ? avx2_64 : avx2_any;
  return fixed == 32 ? baseline_32 : fixed == 64 ? baseline_64 : baseline_any;
}
#define LSH_WINDOW_CHOOSE(NAME, T, s)                                                                     \
  choose<T>(s, NAME##_avx512<T, 32, 32, 64>, NAME##_avx512<T, 64, 64, 64>, NAME##_avx512<T, 0, 0, 0>,     \
            NAME##_avx2<T, 32, 32, 64>, NAME##_avx2<T, 64, 64, 64>, NAME##_avx2<T, 0, 0, 0>,              \
            NAME##_baseline<T, 32, 32, 64>, NAME##_baseline<T, 64, 64, 64>, NAME##_baseline<T, 0, 0, 0>)

Shape check(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              "lsh_window: q, k (G, C, S, D) and v (G, C, S, M) expected, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == q.scalar_type(),
                "lsh_window: contiguous CPU tensors of one dtype expected");
  }
  const int64_t chunks = q.size(1), S = q.size(2);
  return Shape{q.size(0) * chunks, chunks, S, chunks > 1 ? 2 * S : S, q.size(3), v.size(3), 0};
}

std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                   torch::Tensor valid, torch::Tensor chunks, bool causal) {
  Shape s = check(q, k, v);
  const auto rows = q.sizes().slice(0, 3);
  TORCH_CHECK(positions.sizes() == rows && positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  valid.sizes() == rows && valid.scalar_type() == torch::kBool && valid.is_contiguous(),
              "lsh_window: positions (int64) and valid (bool), contiguous (G, C, S), expected");
  TORCH_CHECK(chunks.dim() == 4 && chunks.sizes().slice(0, 3) == rows && chunks.scalar_type() == torch::kInt32 &&
                  chunks.is_contiguous(),
              "lsh_window: chunks int32 (G, C, S, rounds), contiguous, expected, got ", chunks.sizes());
  s.R = chunks.size(3);
  TORCH_CHECK(s.R != 1, "lsh_window: one round of hashing takes no chunk ids (chunks of shape (G, C, S, 0))");
  TORCH_CHECK(positions.numel() == 0 || positions.max().item<int64_t>() < std::numeric_limits<int32_t>::max(),
              "lsh_window: positions must fit in int32");
  const Slots slots{positions.data_ptr<int64_t>(), valid.data_ptr<bool>(), chunks.data_ptr<int32_t>(), causal};
  auto out = torch::empty_like(v);
  auto lse = torch::empty(rows, q.options());
  auto p = torch::empty({q.size(0), s.chunks, s.S, s.W}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "lsh_window_forward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    T *op = out.data_ptr<T>(), *lp = lse.data_ptr<T>(), *pp = p.data_ptr<T>();
    const auto run = LSH_WINDOW_CHOOSE(forward_blocks, T, s);
    at::parallel_for(0, s.blocks, 1, [&](int64_t begin, int64_t end) { run(qp, kp, vp, slots, op, lp, pp, s, begin, end); });
  });
  return {out, lse, p};
}

std::vector<torch::Tensor> backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor p,
                                    torch::Tensor out, torch::Tensor grad_out, torch::Tensor grad_lse) {
  const Shape s = check(q, k, v);
  TORCH_CHECK(p.sizes() == torch::IntArrayRef({q.size(0), s.chunks, s.S, s.W}) && p.is_contiguous(),
              "lsh_window: probabilities (G, C, S, ", s.W, ") expected, got ", p.sizes());
  TORCH_CHECK(out.sizes() == v.sizes() && grad_out.sizes() == v.sizes() && grad_lse.sizes() == q.sizes().slice(0, 3) &&
                  out.is_contiguous() && grad_out.is_contiguous() && grad_lse.is_contiguous(),
              "lsh_window: out, grad_out (G, C, S, M) and grad_lse (G, C, S), contiguous, expected");
  auto dq = torch::empty_like(q);
  auto dk = torch::empty_like(k);
  auto dv = torch::empty_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "lsh_window_backward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *pp = p.data_ptr<T>();
    const T *op = out.data_ptr<T>(), *gp = grad_out.data_ptr<T>(), *lp = grad_lse.data_ptr<T>();
    T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
    const auto run = LSH_WINDOW_CHOOSE(backward_rows, T, s);
    // Threads take whole rows of G: a chunk's keys stand in two windows (its own and the next
    // chunk's), so the two blocks that add into a chunk's dk, dv run in one thread, in turn.
    at::parallel_for(0, q.size(0), 1, [&](int64_t begin, int64_t end) {
      run(qp, kp, vp, pp, op, gp, lp, dqp, dkp, dvp, s, begin, end);
    });
  });
  return {dq, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "window attention of LSH chunks: (out, lse, probabilities)");
  module.def("backward", &backward, "its gradients (dq, dk, dv)");
  bind_instruction_set(module);
}
