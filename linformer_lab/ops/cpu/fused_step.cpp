// One RNN step (paper §3.4, eq. 16-20) of a whole stack of pre-norm transformer layers with
// causal linear attention, on CPU, in one call. The feature map phi is one of three, the same in
// every layer (the feature maps whose kernel_form names fused_step: feature_maps/base.py):
//   elu       phi(x) = elu(x) + 1 = exp(min(x, 0)) + max(x, 0)          (the paper's, eq. 7; C = D)
//   t2r       phi(x) = relu(W x + b), one W (F, D) for queries and keys  (C = F)
//   hedgehog  phi(x) = [softmax(W x + b), softmax(-(W x + b))], W and b apart for queries and
//             for keys                                                    (C = 2 F)
// with the learned maps' W and b of each layer shared by its heads (feature_maps/learned.py).
//
// Per layer, for x (B, d_model):
//   a = LayerNorm_1(x);  [q | k | v] = a W_qkv^T + b_qkv
//   per (batch, head): S += phi(k) v^T, Z += phi(k) (in place, on the (C, M + 1) [S | Z] buffer
//   of a LinearState), out = phi(q)^T S / (phi(q)^T Z + eps)
//   x = x + (out W_out^T + b_out)
//   x = x + (GELU(LayerNorm_2(x) W_up^T + b_up) W_down^T + b_down)
// and the stack's final LayerNorm: what linformer_lab.models.generation.fast_step computes with
// a few dozen tensor operations per layer, here with no per-operation dispatch except the four
// weight products (ATen's CPU mm, the BLAS that fast_step's addmm uses, on the same transposed
// weights) and the GELU (ATen's CPU kernel) per layer.
//
// The caller (linformer_lab/models/generation/cpu_step.py) checks that the stack has this form; this
// file checks shapes, dtypes and layouts. Built by linformer_lab/ops/cpu/__init__.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

// The tensors of one layer, in the order the caller passes them: these twelve, then the feature
// map's weights as the map holds them, W (F, D) and b (F): none for elu, [W, b] for t2r,
// [W_query, b_query, W_key, b_key] for hedgehog. W is not transposed: row f is then contiguous,
// and phi's features are F dot products of length D.
constexpr int kLayerWeights = 12;
enum Weight { kNorm1W, kNorm1B, kQkvWT, kQkvB, kOutWT, kOutB, kNorm2W, kNorm2B, kUpWT, kUpB, kDownWT, kDownB,
              kMapQueryW, kMapQueryB, kMapKeyW, kMapKeyB };

enum class FeatureMap { kElu, kT2R, kHedgehog };

FeatureMap parse_feature_map(const std::string& name) {
  if (name == "elu") return FeatureMap::kElu;
  if (name == "t2r") return FeatureMap::kT2R;
  TORCH_CHECK(name == "hedgehog", "FusedStack: feature_map must be elu, t2r or hedgehog, got ", name);
  return FeatureMap::kHedgehog;
}

int64_t map_tensors(FeatureMap map) { return map == FeatureMap::kElu ? 0 : map == FeatureMap::kT2R ? 2 : 4; }

template <typename scalar_t>
void layer_norm(const scalar_t* x, scalar_t* y, const scalar_t* w, const scalar_t* b, int64_t rows, int64_t d,
                double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * d;
      scalar_t* yr = y + r * d;
      double mean = 0;
      for (int64_t i = 0; i < d; ++i) mean += xr[i];
      mean /= d;
      double var = 0;
      for (int64_t i = 0; i < d; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      var /= d;  // biased, as LayerNorm
      const scalar_t m = static_cast<scalar_t>(mean);
      const scalar_t rstd = static_cast<scalar_t>(1.0 / std::sqrt(var + eps));
      for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] - m) * rstd * w[i] + b[i];
    }
  });
}

// out = in W^T + b for W^T stored (in, out): ATen's CPU mm (the BLAS that addmm calls), then the
// bias in a loop (addmm would copy the bias into out through one more dispatched operation first)
template <typename scalar_t>
void linear(at::Tensor& out, const at::Tensor& in, const at::Tensor& weight_t, const at::Tensor& bias) {
  at::cpu::mm_out(out, in, weight_t);
  scalar_t* o = out.data_ptr<scalar_t>();
  const scalar_t* b = bias.data_ptr<scalar_t>();
  const int64_t rows = out.size(0), n = out.size(1);
  for (int64_t r = 0; r < rows; ++r, o += n) {
    for (int64_t i = 0; i < n; ++i) o[i] += b[i];
  }
}

template <typename scalar_t>
void add_into(scalar_t* x, const scalar_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

template <typename scalar_t>
inline scalar_t elu_plus_one(scalar_t x) {
  return std::exp(std::min(x, scalar_t(0))) + std::max(x, scalar_t(0));
}

// The learned maps of one layer: W (F, D) row-major and b (F), for queries and for keys (the same
// pointers for t2r).
template <typename scalar_t>
struct MapWeights {
  const scalar_t *query_w = nullptr, *query_b = nullptr, *key_w = nullptr, *key_b = nullptr;
  int64_t features = 0;  // F
};

// phi (C) of one head's query or key x (D) under a learned map: t2r's relu(W x + b) (C = F), or
// hedgehog's [softmax(p), softmax(-p)] for p = W x + b (C = 2 F), each softmax shifted by its own
// maximum (max p, and -min p for -p) so that no exp overflows, as torch.softmax is.
template <typename scalar_t>
void learned_features(FeatureMap map, const scalar_t* x, const scalar_t* w, const scalar_t* bias, int64_t features,
                      int64_t qdim, scalar_t* phi) {
  for (int64_t f = 0; f < features; ++f) {
    const scalar_t* wf = w + f * qdim;
    scalar_t p = bias[f];
    for (int64_t d = 0; d < qdim; ++d) p += wf[d] * x[d];
    phi[f] = p;
  }
  if (map == FeatureMap::kT2R) {
    for (int64_t f = 0; f < features; ++f) phi[f] = std::max(phi[f], scalar_t(0));
    return;
  }
  const auto [low, high] = std::minmax_element(phi, phi + features);
  const scalar_t lowest = *low, highest = *high;
  scalar_t positive = 0, negative = 0;
  for (int64_t f = 0; f < features; ++f) {
    phi[features + f] = std::exp(lowest - phi[f]);  // softmax(-p): -p - max(-p) = min(p) - p
    phi[f] = std::exp(phi[f] - highest);
    positive += phi[f];
    negative += phi[features + f];
  }
  for (int64_t f = 0; f < features; ++f) {
    phi[f] /= positive;
    phi[features + f] /= negative;
  }
}

// One feature c of one (batch, head) row: S[c] += phi_k v^T, Z[c] += phi_k on the state's row
// s = [S[c] | Z[c]] (M + 1), and acc += phi_q s (the row's share of [phi(q)^T S | phi(q)^T Z]).
template <typename scalar_t>
inline void update_and_read(scalar_t* s, scalar_t phi_k, scalar_t phi_q, const scalar_t* v, scalar_t* acc,
                            int64_t vdim) {
  for (int64_t m = 0; m < vdim; ++m) s[m] += phi_k * v[m];
  s[vdim] += phi_k;
  for (int64_t m = 0; m <= vdim; ++m) acc[m] += phi_q * s[m];
}

// qkv (B, H (2 D + M)) laid out [queries | keys | values], each H blocks; joint (B, H, C, M + 1)
// = [S | Z] with C = `rows` features, updated in place; out (B, H M).
template <typename scalar_t>
void linear_attention_step(const scalar_t* qkv, scalar_t* joint, scalar_t* out, int64_t batch, int64_t heads,
                           int64_t qdim, int64_t vdim, int64_t rows, scalar_t eps, FeatureMap map,
                           const MapWeights<scalar_t>& learned) {
  const int64_t width = heads * (2 * qdim + vdim), cols = vdim + 1;
  const int64_t grain = std::max<int64_t>(1, 16384 / (rows * cols));  // a few rows stay on this thread
  at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> acc(cols), phi_q(map == FeatureMap::kElu ? 0 : rows), phi_k(phi_q.size());
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / heads, h = row % heads;
      const scalar_t* q = qkv + b * width + h * qdim;
      const scalar_t* k = q + heads * qdim;
      const scalar_t* v = qkv + b * width + 2 * heads * qdim + h * vdim;
      scalar_t* state = joint + row * rows * cols;
      std::fill(acc.begin(), acc.end(), scalar_t(0));
      if (map == FeatureMap::kElu) {  // phi inline, one feature per input dimension
        for (int64_t c = 0; c < qdim; ++c) {
          update_and_read(state + c * cols, elu_plus_one(k[c]), elu_plus_one(q[c]), v, acc.data(), vdim);
        }
      } else {  // a learned map mixes the D inputs: all C features first, then the same update
        learned_features(map, q, learned.query_w, learned.query_b, learned.features, qdim, phi_q.data());
        learned_features(map, k, learned.key_w, learned.key_b, learned.features, qdim, phi_k.data());
        for (int64_t c = 0; c < rows; ++c) update_and_read(state + c * cols, phi_k[c], phi_q[c], v, acc.data(), vdim);
      }
      const scalar_t denominator = acc[vdim] + eps;
      scalar_t* o = out + b * heads * vdim + h * vdim;
      for (int64_t m = 0; m < vdim; ++m) o[m] = acc[m] / denominator;
    }
  });
}

class FusedStack {
 public:
  FusedStack(std::vector<at::Tensor> weights, std::vector<double> norm_eps, int64_t heads, int64_t query_dim,
             int64_t value_dim, double attention_eps, std::string approximate, const std::string& feature_map)
      : weights_(std::move(weights)), norm_eps_(std::move(norm_eps)), heads_(heads), qdim_(query_dim),
        vdim_(value_dim), eps_(attention_eps), approximate_(std::move(approximate)),
        map_(parse_feature_map(feature_map)), per_layer_(kLayerWeights + map_tensors(map_)) {
    const int64_t count = static_cast<int64_t>(weights_.size());
    TORCH_CHECK(count % per_layer_ == 2 && count > 2, "FusedStack: expected ", per_layer_, " tensors per layer (",
                feature_map, ") and the final norm's weight and bias, got ", count);
    layers_ = count / per_layer_;
    TORCH_CHECK(static_cast<int64_t>(norm_eps_.size()) == 2 * layers_ + 1, "FusedStack: one eps per LayerNorm");
    TORCH_CHECK(heads_ > 0 && qdim_ > 0 && vdim_ > 0, "FusedStack: heads and head sizes must be positive");
    TORCH_CHECK(approximate_ == "none" || approximate_ == "tanh", "FusedStack: GELU approximate must be none or tanh");
    const at::Tensor& first = weights_[kNorm1W];
    d_model_ = first.size(0);
    d_ff_ = weights_[kUpB].size(0);
    dtype_ = first.scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kDouble, "FusedStack: float32 or float64 weights only");
    const int64_t qkv = heads_ * (2 * qdim_ + vdim_), att = heads_ * vdim_;
    features_ = map_ == FeatureMap::kElu ? 0 : weights_[kMapQueryB].numel();  // its shape is checked below
    rows_ = map_ == FeatureMap::kElu ? qdim_ : map_ == FeatureMap::kT2R ? features_ : 2 * features_;
    for (int64_t l = 0; l < layers_; ++l) {
      check(l, kNorm1W, {d_model_}); check(l, kNorm1B, {d_model_});
      check(l, kQkvWT, {d_model_, qkv}); check(l, kQkvB, {qkv});
      check(l, kOutWT, {att, d_model_}); check(l, kOutB, {d_model_});
      check(l, kNorm2W, {d_model_}); check(l, kNorm2B, {d_model_});
      check(l, kUpWT, {d_model_, d_ff_}); check(l, kUpB, {d_ff_});
      check(l, kDownWT, {d_ff_, d_model_}); check(l, kDownB, {d_model_});
      for (int64_t i = 0; i < map_tensors(map_); i += 2) {  // one F for the stack: the states' C
        check(l, kMapQueryW + i, {features_, qdim_}); check(l, kMapQueryB + i, {features_});
      }
    }
    check(layers_, 0, {d_model_});
    check(layers_, 1, {d_model_});
  }

  // x (B, d_model) -> the stack's output (B, d_model); joints: per layer the (B, H, C, M + 1)
  // [S | Z] buffer of its state, updated in place.
  at::Tensor step(const at::Tensor& x_in, const std::vector<at::Tensor>& joints) const {
    // no autograd: the caller runs without it, and the state is updated in place
    c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == dtype_ && x_in.dim() == 2 &&
                x_in.size(1) == d_model_, "FusedStack.step: x must be a CPU (B, ", d_model_, ") tensor of the weights' dtype");
    TORCH_CHECK(static_cast<int64_t>(joints.size()) == layers_, "FusedStack.step: one state per layer");
    const int64_t batch = x_in.size(0);
    for (const at::Tensor& joint : joints) {
      TORCH_CHECK(joint.device().is_cpu() && joint.scalar_type() == dtype_ && joint.is_contiguous() &&
                  joint.sizes() == at::IntArrayRef({batch, heads_, rows_, vdim_ + 1}),
                  "FusedStack.step: a state does not fit (expected a contiguous (", batch, ", ", heads_, ", ", rows_,
                  ", ", vdim_ + 1, ") [S | Z] buffer of the weights' dtype)");
    }
    // as an in-place ATen op would: a state that is an inference tensor outside inference mode
    // is refused here (before any state changes), and autograd sees the change of version
    for (const at::Tensor& joint : joints) joint.unsafeGetTensorImpl()->bump_version();
    at::Tensor x = x_in.contiguous().clone();  // the residual stream
    const auto options = x.options();
    at::Tensor normed = at::empty({batch, d_model_}, options), added = at::empty({batch, d_model_}, options);
    at::Tensor qkv = at::empty({batch, heads_ * (2 * qdim_ + vdim_)}, options);
    at::Tensor attended = at::empty({batch, heads_ * vdim_}, options), hidden = at::empty({batch, d_ff_}, options);
    at::Tensor out = at::empty({batch, d_model_}, options);
    AT_DISPATCH_FLOATING_TYPES(dtype_, "FusedStack.step", [&] {
      scalar_t* xs = x.data_ptr<scalar_t>();
      const int64_t n = batch * d_model_;
      for (int64_t l = 0; l < layers_; ++l) {
        const at::Tensor* w = &weights_[l * per_layer_];
        layer_norm(xs, normed.data_ptr<scalar_t>(), w[kNorm1W].data_ptr<scalar_t>(), w[kNorm1B].data_ptr<scalar_t>(),
                   batch, d_model_, norm_eps_[2 * l]);
        linear<scalar_t>(qkv, normed, w[kQkvWT], w[kQkvB]);
        linear_attention_step(qkv.data_ptr<scalar_t>(), joints[l].data_ptr<scalar_t>(), attended.data_ptr<scalar_t>(),
                              batch, heads_, qdim_, vdim_, rows_, static_cast<scalar_t>(eps_), map_,
                              map_weights<scalar_t>(w));
        linear<scalar_t>(added, attended, w[kOutWT], w[kOutB]);
        add_into(xs, added.data_ptr<scalar_t>(), n);
        layer_norm(xs, normed.data_ptr<scalar_t>(), w[kNorm2W].data_ptr<scalar_t>(), w[kNorm2B].data_ptr<scalar_t>(),
                   batch, d_model_, norm_eps_[2 * l + 1]);
        linear<scalar_t>(hidden, normed, w[kUpWT], w[kUpB]);
        at::cpu::gelu_(hidden, approximate_);
        linear<scalar_t>(added, hidden, w[kDownWT], w[kDownB]);
        add_into(xs, added.data_ptr<scalar_t>(), n);
      }
      const at::Tensor* w = &weights_[layers_ * per_layer_];
      layer_norm(xs, out.data_ptr<scalar_t>(), w[0].data_ptr<scalar_t>(), w[1].data_ptr<scalar_t>(), batch, d_model_,
                 norm_eps_[2 * layers_]);
    });
    return out;
  }

  int64_t layers() const { return layers_; }

 private:
  // a layer's learned-map weights (t2r: the keys' are the queries')
  template <typename scalar_t>
  MapWeights<scalar_t> map_weights(const at::Tensor* w) const {
    MapWeights<scalar_t> learned;
    if (map_ == FeatureMap::kElu) return learned;
    const int key = map_ == FeatureMap::kT2R ? kMapQueryW : kMapKeyW;
    learned.query_w = w[kMapQueryW].data_ptr<scalar_t>();
    learned.query_b = w[kMapQueryB].data_ptr<scalar_t>();
    learned.key_w = w[key].data_ptr<scalar_t>();
    learned.key_b = w[key + 1].data_ptr<scalar_t>();
    learned.features = features_;
    return learned;
  }

  void check(int64_t layer, int64_t index, std::vector<int64_t> shape) const {
    const at::Tensor& t = weights_[layer * per_layer_ + index];
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype_ && t.is_contiguous() && t.sizes() == at::IntArrayRef(shape),
                "FusedStack: tensor ", index, " of layer ", layer, " must be a contiguous CPU tensor of shape ",
                at::IntArrayRef(shape), " and the weights' dtype, got ", t.sizes(), " ", t.scalar_type());
  }

  std::vector<at::Tensor> weights_;
  std::vector<double> norm_eps_;
  int64_t heads_, qdim_, vdim_;
  double eps_;
  std::string approximate_;
  FeatureMap map_;
  int64_t per_layer_;
  int64_t layers_ = 0, d_model_ = 0, d_ff_ = 0;
  int64_t features_ = 0, rows_ = 0;  // F of a learned map (0 for elu); C, the state's rows per head
  at::ScalarType dtype_ = at::kFloat;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The fused CPU RNN step of a linear-attention transformer stack (feature map elu + 1, t2r or hedgehog)";
  pybind11::class_<FusedStack>(m, "FusedStack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<double>, int64_t, int64_t, int64_t, double,
                          std::string, const std::string&>(),
           pybind11::arg("weights"), pybind11::arg("norm_eps"), pybind11::arg("heads"), pybind11::arg("query_dim"),
           pybind11::arg("value_dim"), pybind11::arg("attention_eps"), pybind11::arg("approximate"),
           pybind11::arg("feature_map"))
      .def("step", &FusedStack::step, pybind11::arg("x"), pybind11::arg("joints"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("layers", &FusedStack::layers);
}
