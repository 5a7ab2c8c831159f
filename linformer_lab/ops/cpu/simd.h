// What the kernels of this folder (causal_recurrence.cpp, lsh_window.cpp) share:
// SIMD registers as GCC vector types, their loads and stores, and the choice at run
// time among the versions of the hot loops compiled for AVX-512, AVX2 + FMA and the SSE2 baseline.
//
// Each kernel is built into a module of its own (linformer_lab/ops/cpu/__init__.py, whose build
// cache hashes this header with each source). Everything here has internal linkage, so each
// module has its own instruction-set choice: set_instruction_set on one leaves the other alone.
#pragma once

// The vectors below are always inlined, so no function passes one: their ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <string>

#define INLINE inline __attribute__((always_inline))

// The hot loops are compiled once per instruction set, each under its own target attribute, with
// no -march: one cached build serves every x86-64 CPU.
#if defined(__GNUC__) && defined(__x86_64__)
#define TARGET(x) __attribute__((target(x)))
#else
#define TARGET(x)
#endif
#define TARGET_AVX512 TARGET("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
#define TARGET_AVX2 TARGET("avx2,fma")

namespace {

// One SIMD register of B bytes of T (64: AVX-512, 32: AVX2, 16: SSE2).
template <typename T, int B>
struct Register {
  typedef T type __attribute__((vector_size(B)));
};

// Unaligned loads and stores of one register (memcpy compiles to one move instruction).
template <typename T, int B>
INLINE typename Register<T, B>::type load(const T* p) {
  typename Register<T, B>::type x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename T, int B>
INLINE void store(T* p, typename Register<T, B>::type x) { std::memcpy(p, &x, sizeof(x)); }

enum class Isa { kAvx512, kAvx2, kBaseline };

Isa detect() {
#if defined(__GNUC__) && defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

const Isa kBest = detect();
Isa kIsa = kBest;  // the version in use: the best, or a lower one chosen by set_instruction_set (tests, benchmarks)

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "baseline";
}

// The module's instruction_set() and set_instruction_set(name) (tests and benchmarks run every version).
void bind_instruction_set(pybind11::module& module) {
  module.def("instruction_set", [] { return isa_name(kIsa); }, "the version of the hot loops in use");
  module.def("set_instruction_set", [](const std::string& name) {
    const Isa want = name == "avx512" ? Isa::kAvx512 : name == "avx2" ? Isa::kAvx2 : Isa::kBaseline;
    TORCH_CHECK(name == isa_name(want), "instruction set must be avx512, avx2 or baseline, not ", name);
    TORCH_CHECK(static_cast<int>(want) >= static_cast<int>(kBest), "this CPU lacks ", name, " (best: ", isa_name(kBest), ")");
    const char* before = isa_name(kIsa);
    kIsa = want;
    return std::string(before);
  }, "use the hot loops for this instruction set (one the CPU has); returns the one used before");
}

}  // namespace
