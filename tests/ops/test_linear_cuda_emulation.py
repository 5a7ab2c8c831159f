"""The linear_cuda kernel source executed on the CPU by an emulation of CUDA (``cuda_emulation``
marker), against autograd of the float64 definition: the only check of the kernels' arithmetic
that CI can run. The other linear_cuda tests and how to run them all: ``tests/ops/linear_cuda_reference.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from linear_cuda_reference import CACHE, CUDA_SRC, TOL, make_inputs, reference, rel_err

from linformer_lab.ops import cuda as lcuda

# ------------------------------------------------------------------------------------------------
# CPU emulation of the kernels
# ------------------------------------------------------------------------------------------------


def _cuda_header_dir() -> Path | None:
    """The CUDA toolkit's include folder (cuda_fp16.h, cuda_bf16.h and what they include; the
    partial header sets inside Python wheels lack some of it)."""
    home = lcuda.find_cuda_home()
    include = Path(home) / "include" if home else None
    needed = ("cuda_fp16.h", "cuda_bf16.h", "vector_types.h", "vector_functions.h", "crt/host_defines.h")
    if include is not None and all((include / h).is_file() for h in needed):
        return include
    return None


@pytest.fixture(scope="module")
def emulator():
    """Compiles the kernel source with the CPU emulation harness (once per source version and
    emulated architecture; cached) and returns {arch: executable}."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")
    headers = _cuda_header_dir()
    if cxx is None or headers is None:
        pytest.skip("needs a C++20 compiler and a CUDA toolkit's headers")
    kernel = (CUDA_SRC / "causal_linear_attention.cu").read_bytes()
    key = hashlib.sha256(_EMULATOR_SOURCE.encode() + kernel + cxx.encode()).hexdigest()[:16]
    out_dir = CACHE / "cuda_emulator" / key
    out_dir.mkdir(parents=True, exist_ok=True)
    harness = out_dir / "emulator.cpp"
    harness.write_text(_EMULATOR_SOURCE)
    exes, procs = {}, []
    # 800: fp16/bf16 take the tensor-core (WMMA) path; 700: the fp32-FMA path for every dtype.
    for arch in (800, 700):
        exe = out_dir / f"emulator_sm{arch // 10}"
        exes[arch] = exe
        if not exe.is_file():
            cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-DLLA_EMULATE",
                   f"-DLLA_EMULATE_ARCH={arch}", f"-I{headers}", f"-I{CUDA_SRC}", str(harness),
                   "-o", f"{exe}.tmp"]  # fmt: skip
            procs.append((subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True), exe))
    for proc, exe in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            pytest.fail(f"emulator build failed:\n{err[-4000:]}")
        os.replace(f"{exe}.tmp", exe)
    return exes


@pytest.mark.cuda_emulation
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "arch, dtype, bh, n, d, m",
    [
        (800, torch.float32, 2, 130, 33, 100),  # FMA path, partial chunks, D and M not multiples of 8
        (800, torch.float32, 1, 65, 256, 70),  # largest D: 8 state slabs in registers
        (800, torch.bfloat16, 1, 130, 33, 72),  # tensor cores, scalar q/k loads, vector v loads
        (800, torch.float16, 1, 70, 100, 20),  # tensor cores, bf16 copy of q for the state product
        (800, torch.bfloat16, 1, 65, 256, 8),  # tensor cores, largest D
        (700, torch.float16, 1, 130, 64, 64),  # pre-Ampere: half inputs through the FMA path
        (700, torch.bfloat16, 2, 70, 33, 100),
    ],
)
def test_kernels_emulated_on_cpu(emulator, tmp_path, arch, dtype, bh, n, d, m):
    """Forward and all three gradients computed by the kernel source itself (run by the CPU
    emulation) against autograd of the float64 naive definition."""
    q, k, v, g = (t[:, 0] for t in make_inputs(bh, 1, n, d, m, dtype, seed=n + d))
    for name, t in zip("qkvg", (q, k, v, g)):
        t.contiguous().view(torch.uint8).numpy().tofile(tmp_path / f"{name}.bin")
    code = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    proc = subprocess.run(
        [str(emulator[arch]), code, str(bh), str(n), str(d), str(m), str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]

    def read(name, shape):
        raw = torch.from_numpy(__import__("numpy").fromfile(tmp_path / f"{name}.bin", dtype="uint8"))
        return raw.view(dtype).reshape(shape)

    got = [read("out", v.shape), read("gq", q.shape), read("gk", k.shape), read("gv", v.shape)]
    want = reference(q, k, v, g)
    for name, x, ref in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < TOL[dtype], (name, rel_err(x, ref))


def _run_emulator(exe, tmp_path, q, k, v, g):
    """The kernel source's forward and gradients for (bh, n, d) / (bh, n, m) inputs, run by the
    CPU emulation: ``(out, grad_q, grad_k, grad_v)`` in the inputs' dtype."""
    import numpy as np

    bh, n, d = q.shape
    m = v.shape[-1]
    for name, t in zip("qkvg", (q, k, v, g)):
        t.contiguous().view(torch.uint8).numpy().tofile(tmp_path / f"{name}.bin")
    code = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[q.dtype]
    proc = subprocess.run([str(exe), code, str(bh), str(n), str(d), str(m), str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    def read(name, shape):
        return torch.from_numpy(np.fromfile(tmp_path / f"{name}.bin", dtype="uint8")).view(q.dtype).reshape(shape).clone()

    return read("out", v.shape), read("gq", q.shape), read("gk", k.shape), read("gv", v.shape)


@pytest.mark.cuda_emulation
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch, dtype", [(800, torch.float32), (800, torch.bfloat16), (700, torch.float16)])
def test_kernel_state_in_and_out_emulated(emulator, tmp_path, arch, dtype):
    """linear_cuda's state path: the kernel source (CPU emulation) as the stateless numerator
    inside ``dot_product_with_state``, exactly as ``lcuda.causal_dot_product`` composes it on a
    GPU, against autograd of the float64 recurrence from an initial state: outputs, final state
    and the gradients of q, k, v and the initial state."""
    from linformer_lab.ops.linear_attention import dot_product_with_state

    class Emulated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return _run_emulator(emulator[arch], tmp_path, q[0], k[0], v[0], torch.zeros_like(v[0]))[0][None]

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors
            _, gq, gk, gv = _run_emulator(emulator[arch], tmp_path, q[0], k[0], v[0], grad_out[0].to(q.dtype).contiguous())
            return gq[None], gk[None], gv[None]

    q, k, v, g = (t[:, 0][None] for t in make_inputs(2, 1, 70, 33, 40, dtype, seed=11))  # (1, BH=2, N, D)
    gen = torch.Generator().manual_seed(12)
    s0 = torch.randn(1, 2, 33, 40, generator=gen)
    g_final = torch.randn(1, 2, 33, 40, generator=gen)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    state = s0.clone().requires_grad_(True)
    out, final = dot_product_with_state(Emulated.apply, *leaves, initial_state=state, return_final_state=True)
    torch.autograd.backward([out, final], [g, g_final])

    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_state = s0.double().requires_grad_(True)
    states = ref_state.unsqueeze(2) + torch.einsum("bhnc,bhnm->bhncm", ref_leaves[1], ref_leaves[2]).cumsum(2)
    ref_out = torch.einsum("bhnc,bhncm->bhnm", ref_leaves[0], states)
    torch.autograd.backward([ref_out, states[:, :, -1]], [g.double(), g_final.double()])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    pairs = [("out", out, ref_out), ("final", final, states[:, :, -1]), ("grad S0", state.grad, ref_state.grad)]
    pairs += [(f"grad {n}", a.grad, b.grad) for n, a, b in zip("qkv", leaves, ref_leaves)]
    for name, got, want in pairs:
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


# ------------------------------------------------------------------------------------------------
# The CPU emulation harness (C++20). It includes the kernel file itself with LLA_EMULATE defined,
# supplies stand-ins for the CUDA features the kernels use, and launches them through the same
# planning code (plan_chunk_scan, forward_params, backward_params) as the real extension.
# ------------------------------------------------------------------------------------------------

_EMULATOR_SOURCE = r"""// CPU emulation harness for linformer_lab/ops/cuda/causal_linear_attention.cu.
//
// Runs the real kernel source as plain C++: every CUDA thread of a block is an OS thread,
// __syncthreads/__syncwarp are barriers, dynamic shared memory is a heap buffer (filled with
// NaN bytes so reads of never-written shared memory poison the result), and WMMA is a
// reference implementation that checks the API's alignment / leading-dimension rules and keeps
// the warp-collective semantics (each lane stores only its share of a tile, so a missing
// __syncwarp before other lanes read it shows up as a wrong result or a sanitizer report).
//
// usage: emu DTYPE(f32|f16|bf16) BH N D M DIR   reads DIR/{q,k,v,g}.bin, writes DIR/{out,gq,gk,gv}.bin
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define __launch_bounds__(...)
#define LLA_DEVICE inline
#define LLA_HOST_DEVICE
#define LLA_DECLARE_DYNAMIC_SMEM(name) unsigned char* name = ::lla_emu::t_smem

namespace lla_emu {
thread_local uint3 t_thread_idx, t_block_idx;
thread_local dim3 t_block_dim, t_grid_dim;
thread_local unsigned char* t_smem = nullptr;
thread_local std::size_t t_smem_bytes = 0;
thread_local std::barrier<>* t_block_barrier = nullptr;
thread_local std::barrier<>* t_warp_barrier = nullptr;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulation error: %s (block %u,%u thread %u)\n", what, t_block_idx.x, t_block_idx.y,
               t_thread_idx.x);
  std::abort();
}
inline void sync_block() { t_block_barrier->arrive_and_wait(); }
inline void sync_warp() { t_warp_barrier->arrive_and_wait(); }
inline int lane() { return static_cast<int>(t_thread_idx.x % 32); }
// Every WMMA operand of the kernel lives in shared memory: check the whole tile is inside it.
inline void check_smem_range(const void* p, std::size_t bytes) {
  auto* c = static_cast<const unsigned char*>(p);
  if (c < t_smem || c + bytes > t_smem + t_smem_bytes) fail("WMMA tile outside dynamic shared memory");
}
}  // namespace lla_emu

#define threadIdx (::lla_emu::t_thread_idx)
#define blockIdx (::lla_emu::t_block_idx)
#define blockDim (::lla_emu::t_block_dim)
#define gridDim (::lla_emu::t_grid_dim)
#define __syncthreads() ::lla_emu::sync_block()
#define __syncwarp() ::lla_emu::sync_warp()
inline void lla_emulate_trap() { ::lla_emu::fail("__trap()"); }
using std::max;
using std::min;

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

inline float as_float(float x) { return x; }
inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Each lane holds the whole 16 x 16 tile (the real register layout is unspecified anyway).
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only m16n16k16 is emulated");
  float v[16][16];
};

template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(sizeof(T) == 2, "operand tiles are 16-bit");
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) lla_emu::fail("load_matrix_sync: pointer not 32-byte aligned");
  if (ldm % 8 != 0) lla_emu::fail("load_matrix_sync: ldm not a multiple of 8 elements");
  lla_emu::check_smem_range(p, (15 * ldm + 16) * sizeof(T));
  lla_emu::sync_warp();
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.v[r][c] = as_float(std::is_same<Layout, row_major>::value ? p[r * ldm + c] : p[c * ldm + r]);
}

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float x) {
  for (auto& row : f.v)
    for (float& e : row) e = x;
}

template <class T, class La, class Lb>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, La>& a,
              const fragment<matrix_b, 16, 16, 16, T, Lb>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  lla_emu::sync_warp();
  fragment<accumulator, 16, 16, 16, float> r;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.v[i][j];
      for (int k = 0; k < 16; ++k) s += a.v[i][k] * b.v[k][j];
      r.v[i][j] = s;
    }
  d = r;
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) lla_emu::fail("store_matrix_sync: pointer not 32-byte aligned");
  if (ldm % 4 != 0) lla_emu::fail("store_matrix_sync: ldm not a multiple of 4 floats");
  lla_emu::check_smem_range(p, (15 * ldm + 16) * sizeof(float));
  lla_emu::sync_warp();
  // Each lane writes only its share, as the hardware does from its registers.
  for (int e = lla_emu::lane(); e < 256; e += 32) {
    const int r = e / 16, c = e % 16;
    p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = f.v[r][c];
  }
}
}  // namespace wmma
}  // namespace nvcuda

#include "causal_linear_attention.cu"

namespace lla_emu {
using linformer_lab_cuda::kThreads;
using linformer_lab_cuda::LaunchPlan;
using linformer_lab_cuda::ScanParams;

void run_block(const LaunchPlan& plan, const ScanParams& p, dim3 grid, unsigned bx, unsigned by) {
  const std::size_t bytes = static_cast<std::size_t>(plan.smem_bytes);
  std::unique_ptr<unsigned char[]> smem(new (std::align_val_t(128)) unsigned char[bytes]);
  std::memset(smem.get(), 0xFF, bytes);  // NaN in every float / half / bf16 view
  std::barrier<> block_barrier(kThreads);
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  for (int w = 0; w < kThreads / 32; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      t_thread_idx = make_uint3(static_cast<unsigned>(t), 0, 0);
      t_block_idx = make_uint3(bx, by, 0);
      t_block_dim = dim3(kThreads, 1, 1);
      t_grid_dim = grid;
      t_smem = smem.get();
      t_smem_bytes = bytes;
      t_block_barrier = &block_barrier;
      t_warp_barrier = warp_barriers[t / 32].get();
      plan.kernel(p);
    });
  }
  for (auto& th : threads) th.join();
  ::operator delete[](smem.release(), std::align_val_t(128));
}

void launch(const LaunchPlan& plan, const ScanParams& p, int64_t bh) {
  if (p.num_problems == 0 || p.n == 0 || bh == 0) return;
  const dim3 grid(static_cast<unsigned>(bh), static_cast<unsigned>(plan.blocks_y), 1);
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) run_block(plan, p, grid, bx, by);
}

template <typename T>
std::vector<T> read_file(const std::string& path, std::size_t count) {
  std::vector<T> data(count);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr || std::fread(data.data(), sizeof(T), count, f) != count) fail(("cannot read " + path).c_str());
  std::fclose(f);
  return data;
}

template <typename T>
void write_file(const std::string& path, const std::vector<T>& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(data.data(), sizeof(T), data.size(), f) != data.size())
    fail(("cannot write " + path).c_str());
  std::fclose(f);
}

template <typename T>
void run(int64_t bh, int64_t n, int d, int m, const std::string& dir) {
  const std::size_t nq = static_cast<std::size_t>(bh * n * d), nv = static_cast<std::size_t>(bh * n * m);
  const auto q = read_file<T>(dir + "/q.bin", nq), k = read_file<T>(dir + "/k.bin", nq);
  const auto v = read_file<T>(dir + "/v.bin", nv), g = read_file<T>(dir + "/g.bin", nv);
  // NaN-filled outputs: an element the kernel forgets to write fails the comparison.
  std::vector<T> out(nv), gq(nq), gk(nq), gv(nv);
  for (auto* buf : {&out, &gq, &gk, &gv}) std::memset(buf->data(), 0xFF, buf->size() * sizeof(T));
  const bool tensor_cores = LLA_EMULATE_ARCH >= 800;
  const ScanParams pf =
      linformer_lab_cuda::forward_params(q.data(), k.data(), v.data(), out.data(), n, d, m, sizeof(T));
  launch(linformer_lab_cuda::plan_chunk_scan<T>(pf, tensor_cores), pf, bh);
  const ScanParams pb = linformer_lab_cuda::backward_params(q.data(), k.data(), v.data(), g.data(), gq.data(),
                                                            gk.data(), gv.data(), n, d, m, sizeof(T));
  launch(linformer_lab_cuda::plan_chunk_scan<T>(pb, tensor_cores), pb, bh);
  write_file(dir + "/out.bin", out);
  write_file(dir + "/gq.bin", gq);
  write_file(dir + "/gk.bin", gk);
  write_file(dir + "/gv.bin", gv);
}
}  // namespace lla_emu

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s f32|f16|bf16 BH N D M DIR\n", argv[0]);
    return 2;
  }
  const std::string dtype = argv[1];
  const int64_t bh = std::atoll(argv[2]), n = std::atoll(argv[3]);
  const int d = std::atoi(argv[4]), m = std::atoi(argv[5]);
  if (dtype == "f32")
    lla_emu::run<float>(bh, n, d, m, argv[6]);
  else if (dtype == "f16")
    lla_emu::run<__half>(bh, n, d, m, argv[6]);
  else if (dtype == "bf16")
    lla_emu::run<__nv_bfloat16>(bh, n, d, m, argv[6]);
  else
    return 2;
  return 0;
}
"""
