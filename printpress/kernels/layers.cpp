// The exact path's layers in C++ (printpress/model.py, `Layer.attention_inputs` and `Layer.after_attention`): the
// same ATen operators, on the same tensors, in the same order as the Python methods, so the same bits; only the
// Python around each operator is gone. A decoder pass over a canvas of 32 on the shipped model runs ~700 small
// operators, and Python spent about as long dispatching them as ATen spent computing everything but the products.
//
// Every value but one kind comes out of the ATen operator that the Python code calls (`F.linear` is at::linear,
// `x.pow(2)` is at::pow, `tensor + float` is at::add with a scalar, ...), with the same dtypes and layouts, so each
// result is what the Python method returns (tests/test_layers_native.py compares them bit for bit). The exception is
// the float32 RMS norm (`rms_rows`): seven ATen operators per norm, ~50 norms a pass, computed here in one loop over
// each row with the same roundings in the same order, ATen's summation order included (`aten_row_sum`). The library
// checks that on its first use against ATen on this machine (`FusedNorms`), and computes the norms with ATen's
// operators where it does not hold. Both operators are registered without a dispatch key (CompositeImplicitAutograd): autograd, where
// it is on, would see the ATen operators themselves, but the model calls them only with gradients off.
//
// Only torch/library.h and ATen's per-operator headers: the library builds in seconds on a machine's first pass.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/_grouped_mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// model.activation's functions, by the code model.py passes (ACTIVATION_CODES there).
Tensor act(const Tensor& x, int64_t code) {
  switch (code) {
    case 0: return at::gelu(x, "tanh");  // gelu_tanh outside compiled graphs: F.gelu(x, approximate="tanh")
    case 1: return at::gelu(x);          // F.gelu
    case 2: return at::silu(x);          // F.silu
  }
  TORCH_CHECK(false, "printpress_layers: unknown activation code ", code);
}

// x.float(): x itself when it is float32 already.
Tensor as_float(const Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat); }

// -- the float32 RMS norm in one loop ---------------------------------------------------------------------------
//
// ATen's float sum over a contiguous last dimension (aten/src/ATen/native/cpu/SumKernel.cpp, `cascade_sum`): a row of
// n values is read as n / W vectors of W lanes (W: ATen's vector width on this CPU) plus a scalar tail. The vectors
// are summed lane by lane as four interleaved sequences (vector 4i + k into sequence k), each accumulated in levels of
// at least 16 (a cascade: every 16 additions pass up a level), the four then added in order 0 + 1 + 2 + 3; the tail
// is summed into a float from 0, then the W lanes of that vector added to it in order; the result is added to the
// zero ATen's output starts as. Rows shorter than W take the same four-sequence cascade over single values.
// All float additions, none fused into a multiply (the library is built with -ffp-contract=off), so the same bits.

int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// The cascade over `size` groups of 4 interleaved elements of L lanes: element (i, k) starts at data + (4 i + k) L.
template <int L>
void four_sums(const float* data, int64_t size, float out[4][L]) {
  constexpr int kLevels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][4][L] = {};
  auto add_group = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += data[(4 * i + k) * L + l];
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_group(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_group(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  std::memcpy(out, acc[0], sizeof(float) * 4 * L);
}

// ATen's row_sum over `size` elements of L lanes: the four sequences, the elements after the last group of four
// into the first, then the four in order.
template <int L>
void row_sum(const float* data, int64_t size, float out[L]) {
  float sums[4][L];
  const int64_t groups = size / 4;
  four_sums<L>(data, groups, sums);
  for (int64_t i = groups * 4; i < size; ++i)
    for (int l = 0; l < L; ++l) sums[0][l] += data[i * L + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < L; ++l) sums[0][l] += sums[k][l];
  std::memcpy(out, sums[0], sizeof(float) * L);
}

template <int W>
float aten_row_sum(const float* row, int64_t n) {
  float total;
  if (n >= W) {
    const int64_t vectors = n / W;
    float lanes[W];
    row_sum<W>(row, vectors, lanes);
    total = 0.0f;
    for (int64_t k = vectors * W; k < n; ++k) total += row[k];
    for (int l = 0; l < W; ++l) total += lanes[l];
  } else {
    row_sum<1>(row, n, &total);
  }
  return 0.0f + total;
}

// rms_normalize (then the weight, if defined) of each row of a contiguous float32 x with ATen's vector width W:
// h * (1 / sqrt(sum(h * h) / n + eps)), then * weight. ATen's pow(t, -0.5) is 1 / sqrt in float on its vector path
// and in double on its scalar tail, which round alike (a double holds more than twice a float's digits).
template <int W>
void rms_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps) {
  std::vector<float> squares(n);
  const float count = static_cast<float>(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    for (int64_t i = 0; i < n; ++i) squares[i] = row[i] * row[i];
    const float mean = aten_row_sum<W>(squares.data(), n) / count;
    const float inverse = 1.0f / std::sqrt(mean + eps);
    float* dst = out + r * n;
    for (int64_t i = 0; i < n; ++i) dst[i] = row[i] * inverse;
    if (weight != nullptr)
      for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] * weight[i];
  }
}

// model.rms_normalize in ATen's operators: h * pow(mean(h^2) + eps, -0.5), h = x.float().
Tensor aten_rms_normalize(const Tensor& x, double eps) {
  Tensor h = as_float(x);
  return h * at::pow(at::add(at::pow(h, 2).mean(-1, /*keepdim=*/true), eps), -0.5);
}

// Whether rms_rows<W> gives ATen's bits on this machine, and for which W: decided once, on rows of many lengths and
// magnitudes, against the ATen operators themselves. 0: for neither width (the norms stay ATen's).
class FusedNorms {
 public:
  static int width() {
    static const int w = choose();
    return w;
  }

 private:
  static int choose() {
    if (check<16>()) return 16;
    if (check<8>()) return 8;
    return 0;
  }

  template <int W>
  static bool check() {
    const int64_t lengths[] = {1, 3, 7, 8, 15, 16, 17, 31, 64, 100, 192, 257, 1000, 1024, 4096, 5000, 20000};
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (int64_t n : lengths) {
      const int64_t rows = n > 4096 ? 1 : 5;
      Tensor x = at::empty({rows, n}, at::TensorOptions().dtype(at::kFloat));
      float* data = x.data_ptr<float>();
      for (int64_t i = 0; i < rows * n; ++i) {  // a cheap generator: magnitudes over ~30 octaves, both signs
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const double unit = static_cast<double>(state >> 11) * (1.0 / 9007199254740992.0);
        data[i] = static_cast<float>((unit - 0.5) * std::ldexp(1.0, static_cast<int>(state % 31) - 15));
      }
      Tensor expected = aten_rms_normalize(x, 1e-6);
      Tensor got = at::empty_like(x);
      rms_rows<W>(data, nullptr, got.data_ptr<float>(), rows, n, 1e-6f);
      if (std::memcmp(expected.data_ptr<float>(), got.data_ptr<float>(), sizeof(float) * rows * n) != 0) return false;
    }
    return true;
  }
};

// Whether the one-loop norm stands in for ATen's operators for x: float32, contiguous, and a sum ATen would not
// split between threads (it may, past 32768 elements, with more than one).
bool fused_norm(const Tensor& x) {
  return x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() > 0 && x.size(-1) > 0 &&
         (x.numel() < 32768 || at::get_num_threads() == 1) && FusedNorms::width() != 0;
}

Tensor fused_rms(const Tensor& x, const Tensor& weight, double eps) {
  Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1);
  Tensor w = weight.defined() ? weight.contiguous() : weight;
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  if (FusedNorms::width() == 16) {
    rms_rows<16>(x.data_ptr<float>(), wp, out.data_ptr<float>(), x.numel() / n, n, e);
  } else {
    rms_rows<8>(x.data_ptr<float>(), wp, out.data_ptr<float>(), x.numel() / n, n, e);
  }
  return out;
}

// model.rms_normalize.
Tensor rms_normalize(const Tensor& x, double eps) {
  return fused_norm(x) ? fused_rms(x, Tensor(), eps) : aten_rms_normalize(x, eps);
}

// RMSNorm.scale: the weight applied in float32 (an undefined weight: a weightless norm), cast back to `dtype`.
Tensor scale(const Tensor& normalized, const Tensor& weight, at::ScalarType dtype) {
  Tensor h = normalized;
  if (weight.defined()) h = h * as_float(weight);
  return h.scalar_type() == dtype ? h : h.to(dtype);
}

// RMSNorm.forward.
Tensor norm(const Tensor& x, const Tensor& weight, double eps) {
  if (fused_norm(x) && (!weight.defined() || weight.scalar_type() == at::kFloat)) return fused_rms(x, weight, eps);
  return scale(rms_normalize(x, eps), weight, x.scalar_type());
}

// model.rotate: x * cos + roll(x, D / 2) * signed_sin.
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  return x * cos + x.roll({x.size(-1) / 2}, {-1}) * signed_sin;
}

// GatedMLP.forward / SelfConditioning's MLP: down(act(gate(x)) * up(x)).
Tensor gated_mlp(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down, int64_t code) {
  return at::linear(act(at::linear(x, gate), code) * at::linear(x, up), down);
}

// Experts.expert_mlp: one expert's gated MLP from the packed weights.
Tensor expert_mlp(const Tensor& x, const Tensor& gate_up, const Tensor& down, int64_t code) {
  auto gate_up_out = at::linear(x, gate_up).chunk(2, -1);
  return at::linear(act(gate_up_out[0], code) * gate_up_out[1], down);
}

// Experts.forward with gradients off: `_one_token` for one row, else the sort, the two grouped products and the
// slot-ordered sum.
Tensor experts(const Tensor& x, const Tensor& weights, const Tensor& chosen, const Tensor& gate_up_proj,
               const Tensor& down_proj, int64_t code) {
  if (x.size(0) == 1) {
    std::vector<Tensor> rows;
    Tensor row = chosen[0].contiguous();
    const int64_t* index = row.data_ptr<int64_t>();
    for (int64_t slot = 0; slot < row.numel(); ++slot) {
      rows.push_back(expert_mlp(x, gate_up_proj.select(0, index[slot]), down_proj.select(0, index[slot]), code));
    }
    Tensor weighted = at::cat(rows) * weights.reshape({-1, 1});
    Tensor summed = weighted.sum(0, /*keepdim=*/true);
    return summed.scalar_type() == x.scalar_type() ? summed : summed.to(x.scalar_type());
  }
  const int64_t top_k = chosen.size(-1);
  Tensor flat = chosen.reshape(-1);
  Tensor order = std::get<1>(at::sort(flat));
  Tensor counts = at::bincount(flat, {}, gate_up_proj.size(0));
  Tensor gathered = x.index_select(0, at::floor_divide(order, top_k));
  Tensor slot_weights = weights.reshape(-1).index_select(0, order);
  Tensor offsets = at::cumsum(counts, 0, at::kInt);
  auto gate_up = at::_grouped_mm(gathered, gate_up_proj.transpose(-2, -1), offsets).chunk(2, -1);
  Tensor out = at::_grouped_mm(act(gate_up[0], code) * gate_up[1], down_proj.transpose(-2, -1), offsets);
  Tensor weighted = at::empty_like(out, out.options().dtype(slot_weights.scalar_type()))
                        .index_copy_(0, order, out * slot_weights.unsqueeze(1));
  Tensor summed = weighted.view({-1, top_k, x.size(-1)}).sum(1);
  return summed.scalar_type() == x.scalar_type() ? summed : summed.to(x.scalar_type());
}

// Layer.attention_inputs: the input norm, then Attention.project. `w`: input_layernorm, q_proj, k_proj, q_norm and
// k_norm weights, then v_proj's where the layer has one (not on K=V layers). Returns q (B, T, heads, D) and k, v
// (B, kv_heads, T, D).
std::tuple<Tensor, Tensor, Tensor> attention_inputs(const Tensor& x, at::TensorList w, int64_t batch, int64_t length,
                                                    int64_t head_dim, double eps, const Tensor& cos,
                                                    const Tensor& signed_sin) {
  TORCH_CHECK(w.size() == 5 || w.size() == 6, "printpress_layers.attention_inputs: 5 or 6 weights, not ", w.size());
  const auto dtype = x.scalar_type();
  Tensor h = norm(x, w[0], eps);
  Tensor q = rotate(norm(at::linear(h, w[1]).view({batch, length, -1, head_dim}), w[3], eps), cos, signed_sin);
  Tensor k_normalized = rms_normalize(at::linear(h, w[2]).view({batch, length, -1, head_dim}), eps);
  Tensor k = rotate(scale(k_normalized, w[4], dtype), cos, signed_sin).transpose(1, 2);
  Tensor v = w.size() == 5 ? scale(k_normalized, Tensor(), dtype)
                           : norm(at::linear(h, w[5]).view({batch, length, -1, head_dim}), Tensor(), eps);
  return {q, k, v.transpose(1, 2)};
}

// Layer.after_attention with a bool `encoder` (its layer scalar comes in `w`). `w`: o_proj,
// post_attention_layernorm, pre_feedforward_layernorm, mlp gate/up/down, post_feedforward_layernorm_1, router
// scale, router proj, router per_expert_scale, pre_feedforward_layernorm_2, experts gate_up_proj and down_proj,
// post_feedforward_layernorm_2, post_feedforward_layernorm, the layer scalar.
Tensor after_attention(const Tensor& x_in, const Tensor& attended, at::TensorList w, int64_t top_k, double root_size,
                       double eps, int64_t code) {
  TORCH_CHECK(w.size() == 16, "printpress_layers.after_attention: 16 weights, not ", w.size());
  const auto dtype = x_in.scalar_type();
  Tensor x = x_in + norm(at::linear(attended, w[0]), w[1], eps);
  Tensor normalized = rms_normalize(x, eps);
  Tensor dense = norm(gated_mlp(scale(normalized, w[2], dtype), w[3], w[4], w[5], code), w[6], eps);
  // Router.route on the router's weightless norm of x.
  Tensor routed = scale(normalized, Tensor(), dtype) * w[7] * root_size;
  Tensor probs = at::softmax(at::linear(routed, w[8]), -1, at::kFloat);
  auto [top, chosen] = at::topk(probs, top_k, -1);
  Tensor weights = top / top.sum(-1, /*keepdim=*/true);
  weights = weights * at::index(w[9], {chosen});
  Tensor sparse = experts(scale(normalized, w[10], dtype), weights, chosen, w[11], w[12], code);
  x = x + norm(dense + norm(sparse, w[13], eps), w[14], eps);
  return x * w[15];
}

}  // namespace

// The width the one-loop norm found matching ATen's (16 or 8 lanes), or 0 where it computes norms with ATen's
// operators; and the norm itself (`rms_norm(x, weight, eps)`, the weight optional), for the tests.
int64_t fused_norm_width() { return FusedNorms::width(); }

Tensor rms_norm(const Tensor& x, const std::optional<Tensor>& weight, double eps) {
  return norm(x, weight.value_or(Tensor()), eps);
}

TORCH_LIBRARY(printpress_layers, m) {
  m.def("fused_norm_width() -> int", &fused_norm_width);
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", &rms_norm);
  m.def("attention_inputs(Tensor x, Tensor[] w, int batch, int length, int head_dim, float eps, Tensor cos, "
        "Tensor signed_sin) -> (Tensor, Tensor, Tensor)",
        &attention_inputs);
  m.def("after_attention(Tensor x, Tensor attended, Tensor[] w, int top_k, float root_size, float eps, int act) "
        "-> Tensor",
        &after_attention);
}
