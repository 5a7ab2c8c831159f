// Registers the causal linear-attention kernels as PyTorch operators:
//   torch.ops.linformer_lab_cuda.causal_dot_product_fwd(q, k, v) -> out
//   torch.ops.linformer_lab_cuda.causal_dot_product_bwd(q, k, v, grad_out, output_mask)
//       -> (grad_q, grad_k, grad_v)      (an entry is None where output_mask is False)
// q, k: (B, H, N, D); v, out, grad_out: (B, H, N, M); one dtype (fp32, fp16 or bf16), one CUDA
// device, contiguous, 1 <= D, M <= 256. Autograd is wired in Python (linformer_lab/ops/cuda).
//
// Every argument is checked here, before anything touches the GPU, so that a wrong call fails
// with a message naming the bad value instead of a CUDA error or silent garbage.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <limits>
#include <tuple>

namespace linformer_lab_cuda {

at::Tensor causal_dot_product_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_dot_product_backward_cuda(const at::Tensor& q,
                                                                                const at::Tensor& k,
                                                                                const at::Tensor& v,
                                                                                const at::Tensor& grad_out,
                                                                                std::array<bool, 3> output_mask);

namespace {

constexpr int64_t kMaxFeatureDim = 256;  // sizes the register-resident state in the kernel

void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), "causal_dot_product (linear_cuda backend): expected CUDA tensors, but ", name,
              " is on ", t.device(),
              ". For CPU tensors use the `linear` backend.");
  TORCH_CHECK(t.device() == q.device(), "causal_dot_product: all inputs must be on one device, but q is on ",
              q.device(), " and ", name, " on ", t.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "causal_dot_product: q, k, v (and grad_out) must share one dtype, ",
              "but q is ", q.scalar_type(), " and ", name, " is ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4, "causal_dot_product: ", name, " must have 4 dimensions (B, H, N, features), got shape ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "causal_dot_product: ", name,
              " must be contiguous (the Python wrapper linformer_lab.ops.cuda.causal_dot_product makes it so)");
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* grad_out) {
  check_tensor(q, "q", q);
  check_tensor(k, "k", q);
  check_tensor(v, "v", q);
  if (grad_out != nullptr) check_tensor(*grad_out, "grad_out", q);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "causal_dot_product: dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k.sizes() == q.sizes(), "causal_dot_product: q and k must have the same shape (B, H, N, D), got q ",
              q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
              "causal_dot_product: v must have shape (B, H, N, M) with the (B, H, N) of q, got q ", q.sizes(),
              " and v ", v.sizes());
  const int64_t d = q.size(3), m = v.size(3);
  TORCH_CHECK(d >= 1 && d <= kMaxFeatureDim, "causal_dot_product: feature dimension D of q and k must be in 1..",
              kMaxFeatureDim, ", got D = ", d);
  TORCH_CHECK(m >= 1 && m <= kMaxFeatureDim, "causal_dot_product: value dimension M of v must be in 1..",
              kMaxFeatureDim, ", got M = ", m);
  TORCH_CHECK(q.size(0) * q.size(1) <= std::numeric_limits<int32_t>::max(),
              "causal_dot_product: B * H = ", q.size(0) * q.size(1), " exceeds the grid limit 2^31 - 1");
  if (grad_out != nullptr) {
    TORCH_CHECK(grad_out->sizes() == v.sizes(), "causal_dot_product: grad_out must have the shape of v ", v.sizes(),
                ", got ", grad_out->sizes());
  }
}

at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_inputs(q, k, v, nullptr);
  return causal_dot_product_forward_cuda(q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& grad_out, std::array<bool, 3> output_mask) {
  check_inputs(q, k, v, &grad_out);
  return causal_dot_product_backward_cuda(q, k, v, grad_out, output_mask);
}

}  // namespace
}  // namespace linformer_lab_cuda

TORCH_LIBRARY(linformer_lab_cuda, m) {
  m.def("causal_dot_product_fwd(Tensor q, Tensor k, Tensor v) -> Tensor");
  m.def(
      "causal_dot_product_bwd(Tensor q, Tensor k, Tensor v, Tensor grad_out, bool[3] output_mask)"
      " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linformer_lab_cuda, CUDA, m) {
  m.impl("causal_dot_product_fwd", &linformer_lab_cuda::forward);
  m.impl("causal_dot_product_bwd", &linformer_lab_cuda::backward);
}

// CPU tensors reach the same checks, so the caller gets the message that points to the CPU
// backend rather than the dispatcher's "could not run ... with arguments from the CPU backend".
TORCH_LIBRARY_IMPL(linformer_lab_cuda, CPU, m) {
  m.impl("causal_dot_product_fwd", &linformer_lab_cuda::forward);
  m.impl("causal_dot_product_bwd", &linformer_lab_cuda::backward);
}
