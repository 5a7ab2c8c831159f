// Causal linear attention ("Transformers are RNNs", Katharopoulos et al. 2020, eq. 9-15) on CUDA.
//
// Computes the numerator of eq. 9 for already feature-mapped inputs,
//     out_i = sum_{j <= i} (q_i . k_j) v_j,      q, k: (B, H, N, D), v, out: (B, H, N, M),
// and its gradients (eq. 13-15), with D, M in 1..256 and fp32 accumulation.
//
// Algorithm: chunked scan. The sequence is cut into chunks of kChunk = 64 rows. With the running
// state S = sum of k_j v_j^T over all earlier chunks (D x M, fp32), one chunk c is
//     out_c = Q_c S + mask(Q_c K_c^T) V_c           (inter-chunk term + intra-chunk term)
//     S    += K_c^T V_c
// i.e. four small matrix products per chunk instead of N sequential rank-1 updates. One thread
// block owns one (batch*head, 64-column tile of M) pair and walks all chunks of that sequence, so
// the state never leaves the block (registers): beyond inputs and outputs no memory is used, in
// particular no per-step or per-chunk states are stored.
//
// One kernel serves forward and backward, because all three gradients are the same kind of scan:
//     dQ_i = sum_{j <= i} (g_i . v_j) k_j   -> forward scan of (q, k, v) = (G, V, K), state S^T
//     dV_i = sum_{j >= i} (k_i . q_j) g_j   -> reverse scan of (q, k, v) = (K, Q, G), state R
//     dK_i = sum_{j >= i} (v_i . g_j) q_j   -> reverse scan of (q, k, v) = (V, G, Q), state R^T
// with R_i = sum_{j >= i} q_j g_j^T (eq. 14-15): these are the two scans of Algorithm 1, the
// reverse one carried as two copies of R tiled along different axes so that no block has to sum
// partial results of another. The backward launch runs all three problems in one grid
// (blockIdx.y enumerates problem x column tile), which also gives small batch*head counts more
// blocks to fill the GPU with.
//
// Two code paths, chosen per launch:
//  * tensor cores (fp16/bf16 on sm_80+): WMMA 16x16x16 tiles, fp32 accumulators; the Q, K, V
//    tiles of the next (chunk, D-slab) stage are fetched with cp.async into a second set of
//    buffers while the current one is computed. The state operand of Q S is rounded to bf16
//    even for fp16 inputs (fp16 would overflow once S grows past 65504, which happens for long
//    sequences); the intra-chunk scores are rounded to the input type before they multiply V,
//    as in every chunked linear-attention kernel.
//  * fp32 FMA (fp32 inputs everywhere; fp16/bf16 on sm_70/sm_75): register-tiled products from
//    shared memory, all arithmetic in fp32, so fp32 results match a float64 reference to ~1e-6.
//
// Grid: x = batch*heads (up to 2^31-1), y = (problem, 64-column tile); 256 threads per block.
//
// This file also compiles as plain C++ (LLA_EMULATE) against a CPU emulation of the few CUDA
// features it uses (threads, __syncthreads/__syncwarp, dynamic shared memory, WMMA, cp.async);
// tests/ops/test_linear_cuda_emulation.py runs the kernels that way, so device code outside `#ifndef
// LLA_EMULATE` blocks must stay within those features.
//
// Resource usage, from ptxas -v (nvcc 13.0, -O3; `python -m linformer_lab.ops.cuda build --arch
// 8.0 9.0 -v`). Registers per thread for kMaxD = 64 / 128 / 256; every variant has 0 spill
// stores/loads, a 0-byte stack frame and no static shared memory:
//   variant                        sm_80            sm_90            sm_75 (kernels only)
//   fp32, FMA                      113 / 124 / 163  127 / 128 / 168  115 / 124 / 163
//   bf16, tensor cores             92 / 110 / 185   96 / 118 / 190   (stub)
//   fp16, tensor cores             98 / 122 / 192   102 / 120 / 196  (stub)
//   bf16 / fp16, FMA               (stub)           (stub)           111/125/166, 115/124/163
// Dynamic shared memory per block: 44032 B (FMA), 74752 B (tensor cores, bf16), 83968 B (tensor
// cores, fp16: + the bf16 copy of Q). __launch_bounds__(256, 2) (1 for kMaxD = 256) caps
// registers at 128 so two blocks share an SM.

#ifndef LLA_EMULATE
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#define LLA_DEVICE __device__ __forceinline__
#define LLA_HOST_DEVICE __host__ __device__
#define LLA_DECLARE_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#include <cstdint>
#include <type_traits>

// The architecture the device code is being compiled for (0 in nvcc's host pass, where kernel
// bodies are not compiled).
#if defined(__CUDA_ARCH__)
#define LLA_ARCH __CUDA_ARCH__
#elif defined(LLA_EMULATE)
#define LLA_ARCH LLA_EMULATE_ARCH
#else
#define LLA_ARCH 0
#endif

namespace linformer_lab_cuda {

constexpr int kThreads = 256;   // 8 warps per block
constexpr int kChunk = 64;      // sequence rows per chunk
constexpr int kValueTile = 64;  // value columns (M) per block
constexpr int kMaxDim = 256;    // largest supported D and M (binding.cpp checks it)

// One scan problem: out_i = sum over j <= i (or j >= i when reverse) of (q_i . k_j) v_j, for
// q, k of shape (BH, n, d) and v, out of shape (BH, n, m), all contiguous and of one dtype.
struct ScanProblem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int d;        // contracted dimension of q and k, 1..256
  int m;        // value dimension, 1..256
  int reverse;  // 0: j <= i (forward scan), 1: j >= i (reverse scan)
  int m_tiles;  // ceil(m / kValueTile): blocks along blockIdx.y for this problem
  int vec_qk;   // q, k rows are 16-byte aligned (d % 8 == 0 and aligned base): vector loads
  int vec_v;    // the same for v and out (m % 8 == 0)
};

struct ScanParams {
  ScanProblem prob[3];
  int num_problems;
  int64_t n;  // sequence length (same for all problems)
};

// Shared-memory budgets (bytes), used by the host to size launches.
constexpr int kTcLd = 72;  // row stride (elements) of 16-bit tiles: 64 + 8, see scan_tensor_core
constexpr int kTcTileBytes = kChunk * kTcLd * 2;
constexpr int kTcScratchLd = 20;
constexpr int kTcScratchBytes = (kThreads / 32) * 16 * kTcScratchLd * 4;
// Tensor-core path: 2 x (Q, K, V) stage buffers, the state operand, the bf16 copy of Q (fp16
// inputs only), then one 16 x 20 fp32 scratch tile per warp.
LLA_HOST_DEVICE constexpr int tc_scratch_offset(bool copy_q) { return (copy_q ? 8 : 7) * kTcTileBytes; }
LLA_HOST_DEVICE constexpr int tc_smem_bytes(bool copy_q) { return tc_scratch_offset(copy_q) + kTcScratchBytes; }

constexpr int kFmaSlab = 32;
constexpr int kFmaLdQ = kFmaSlab + 4;    // q_s: kChunk x 36
constexpr int kFmaLdC = kChunk + 4;      // k_t: 32 x 68, p_s: 64 x 68
constexpr int kFmaLdV = kValueTile + 4;  // v_s: 64 x 68, s_op: 32 x 68
constexpr int kFmaSlabFloats = kChunk * kFmaLdQ + kFmaSlab * kFmaLdC + kFmaSlab * kFmaLdV;
constexpr int kFmaPFloats = kChunk * kFmaLdC;
constexpr int kFmaSmemBytes =
    (kChunk * kFmaLdV + (kFmaSlabFloats > kFmaPFloats ? kFmaSlabFloats : kFmaPFloats)) * 4;

#if LLA_ARCH > 0 || defined(LLA_EMULATE)

// ---------------------------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------------------------

LLA_DEVICE float to_float(float x) { return x; }
LLA_DEVICE float to_float(__half x) { return __half2float(x); }
LLA_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
LLA_DEVICE T from_float(float x);
template <>
LLA_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
LLA_DEVICE __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
LLA_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Component i of a float4; i is a compile-time constant after unrolling, so this folds to a
// register access (indexing through a pointer could push the vector to local memory).
LLA_DEVICE float comp(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

LLA_DEVICE float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }

LLA_DEVICE void lla_trap() {
#if defined(LLA_EMULATE)
  lla_emulate_trap();
#else
  __trap();
#endif
}

// Causal mask of one (row i, column j) score inside a chunk.
LLA_DEVICE bool keep_score(int i, int j, int reverse) { return reverse ? (j >= i) : (j <= i); }

// ---------------------------------------------------------------------------------------------
// fp32 FMA path
// ---------------------------------------------------------------------------------------------

// Copies a kRows x kCols tile (top-left element src[0], row stride ld_src) into shared memory as
// float, zero-filling rows >= rows_valid and columns >= cols_valid so padded rows/columns add
// nothing to any product. Consecutive threads take consecutive columns: a warp reads one
// contiguous run of global memory. kTranspose stores element (r, c) at dst[c * ld_dst + r].
template <int kRows, int kCols, bool kTranspose, typename T>
LLA_DEVICE void load_tile_as_float(float* dst, int ld_dst, const T* __restrict__ src, int64_t ld_src,
                                   int rows_valid, int cols_valid) {
  static_assert((kRows * kCols) % kThreads == 0, "tile must split evenly over the block");
  // Partial unrolling: fully unrolled, the compiler hoists all loads of the V, Q and K tiles
  // ahead of their stores and needs more than the 128 registers that two blocks per SM allow.
#pragma unroll 4
  for (int e = 0; e < kRows * kCols / kThreads; ++e) {
    const int idx = e * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kCols;
    const int c = idx % kCols;
    float x = 0.f;
    if (r < rows_valid && c < cols_valid) x = to_float(src[r * ld_src + c]);
    if (kTranspose)
      dst[c * ld_dst + r] = x;
    else
      dst[r * ld_dst + c] = x;
  }
}

// Thread layout: tx = tid % 16 picks 4 adjacent columns, ty = tid / 16 picks 4 adjacent rows of
// every 64 x 64 product (scores P, output O); for the 32 x 64 state slab ty picks 2 rows. Each
// thread keeps its part of the whole state S (kMaxD x 64) in registers for the whole sequence.
template <typename T, int kMaxD>
LLA_DEVICE void scan_fma(const ScanProblem& pr, int64_t n, int64_t bh, int tile) {
  constexpr int kSlabs = kMaxD / kFmaSlab;
  LLA_DECLARE_DYNAMIC_SMEM(smem_raw);
  float* v_s = reinterpret_cast<float*>(smem_raw);  // [kChunk][kFmaLdV]   V chunk (j, m)
  float* region = v_s + kChunk * kFmaLdV;
  float* q_s = region;                        // [kChunk][kFmaLdQ]    Q slab (i, k)
  float* k_t = q_s + kChunk * kFmaLdQ;        // [kFmaSlab][kFmaLdC]  K slab transposed (k, j)
  float* s_op = k_t + kFmaSlab * kFmaLdC;     // [kFmaSlab][kFmaLdV]  state slab (k, m)
  float* p_s = region;                        // [kChunk][kFmaLdC]    masked scores (i, j)

  const int D = pr.d, M = pr.m, reverse = pr.reverse;
  const int m0 = tile * kValueTile;
  const int m_valid = min(kValueTile, M - m0);
  const T* q = static_cast<const T*>(pr.q) + bh * n * D;
  const T* k = static_cast<const T*>(pr.k) + bh * n * D;
  const T* v = static_cast<const T*>(pr.v) + bh * n * M + m0;
  T* out = static_cast<T*>(pr.out) + bh * n * M + m0;

  const int tx = static_cast<int>(threadIdx.x) & 15;
  const int ty = static_cast<int>(threadIdx.x) >> 4;

  float s_acc[kSlabs][2][4];
#pragma unroll
  for (int s = 0; s < kSlabs; ++s)
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) s_acc[s][a][b] = 0.f;

  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  for (int64_t it = 0; it < nchunks; ++it) {
    const int64_t r0 = (reverse ? nchunks - 1 - it : it) * kChunk;
    const int rows = static_cast<int>(min(static_cast<int64_t>(kChunk), n - r0));

    float p_acc[4][4], o_acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) p_acc[a][b] = o_acc[a][b] = 0.f;

    load_tile_as_float<kChunk, kValueTile, false>(v_s, kFmaLdV, v + r0 * M, M, rows, m_valid);

#pragma unroll
    for (int s = 0; s < kSlabs; ++s) {
      const int d0 = s * kFmaSlab;
      if (d0 >= D) break;  // uniform across the block
      const int d_valid = min(kFmaSlab, D - d0);
      load_tile_as_float<kChunk, kFmaSlab, false>(q_s, kFmaLdQ, q + r0 * D + d0, D, rows, d_valid);
      load_tile_as_float<kChunk, kFmaSlab, true>(k_t, kFmaLdC, k + r0 * D + d0, D, rows, d_valid);
      // Publish this slab of the state as it was before this chunk (the Q S operand).
#pragma unroll
      for (int a = 0; a < 2; ++a)
        *reinterpret_cast<float4*>(&s_op[(ty * 2 + a) * kFmaLdV + tx * 4]) =
            make_float4(s_acc[s][a][0], s_acc[s][a][1], s_acc[s][a][2], s_acc[s][a][3]);
      __syncthreads();

      // P += Q_slab K_slab^T and O += Q_slab S_slab share the Q rows: one pass over k. Q is read
      // as float4 along k (one load covers 4 k-steps), so a k-step costs 3 vector loads from
      // shared memory (one of Q, one of K, one of S) for 32 FMAs.
#pragma unroll 1
      for (int kk = 0; kk < kFmaSlab; kk += 4) {
        float4 qv[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) qv[a] = load4(&q_s[(ty * 4 + a) * kFmaLdQ + kk]);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 kv = load4(&k_t[(kk + u) * kFmaLdC + tx * 4]);
          const float4 sv = load4(&s_op[(kk + u) * kFmaLdV + tx * 4]);
#pragma unroll
          for (int a = 0; a < 4; ++a) {
            const float qa = comp(qv[a], u);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              p_acc[a][b] = fmaf(qa, comp(kv, b), p_acc[a][b]);
              o_acc[a][b] = fmaf(qa, comp(sv, b), o_acc[a][b]);
            }
          }
        }
      }
      // S_slab += K_slab^T V (rows of V past the sequence end are zero).
#pragma unroll 1
      for (int j = 0; j < kChunk; j += 4) {
        float4 kt[2];
#pragma unroll
        for (int a = 0; a < 2; ++a) kt[a] = load4(&k_t[(ty * 2 + a) * kFmaLdC + j]);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 vv = load4(&v_s[(j + u) * kFmaLdV + tx * 4]);
#pragma unroll
          for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) s_acc[s][a][b] = fmaf(comp(kt[a], u), comp(vv, b), s_acc[s][a][b]);
        }
      }
      __syncthreads();  // the next slab (or p_s, which aliases this region) overwrites q_s/k_t/s_op
    }

    // Masked scores into shared memory (row-major, so the P V product reads them like Q above).
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = ty * 4 + a;
      float4 pv;
      pv.x = keep_score(i, tx * 4 + 0, reverse) ? p_acc[a][0] : 0.f;
      pv.y = keep_score(i, tx * 4 + 1, reverse) ? p_acc[a][1] : 0.f;
      pv.z = keep_score(i, tx * 4 + 2, reverse) ? p_acc[a][2] : 0.f;
      pv.w = keep_score(i, tx * 4 + 3, reverse) ? p_acc[a][3] : 0.f;
      *reinterpret_cast<float4*>(&p_s[i * kFmaLdC + tx * 4]) = pv;
    }
    __syncthreads();

    // O += P V. A warp holds rows 8w..8w+7; columns j outside the causal band of all of them
    // are zero, so the loop bounds skip them (kept a multiple of 4 and warp-uniform).
    const int warp_row0 = (ty & ~1) * 4;
    const int j_begin = reverse ? warp_row0 : 0;
    const int j_end = min(reverse ? kChunk : warp_row0 + 8, (rows + 3) & ~3);
    for (int j = j_begin; j < j_end; j += 4) {
      float4 pv[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) pv[a] = load4(&p_s[(ty * 4 + a) * kFmaLdC + j]);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float4 vv = load4(&v_s[(j + u) * kFmaLdV + tx * 4]);
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int b = 0; b < 4; ++b) o_acc[a][b] = fmaf(comp(pv[a], u), comp(vv, b), o_acc[a][b]);
      }
    }

#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = ty * 4 + a;
      if (i >= rows) continue;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (tx * 4 + b < m_valid) out[(r0 + i) * M + tx * 4 + b] = from_float<T>(o_acc[a][b]);
    }
    __syncthreads();  // v_s and p_s are overwritten by the next chunk
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path (fp16 / bf16, sm_80+)
// ---------------------------------------------------------------------------------------------

#if LLA_ARCH >= 800
namespace wmma = nvcuda::wmma;
using AccFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Asynchronous 16-byte global -> shared copies (cp.async, sm_80+): the loads of the next chunk
// are in flight while the tensor cores work on the current one. src_bytes = 0 zero-fills.
LLA_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(LLA_EMULATE)
  // The emulation copies at once; a buffer overwritten while other threads still read it then
  // shows up as a data race, as it would corrupt data on the GPU.
  if (valid)
    std::memcpy(smem_dst, gmem_src, 16);
  else
    std::memset(smem_dst, 0, 16);
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 16 : 0)
               : "memory");
#endif
}

LLA_DEVICE void cp_async_commit() {
#if !defined(LLA_EMULATE)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed copy groups are still in flight; the
// completed copies are then visible to this thread (to others after a __syncthreads).
template <int kPending>
LLA_DEVICE void cp_async_wait() {
#if !defined(LLA_EMULATE)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Starts copying a kChunk x 64 tile of 16-bit elements (top-left src[0], row stride ld_src)
// into shared memory (row stride kTcLd), zero-filled outside rows_valid x cols_valid. With vec
// (16-byte aligned rows; cols_valid then is a multiple of 8) 8 threads copy one row's 128
// contiguous bytes asynchronously; otherwise the copy is element-wise and synchronous.
// own_to_bf16 (after this thread's cp_async_wait) converts exactly the elements this thread
// copied, so a tile's bf16 copy needs no extra block barrier.
template <typename T>
LLA_DEVICE void copy_tile_16bit(T* dst, const T* __restrict__ src, int64_t ld_src, int rows_valid, int cols_valid,
                                bool vec) {
  if (vec) {
#pragma unroll
    for (int e = 0; e < kChunk * 8 / kThreads; ++e) {
      const int idx = e * kThreads + static_cast<int>(threadIdx.x);
      const int r = idx >> 3;
      const int c = (idx & 7) * 8;
      const bool valid = r < rows_valid && c < cols_valid;
      cp_async_16(dst + r * kTcLd + c, valid ? src + r * ld_src + c : src, valid);
    }
  } else {
#pragma unroll 4
    for (int e = 0; e < kChunk * 64 / kThreads; ++e) {
      const int idx = e * kThreads + static_cast<int>(threadIdx.x);
      const int r = idx >> 6;
      const int c = idx & 63;
      dst[r * kTcLd + c] = (r < rows_valid && c < cols_valid) ? src[r * ld_src + c] : from_float<T>(0.f);
    }
  }
}

template <typename T>
LLA_DEVICE void own_to_bf16(const T* src, __nv_bfloat16* dst, bool vec) {
  if (vec) {
#pragma unroll
    for (int e = 0; e < kChunk * 8 / kThreads; ++e) {
      const int idx = e * kThreads + static_cast<int>(threadIdx.x);
      const int off = (idx >> 3) * kTcLd + (idx & 7) * 8;
      const uint4 raw = *reinterpret_cast<const uint4*>(src + off);
      const T* x = reinterpret_cast<const T*>(&raw);
      alignas(16) __nv_bfloat16 y[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) y[t] = __float2bfloat16_rn(to_float(x[t]));
      *reinterpret_cast<uint4*>(dst + off) = *reinterpret_cast<const uint4*>(y);
    }
  } else {
#pragma unroll 4
    for (int e = 0; e < kChunk * 64 / kThreads; ++e) {
      const int idx = e * kThreads + static_cast<int>(threadIdx.x);
      const int off = (idx >> 6) * kTcLd + (idx & 63);
      dst[off] = __float2bfloat16_rn(to_float(src[off]));
    }
  }
}

// Writes one warp's 16 x 16 fp32 accumulator tile to shared memory as U (row stride kTcLd),
// zeroing the elements the mask rejects. WMMA leaves the register layout of a fragment
// unspecified, so the tile goes through the warp's private fp32 scratch tile.
template <typename U, typename Mask>
LLA_DEVICE void store_tile_converted(const AccFrag& acc, U* dst, float* scratch, int lane, Mask keep) {
  wmma::store_matrix_sync(scratch, acc, kTcScratchLd, wmma::mem_row_major);
  __syncwarp();
  const int r = lane >> 1;
  const int c0 = (lane & 1) * 8;
  alignas(16) U y[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) y[t] = from_float<U>(keep(r, c0 + t) ? scratch[r * kTcScratchLd + c0 + t] : 0.f);
  *reinterpret_cast<uint4*>(dst + r * kTcLd + c0) = *reinterpret_cast<const uint4*>(y);
  __syncwarp();  // the scratch tile is reused by this warp's next store
}

// Writes one warp's 16 x 16 output tile to global memory (row stride ld), clipped to
// rows_left x cols_left.
template <typename T>
LLA_DEVICE void store_output_tile(const AccFrag& acc, T* dst, int64_t ld, int rows_left, int cols_left, bool vec,
                                  float* scratch, int lane) {
  wmma::store_matrix_sync(scratch, acc, kTcScratchLd, wmma::mem_row_major);
  __syncwarp();
  const int r = lane >> 1;
  const int c0 = (lane & 1) * 8;
  if (r < rows_left) {
    alignas(16) T y[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) y[t] = from_float<T>(scratch[r * kTcScratchLd + c0 + t]);
    if (vec && c0 + 8 <= cols_left) {
      *reinterpret_cast<uint4*>(dst + r * ld + c0) = *reinterpret_cast<const uint4*>(y);
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (c0 + t < cols_left) dst[r * ld + c0 + t] = y[t];
    }
  }
  __syncwarp();
}

// Warp w owns row tile wr = w / 2 and column tiles wc, wc + 1 (wc = 0 or 2) of every 64 x 64
// product of a chunk: scores P (cols = key rows), output O and, per 64-row slab of D, the state
// S (rows = slab rows). P and O accumulators live in registers for one chunk, the state
// fragments for the whole sequence. Tiles that lie entirely outside the causal band, outside
// the valid columns of M or outside D are skipped.
template <typename T, int kMaxD>
LLA_DEVICE void scan_tensor_core(const ScanProblem& pr, int64_t n, int64_t bh, int tile) {
  using ST = __nv_bfloat16;  // type of the state operand of Q S (bf16: fp32's exponent range)
  constexpr bool kCopyQ = !std::is_same<T, ST>::value;
  constexpr int kSlab = 64;
  constexpr int kSlabs = kMaxD / kSlab;
  constexpr int kTileElems = kChunk * kTcLd;

  LLA_DECLARE_DYNAMIC_SMEM(smem_raw);
  // 16-bit tiles of 64 rows, row stride 72 elements (144 bytes): the 8 rows that one WMMA
  // load reads start in different 16-byte bank groups, and every 16 x 16 tile is 32-byte
  // aligned as WMMA requires. Q, K and V are double-buffered: while one (chunk, slab) stage is
  // computed, cp.async fills the other buffer with the next stage.
  T* q_buf = reinterpret_cast<T*>(smem_raw);         // 2 x Q slab   (i, k)
  T* k_buf = q_buf + 2 * kTileElems;                 // 2 x K slab   (j, k)
  T* v_buf = k_buf + 2 * kTileElems;                 // 2 x V chunk  (j, m), by chunk parity
  ST* s_op = reinterpret_cast<ST*>(v_buf + 2 * kTileElems);  // state slab (k, m) before this chunk
  ST* q_st = s_op + kTileElems;                      // Q slab in bf16 (fp16 inputs only)
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float* scratch = reinterpret_cast<float*>(smem_raw + tc_scratch_offset(kCopyQ)) + warp * 16 * kTcScratchLd;

  const int D = pr.d, M = pr.m, reverse = pr.reverse;
  const int m0 = tile * kValueTile;
  const int m_valid = min(kValueTile, M - m0);
  const int nm = (m_valid + 15) >> 4;  // 16-column tiles of this block that hold values
  const T* q = static_cast<const T*>(pr.q) + bh * n * D;
  const T* k = static_cast<const T*>(pr.k) + bh * n * D;
  const T* v = static_cast<const T*>(pr.v) + bh * n * M + m0;
  T* out = static_cast<T*>(pr.out) + bh * n * M + m0;

  const int wr = warp >> 1;
  const int wc = (warp & 1) * 2;

  AccFrag s_acc[kSlabs][2];
#pragma unroll
  for (int s = 0; s < kSlabs; ++s) {
    wmma::fill_fragment(s_acc[s][0], 0.f);
    wmma::fill_fragment(s_acc[s][1], 0.f);
  }

  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  const int n_slabs = (D + kSlab - 1) / kSlab;
  const bool vec_qk = pr.vec_qk != 0, vec_v = pr.vec_v != 0;
  // Issues the copies of stage (chunk it_s, slab s_s) into Q/K buffer `parity` (and, for the
  // first slab of a chunk, V into the buffer of the chunk's parity). Nothing past the end.
  auto issue_stage = [&](int64_t it_s, int s_s, int parity) {
    if (it_s >= nchunks) return;
    const int64_t r0_s = (reverse ? nchunks - 1 - it_s : it_s) * kChunk;
    const int rows_s = static_cast<int>(min(static_cast<int64_t>(kChunk), n - r0_s));
    const int d0 = s_s * kSlab;
    copy_tile_16bit<T>(q_buf + parity * kTileElems, q + r0_s * D + d0, D, rows_s, D - d0, vec_qk);
    copy_tile_16bit<T>(k_buf + parity * kTileElems, k + r0_s * D + d0, D, rows_s, D - d0, vec_qk);
    if (s_s == 0) copy_tile_16bit<T>(v_buf + (it_s & 1) * kTileElems, v + r0_s * M, M, rows_s, m_valid, vec_v);
  };

  issue_stage(0, 0, 0);
  cp_async_commit();
  int parity = 0;  // Q/K buffer of the current stage
  for (int64_t it = 0; it < nchunks; ++it) {
    const int64_t r0 = (reverse ? nchunks - 1 - it : it) * kChunk;
    const int rows = static_cast<int>(min(static_cast<int64_t>(kChunk), n - r0));
    const T* v_s = v_buf + (it & 1) * kTileElems;

    AccFrag p_acc[2], o_acc[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      wmma::fill_fragment(p_acc[t], 0.f);
      wmma::fill_fragment(o_acc[t], 0.f);
    }

#pragma unroll
    for (int s = 0; s < kSlabs; ++s) {
      if (s >= n_slabs) break;  // uniform across the block
      const int nk = (min(kSlab, D - s * kSlab) + 15) >> 4;  // 16-wide k tiles that hold data
      const T* q_s = q_buf + parity * kTileElems;
      const T* k_s = k_buf + parity * kTileElems;
      // Prefetch the next stage into the other buffers: they were last read by the previous
      // stage, which every thread finished before the barrier that ended it.
      if (s + 1 < n_slabs)
        issue_stage(it, s + 1, parity ^ 1);
      else
        issue_stage(it + 1, 0, parity ^ 1);
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of the current stage have landed
      if constexpr (kCopyQ) own_to_bf16<T>(q_s, q_st, vec_qk);
      // Publish this slab of the state as it was before this chunk.
      if (wr < nk) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
          if (wc + t < nm)
            store_tile_converted<ST>(s_acc[s][t], s_op + wr * 16 * kTcLd + (wc + t) * 16, scratch, lane,
                                     [](int, int) { return true; });
      }
      __syncthreads();  // the current stage (all threads' copies) and s_op are complete

      // P += Q K^T and O += Q S over this slab's k tiles (both use the same Q row tile).
      for (int kk = 0; kk < nk; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, q_s + wr * 16 * kTcLd + kk * 16, kTcLd);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int tj = wc + t;
          if (reverse ? tj < wr : tj > wr) continue;  // score tile fully masked
          // B = K^T: element (k, j) sits at k_s[j * kTcLd + k], i.e. column-major.
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
          wmma::load_matrix_sync(b, k_s + tj * 16 * kTcLd + kk * 16, kTcLd);
          wmma::mma_sync(p_acc[t], a, b, p_acc[t]);
        }
        if (it > 0) {  // the state is zero before the first chunk
          wmma::fragment<wmma::matrix_a, 16, 16, 16, ST, wmma::row_major> as;
          if constexpr (kCopyQ) {
            wmma::load_matrix_sync(as, q_st + wr * 16 * kTcLd + kk * 16, kTcLd);
          } else {
            as = a;
          }
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            if (wc + t >= nm) continue;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, ST, wmma::row_major> b;
            wmma::load_matrix_sync(b, s_op + kk * 16 * kTcLd + (wc + t) * 16, kTcLd);
            wmma::mma_sync(o_acc[t], as, b, o_acc[t]);
          }
        }
      }
      // S += K^T V for this slab; only row tiles inside D and key rows inside the sequence.
      if (wr < nk) {
        for (int jt = 0; jt * 16 < rows; ++jt) {
          // A = K^T: element (k, j) sits at k_s[j * kTcLd + k], i.e. column-major.
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
          wmma::load_matrix_sync(a, k_s + jt * 16 * kTcLd + wr * 16, kTcLd);
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            if (wc + t >= nm) continue;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
            wmma::load_matrix_sync(b, v_s + jt * 16 * kTcLd + (wc + t) * 16, kTcLd);
            wmma::mma_sync(s_acc[s][t], a, b, s_acc[s][t]);
          }
        }
      }
      __syncthreads();  // this stage's buffers, s_op and q_st may be overwritten from here on
      parity ^= 1;
    }

    // Masked scores, rounded to T, into the Q buffer of the stage just finished: the copies in
    // flight target the other buffer.
    T* p_s = q_buf + (parity ^ 1) * kTileElems;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int tj = wc + t;
      if (reverse ? tj < wr : tj > wr) continue;
      store_tile_converted<T>(p_acc[t], p_s + wr * 16 * kTcLd + tj * 16, scratch, lane,
                              [=](int r, int c) { return keep_score(wr * 16 + r, tj * 16 + c, reverse); });
    }
    __syncthreads();

    // O += P V over the key tiles inside the causal band and the sequence.
    for (int jt = reverse ? wr : 0; jt <= (reverse ? 3 : wr) && jt * 16 < rows; ++jt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, p_s + wr * 16 * kTcLd + jt * 16, kTcLd);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (wc + t >= nm) continue;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(b, v_s + jt * 16 * kTcLd + (wc + t) * 16, kTcLd);
        wmma::mma_sync(o_acc[t], a, b, o_acc[t]);
      }
    }

    if (wr * 16 < rows) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
        if (wc + t < nm)
          store_output_tile<T>(o_acc[t], out + (r0 + wr * 16) * M + (wc + t) * 16, M, rows - wr * 16,
                               m_valid - (wc + t) * 16, vec_v, scratch, lane);
    }
    __syncthreads();  // p_s and this chunk's V buffer are overwritten by later stages
  }
  cp_async_wait<0>();  // nothing may be in flight when the block exits (the last group is empty)
}
#endif  // LLA_ARCH >= 800

#endif  // LLA_ARCH > 0 || defined(LLA_EMULATE)

// ---------------------------------------------------------------------------------------------
// Kernel and launch planning
// ---------------------------------------------------------------------------------------------

// kMaxD: 64, 128 or 256, the smallest that holds every problem's d; it sizes the register-
// resident state, so small heads do not pay for the largest one.
template <typename T, bool kTensorCores, int kMaxD>
__global__ void __launch_bounds__(kThreads, kMaxD >= 256 ? 1 : 2) chunk_scan_kernel(const ScanParams p) {
#if LLA_ARCH > 0
  // Pick this block's problem and column tile (constant indices keep `p` in the parameter bank).
  int tile = static_cast<int>(blockIdx.y);
  ScanProblem pr = p.prob[0];
  if (p.num_problems > 1 && tile >= pr.m_tiles) {
    tile -= pr.m_tiles;
    pr = p.prob[1];
    if (p.num_problems > 2 && tile >= pr.m_tiles) {
      tile -= pr.m_tiles;
      pr = p.prob[2];
    }
  }
  const int64_t bh = static_cast<int64_t>(blockIdx.x);
  if constexpr (kTensorCores) {
#if LLA_ARCH >= 800
    scan_tensor_core<T, kMaxD>(pr, p.n, bh, tile);
#else
    lla_trap();  // never launched: tensor_cores_usable() sees that this code is pre-sm_80
#endif
  } else {
#if LLA_ARCH >= 800
    // On sm_80+ the host sends fp16/bf16 to the tensor-core variant; not compiling the FMA one
    // for them keeps build time down.
    if constexpr (std::is_same<T, float>::value) {
      scan_fma<T, kMaxD>(pr, p.n, bh, tile);
    } else {
      lla_trap();
    }
#else
    scan_fma<T, kMaxD>(pr, p.n, bh, tile);
#endif
  }
#endif
}

using KernelFn = void (*)(const ScanParams);

struct LaunchPlan {
  KernelFn kernel;
  int smem_bytes;
  int blocks_y;  // total column tiles over all problems; grid = (batch*heads, blocks_y)
};

// Chooses the kernel variant and its shared memory for a set of problems of element type T.
// tensor_cores: the device is sm_80+ (only used for fp16/bf16).
template <typename T>
LaunchPlan plan_chunk_scan(const ScanParams& p, bool tensor_cores) {
  int max_d = 1, blocks_y = 0;
  for (int i = 0; i < p.num_problems; ++i) {
    max_d = p.prob[i].d > max_d ? p.prob[i].d : max_d;
    blocks_y += p.prob[i].m_tiles;
  }
  LaunchPlan plan{};
  plan.blocks_y = blocks_y;
  plan.smem_bytes = kFmaSmemBytes;
  plan.kernel = max_d <= 64    ? chunk_scan_kernel<T, false, 64>
                : max_d <= 128 ? chunk_scan_kernel<T, false, 128>
                               : chunk_scan_kernel<T, false, kMaxDim>;
  if constexpr (!std::is_same<T, float>::value) {  // fp32 never takes the tensor cores (precision)
    if (tensor_cores) {
      plan.smem_bytes = tc_smem_bytes(std::is_same<T, __half>::value);
      plan.kernel = max_d <= 64    ? chunk_scan_kernel<T, true, 64>
                    : max_d <= 128 ? chunk_scan_kernel<T, true, 128>
                                   : chunk_scan_kernel<T, true, kMaxDim>;
    }
  }
  return plan;
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

inline ScanProblem make_problem(const void* q, const void* k, const void* v, void* out, int d, int m,
                                bool reverse, int elem_bytes) {
  ScanProblem pr{};
  pr.q = q;
  pr.k = k;
  pr.v = v;
  pr.out = out;
  pr.d = d;
  pr.m = m;
  pr.reverse = reverse ? 1 : 0;
  pr.m_tiles = (m + kValueTile - 1) / kValueTile;
  const int vec_elems = 16 / elem_bytes;
  pr.vec_qk = (d % vec_elems == 0) && aligned16(q) && aligned16(k);
  pr.vec_v = (m % vec_elems == 0) && aligned16(v) && aligned16(out);
  return pr;
}

// Forward: out = causal_dot_product(q, k, v).
inline ScanParams forward_params(const void* q, const void* k, const void* v, void* out, int64_t n, int d, int m,
                                 int elem_bytes) {
  ScanParams p{};
  p.n = n;
  p.num_problems = 1;
  p.prob[0] = make_problem(q, k, v, out, d, m, false, elem_bytes);
  return p;
}

// Backward (eq. 13-15) given the output gradient g (shape of v); null grad pointers are skipped.
inline ScanParams backward_params(const void* q, const void* k, const void* v, const void* g, void* gq, void* gk,
                                  void* gv, int64_t n, int d, int m, int elem_bytes) {
  ScanParams p{};
  p.n = n;
  p.num_problems = 0;
  if (gq != nullptr) p.prob[p.num_problems++] = make_problem(g, v, k, gq, m, d, false, elem_bytes);
  if (gv != nullptr) p.prob[p.num_problems++] = make_problem(k, q, g, gv, d, m, true, elem_bytes);
  if (gk != nullptr) p.prob[p.num_problems++] = make_problem(v, g, q, gk, m, d, true, elem_bytes);
  return p;
}

}  // namespace linformer_lab_cuda

// ---------------------------------------------------------------------------------------------
// ATen entry points (called from binding.cpp after its argument checks)
// ---------------------------------------------------------------------------------------------
#ifndef LLA_EMULATE
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
// Not <ATen/cuda/CUDAContext.h>: it pulls in cuBLAS/cuSPARSE headers, which a CUDA toolkit
// installed without the math libraries lacks; c10's stream API is the one it forwards to.

namespace linformer_lab_cuda {
namespace {

int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

void launch(const ScanParams& p, const LaunchPlan& plan, int64_t bh) {
  if (p.num_problems == 0 || p.n == 0 || bh == 0) return;
  const int smem_optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(plan.smem_bytes <= smem_optin, "causal_dot_product: the kernel needs ", plan.smem_bytes,
              " bytes of shared memory per block, the device allows ", smem_optin);
  if (plan.smem_bytes > 48 * 1024) {
    // Blocks may only use more than 48 KiB of dynamic shared memory after opting in.
    C10_CUDA_CHECK(cudaFuncSetAttribute(plan.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes));
  }
  const dim3 grid(static_cast<unsigned>(bh), static_cast<unsigned>(plan.blocks_y));
  plan.kernel<<<grid, kThreads, plan.smem_bytes, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the tensor-core variants for T hold real code on the current device: the GPU is
// sm_80+ and the code loaded for it was compiled for sm_80+. (A build that reaches a newer GPU
// only through PTX for an older architecture has stubs there; the FMA path then runs instead.)
// Cached per device: the answer cannot change while the process runs.
template <typename T>
bool tensor_cores_usable(const ScanParams& p) {
  static std::atomic<signed char> cache[64] = {};  // 0 unknown, 1 yes, -1 no
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && cache[device].load() != 0) return cache[device].load() > 0;
  bool usable = false;
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8) {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, plan_chunk_scan<T>(p, true).kernel));
    usable = attr.ptxVersion >= 80;
  }
  if (device < 64) cache[device].store(usable ? 1 : -1);
  return usable;
}

template <typename T>
void run(const ScanParams& p, int64_t bh) {
  const bool tensor_cores = !std::is_same<T, float>::value && tensor_cores_usable<T>(p);
  launch(p, plan_chunk_scan<T>(p, tensor_cores), bh);
}

void run_for_dtype(at::ScalarType dtype, const ScanParams& p, int64_t bh) {
  switch (dtype) {
    case at::kFloat:
      run<float>(p, bh);
      break;
    case at::kHalf:
      run<__half>(p, bh);
      break;
    case at::kBFloat16:
      run<__nv_bfloat16>(p, bh);
      break;
    default:
      TORCH_CHECK(false, "causal_dot_product: unsupported dtype ", dtype);
  }
}

}  // namespace

at::Tensor causal_dot_product_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty_like(v);
  const int64_t bh = q.size(0) * q.size(1);
  const ScanParams p = forward_params(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.size(2),
                                      static_cast<int>(q.size(3)), static_cast<int>(v.size(3)),
                                      static_cast<int>(q.element_size()));
  run_for_dtype(q.scalar_type(), p, bh);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_dot_product_backward_cuda(const at::Tensor& q,
                                                                                const at::Tensor& k,
                                                                                const at::Tensor& v,
                                                                                const at::Tensor& grad_out,
                                                                                std::array<bool, 3> output_mask) {
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor gq = output_mask[0] ? at::empty_like(q) : at::Tensor();
  at::Tensor gk = output_mask[1] ? at::empty_like(k) : at::Tensor();
  at::Tensor gv = output_mask[2] ? at::empty_like(v) : at::Tensor();
  const int64_t bh = q.size(0) * q.size(1);
  const ScanParams p = backward_params(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), grad_out.data_ptr(), gq.defined() ? gq.data_ptr() : nullptr,
      gk.defined() ? gk.data_ptr() : nullptr, gv.defined() ? gv.data_ptr() : nullptr, q.size(2),
      static_cast<int>(q.size(3)), static_cast<int>(v.size(3)), static_cast<int>(q.element_size()));
  run_for_dtype(q.scalar_type(), p, bh);
  return {gq, gk, gv};
}

}  // namespace linformer_lab_cuda
#endif  // LLA_EMULATE
