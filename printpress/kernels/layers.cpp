// The exact path's layers in C++ (printpress/model.py, `Layer.attention_inputs` and `Layer.after_attention`, and the
// whole `Layer.forward` with its cache join, `layer`): the same numbers as the Python methods, bit for bit, without
// the Python between their ~110 small operators per layer. A decoder pass over a canvas of 32 on the shipped model
// ran ~700 of them, and Python spent about as long dispatching them as ATen spent on everything but the products.
//
// Two kinds of work, each giving ATen's bits (tests/test_layers_native.py compares every pass with the Python path):
// - Products, attention, activations, the router's softmax and top-k, the experts' sort and gathers: the ATen
//   operators the Python code calls, on tensors of the same dtypes and layouts, in the same order (`F.linear` of rows
//   is at::mm with the transposed weight, which is what at::linear runs for them; `F.grouped_mm` on a CPU is one
//   at::mm per expert into its rows, as here). A product of one row, where at::mm's order was found and is checked on
//   the machine, is added up in that order by a kernel of this file (`rows_kernel`, for one to three rows); where a
//   float32 weight's values are all float16s or bfloat16s, products of up to 64 rows read a copy of it at that
//   width, in MKL's orders (`half_width_copy`, `few_rows_kernel`).
// - The float32 elementwise chains around them, each in one loop: the RMS norms (7 operators each, ~50 a pass), with
//   the residual additions and scales that follow them, the rotary embedding (4 operators), the router's weights
//   after its top-k, and the experts' gather and weighted sum over slots (9 operators). Each element goes
//   through the same float roundings in the same order as through the operators (none fused into a multiply-add:
//   the library is built with -ffp-contract=off), and the sums add in ATen's order (`aten_row_sum`,
//   `weighted_slot_sum`). That order is checked once per process against ATen itself (`FusedNorms`); where it does not
//   hold, or for other dtypes, strided inputs, or sums ATen would split between threads, the chains run as the ATen
//   operators.
// Also here: the self-conditioning MLP (`self_conditioning`), the logits' product (`head`), and the reading of weights
// ahead of their products where that pays on the machine (`warm`, `choose_warm`): none of them changes a number.
// The operators are registered without a dispatch key (CompositeImplicitAutograd); the model calls them only with
// gradients off.
//
// Only torch/library.h, ATen's per-operator headers and its vector header (for the GELU, `gated`): the library builds
// in seconds on a machine's first pass.
#include "aten_vec.h"  // first: it picks the CPU capability of ATen's vector headers

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/index.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/topk.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "aten_attention.h"
#include "aten_softmax.h"
#include "aten_sum.h"
#include "below_autograd.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;
using printpress_sum::aten_row_sum;
using printpress_sum::row_sum;

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
// Its sum is ATen's, in ATen's order (aten_sum.h).

// 1 / sqrt(sum(h * h) / n + eps) of one row, as ATen's operators give it: ATen's pow(t, -0.5) is 1 / sqrt in float on
// its vector path and in double on its scalar tail, which round alike (a double holds more than twice a float's
// digits). `squares`: room for n floats.
template <int W>
float inverse_rms(const float* row, int64_t n, float eps, float* squares) {
  for (int64_t i = 0; i < n; ++i) squares[i] = row[i] * row[i];
  const float mean = aten_row_sum<W>(squares, n) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + eps);
}

// The norms of the rows of x (rows x n, contiguous float32), each row's `epilogue(r, row, inverse)` writing what the
// caller makes of it; with ATen's vector width W.
template <int W, typename Epilogue>
void rms_rows(const float* x, int64_t rows, int64_t n, float eps, Epilogue epilogue) {
  std::vector<float> squares(n);
  for (int64_t r = 0; r < rows; ++r) epilogue(r, x + r * n, inverse_rms<W>(x + r * n, n, eps, squares.data()));
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
    printpress_sum::CheckNumbers numbers(0x9e3779b97f4a7c15ull);
    for (int64_t n : lengths) {
      const int64_t rows = n > 4096 ? 1 : 5;
      Tensor x = at::empty({rows, n}, at::TensorOptions().dtype(at::kFloat));
      float* data = x.data_ptr<float>();
      for (int64_t i = 0; i < rows * n; ++i) {  // magnitudes over ~30 octaves, both signs
        const double unit = numbers.unit();
        data[i] = static_cast<float>((unit - 0.5) * std::ldexp(1.0, static_cast<int>(numbers.next() % 31) - 15));
      }
      Tensor expected = aten_rms_normalize(x, 1e-6);
      Tensor got = at::empty_like(x);
      float* dst = got.data_ptr<float>();
      rms_rows<W>(data, rows, n, 1e-6f, [&](int64_t r, const float* row, float inverse) {
        for (int64_t i = 0; i < n; ++i) dst[r * n + i] = row[i] * inverse;
      });
      if (std::memcmp(expected.data_ptr<float>(), got.data_ptr<float>(), sizeof(float) * rows * n) != 0) return false;
    }
    return true;
  }
};

// Whether the one-loop forms stand in for ATen's operators on x: on the CPU, float32, contiguous, and a sum ATen would
// not split between threads (it may, past 32768 elements, with more than one); and every other tensor likewise.
bool fused(const Tensor& x, std::initializer_list<Tensor> others = {}) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() == 0 || x.size(-1) == 0 ||
      (x.numel() >= 32768 && at::get_num_threads() > 1) || FusedNorms::width() == 0)
    return false;
  for (const Tensor& t : others)
    if (t.defined() && (!t.device().is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous())) return false;
  return true;
}

// The norms of `rows` rows of n floats at x by FusedNorms' width, each row's `epilogue(r, row, inverse)` writing what
// the caller makes of it.
template <typename Epilogue>
void rms_rows(const float* x, int64_t rows, int64_t n, double eps, Epilogue epilogue) {
  if (FusedNorms::width() == 16)
    rms_rows<16>(x, rows, n, static_cast<float>(eps), epilogue);
  else
    rms_rows<8>(x, rows, n, static_cast<float>(eps), epilogue);
}

// residual + (rms_normalize(y) * weight), then * scalar, for `rows` rows of n floats of y into out: each part optional
// (null), as ATen's operators round them, one after the other, for each element.
void rows_norm(const float* y, int64_t rows, int64_t n, double eps, const float* weight, float* out,
               const float* residual = nullptr, const float* scalar = nullptr) {
  const float factor = scalar != nullptr ? *scalar : 1.0f;  // read once: the loops below then vectorize
  rms_rows(y, rows, n, eps, [&](int64_t r, const float* row, float inverse) {
    float* o = out + r * n;  // each step rounded to float, in ATen's order
    for (int64_t i = 0; i < n; ++i) o[i] = row[i] * inverse;
    if (weight != nullptr)
      for (int64_t i = 0; i < n; ++i) o[i] = o[i] * weight[i];
    if (residual != nullptr)
      for (int64_t i = 0; i < n; ++i) o[i] = residual[r * n + i] + o[i];
    if (scalar != nullptr)
      for (int64_t i = 0; i < n; ++i) o[i] = o[i] * factor;
  });
}

// rows_norm of the tensors (undefined: left out; `scalar` a one-element float32 tensor) into a new one.
Tensor fused_norm(const Tensor& y, const Tensor& weight, double eps, const Tensor& residual = Tensor(),
                  const Tensor& scalar = Tensor()) {
  Tensor out = at::empty_like(y);
  const int64_t n = y.size(-1);
  rows_norm(y.data_ptr<float>(), y.numel() / n, n, eps, weight.defined() ? weight.data_ptr<float>() : nullptr,
            out.data_ptr<float>(), residual.defined() ? residual.data_ptr<float>() : nullptr,
            scalar.defined() ? scalar.data_ptr<float>() : nullptr);  // fused(): float32 CPU tensors
  return out;
}

// model.rms_normalize.
Tensor rms_normalize(const Tensor& x, double eps) {
  return fused(x) ? fused_norm(x, Tensor(), eps) : aten_rms_normalize(x, eps);
}

// RMSNorm.scale: the weight applied in float32 (an undefined weight: a weightless norm), cast back to `dtype`.
Tensor scale(const Tensor& normalized, const Tensor& weight, at::ScalarType dtype) {
  Tensor h = normalized;
  if (weight.defined()) h = h * as_float(weight);
  return h.scalar_type() == dtype ? h : h.to(dtype);
}

// RMSNorm.forward.
Tensor norm(const Tensor& x, const Tensor& weight, double eps) {
  if (fused(x, {weight})) return fused_norm(x, weight, eps);
  return scale(rms_normalize(x, eps), weight, x.scalar_type());
}

// residual + norm(y, weight) (then * scalar, a one-element tensor, if defined).
Tensor add_norm(const Tensor& residual, const Tensor& y, const Tensor& weight, double eps,
                const Tensor& scalar = Tensor()) {
  if (fused(y, {weight, residual, scalar}) && residual.sizes() == y.sizes())
    return fused_norm(y, weight, eps, residual, scalar);
  Tensor out = residual + norm(y, weight, eps);
  return scalar.defined() ? out * scalar : out;
}

// Whether model.rotate of x (B, T, heads, D) by the tables (1 or B, T, 1, D) runs as one loop (`rotate_row`).
bool rotates_in_one_loop(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  return fused(x, {cos, signed_sin}) && x.dim() == 4 && cos.dim() == 4 && cos.sizes() == signed_sin.sizes() &&
         (cos.size(0) == 1 || cos.size(0) == x.size(0)) && cos.size(1) == x.size(1) && cos.size(2) == 1 &&
         cos.size(3) == x.size(3) && x.size(3) % 2 == 0;
}

// One head's row of D values rotated into `o`: in * cos + roll(in, D / 2) * signed_sin, each product rounded, then
// their sum.
inline void rotate_row(const float* in, const float* cs, const float* ss, int64_t d, float* o) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {  // the first half's partner is half ahead, the second's half behind
    const float direct = in[i] * cs[i], swapped = in[i + half] * ss[i];
    o[i] = direct + swapped;
  }
  for (int64_t i = half; i < d; ++i) {
    const float direct = in[i] * cs[i], swapped = in[i - half] * ss[i];
    o[i] = direct + swapped;
  }
}

// Where row r (of B * T * heads rows) of x (B, T, heads, D) finds its position's tables.
inline int64_t table_row(const Tensor& x, const Tensor& cos, int64_t r) {
  const int64_t heads = x.size(2), length = x.size(1), position = r / heads;  // b * length + t
  return ((cos.size(0) == 1 ? position % length : position) * x.size(3));
}

// model.rotate: x * cos + roll(x, D / 2) * signed_sin, x (B, T, heads, D) and the tables (1 or B, T, 1, D).
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  if (!rotates_in_one_loop(x, cos, signed_sin)) return x * cos + x.roll({x.size(-1) / 2}, {-1}) * signed_sin;
  Tensor out = at::empty_like(x);
  const int64_t d = x.size(3), rows = x.numel() / d;
  const float *src = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *sn = signed_sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t table = table_row(x, cos, r);
    rotate_row(src + r * d, c + table, sn + table, d, dst + r * d);
  }
  return out;
}

// norm_rotate's loop: `positions` positions (b * length + t) of `heads` rows of d floats at x, each row's RMS norm,
// times the weight (where given), rotated by its position's tables (row t of cos and signed_sin where `shared`, one
// table for every batch row; else row b * length + t) into out; `normalized` (where given) receives the values before
// the weight; `scaled`: room for d floats.
void rows_norm_rotate(const float* x, int64_t positions, int64_t length, int64_t heads, int64_t d, double eps,
                      const float* weight, const float* cos, const float* signed_sin, bool shared, float* out,
                      float* normalized, float* scaled) {
  rms_rows(x, positions * heads, d, eps, [&](int64_t r, const float* row, float inverse) {
    float* values = normalized != nullptr ? normalized + r * d : scaled;
    for (int64_t i = 0; i < d; ++i) values[i] = row[i] * inverse;
    if (weight != nullptr) {
      for (int64_t i = 0; i < d; ++i) scaled[i] = values[i] * weight[i];
      values = scaled;
    }
    const int64_t position = r / heads, table = (shared ? position % length : position) * d;
    rotate_row(values, cos + table, signed_sin + table, d, out + r * d);
  });
}

// rotate(norm(x, weight)) of the heads' rows of x (B, T, heads, D): the RMS norm of each row, times the weight (where
// defined), rotated, in one loop into one tensor; `normalized`, where given, receives rms_normalize(x) (the values
// before the weight: a K=V layer's values). What norm, scale and rotate give, bit for bit.
Tensor norm_rotate(const Tensor& x, const Tensor& weight, double eps, const Tensor& cos, const Tensor& signed_sin,
                   Tensor* normalized = nullptr) {
  if (!rotates_in_one_loop(x, cos, signed_sin) || !fused(x, {weight})) {
    Tensor plain = rms_normalize(x, eps);
    if (normalized != nullptr) *normalized = scale(plain, Tensor(), x.scalar_type());
    return rotate(scale(plain, weight, x.scalar_type()), cos, signed_sin);
  }
  Tensor out = at::empty_like(x);
  if (normalized != nullptr) *normalized = at::empty_like(x);
  const int64_t d = x.size(3);
  std::vector<float> scaled(d);
  rows_norm_rotate(x.data_ptr<float>(), x.size(0) * x.size(1), x.size(1), x.size(2), d, eps,
                   weight.defined() ? weight.data_ptr<float>() : nullptr, cos.data_ptr<float>(),
                   signed_sin.data_ptr<float>(), cos.size(0) == 1, out.data_ptr<float>(),
                   normalized != nullptr ? normalized->data_ptr<float>() : nullptr, scaled.data());
  return out;
}

// Weights read ahead of their products. A product of a few rows reads each weight once; where the weights have left
// the core's caches between passes (the shipped model's 21 MiB did on an AMD EPYC with a 32 MiB L3 shared with other
// tenants), MKL's small products read them at the latency of scattered misses: a 1-row product of a 192 x 384 weight
// took ~40-60 us there against 7 us from the L2. One load per cache line in address order first is a stream the
// hardware prefetcher follows, so the product then finds the weight in the L2 (10 + 7 us). It reads, writes nothing
// and changes no number. Where the weights stay in the caches it only costs, and where a product is shared between
// threads the other threads' parts are not in their caches, so the model measures it once per process on its own
// weights, for products of a few rows and of many apart (`choose_warm`, called from model.py), and turns each on
// where it wins.
constexpr int64_t kManyRows = 8;  // products of at least this many rows are "many" (canvases; AR steps are "few")
std::atomic<bool> warm_few{false}, warm_many{false};

bool warming(int64_t rows) {
  return (rows < kManyRows ? warm_few : warm_many).load(std::memory_order_relaxed);
}

// One load per cache line of `size` bytes from `bytes`, in address order.
void warm_bytes(const char* bytes, int64_t size) {
  uint32_t seen = 0;
  for (int64_t i = 0; i < size; i += 64) seen ^= *reinterpret_cast<const volatile uint32_t*>(bytes + i);
  static volatile uint32_t sink;
  sink = seen;  // keeps the loads
}

void warm(const Tensor& weight, int64_t rows) {
  if (!warming(rows) || !weight.is_non_overlapping_and_dense()) return;
  warm_bytes(static_cast<const char*>(weight.data_ptr()), weight.numel() * static_cast<int64_t>(weight.element_size()));
}

// -- products of one to three rows in MKL's own order ------------------------------------------------------------
//
// at::mm of one to three float32 rows by a weight is MKL's matrix-vector path, and on an AMD EPYC (MKL's generic path
// there) each output is a dot product added up in one fixed order, found by probing MKL (a large value and its
// negative among ones show which products meet first, as FPRev does) and confirmed on random data: four interleaved
// sums (element k into sum k % 4), every product rounded before it is added (no multiply-add), then (sum 0 + sum 2) +
// (sum 1 + sum 3); for one row, the first four products are first added one after the other and the four sums start
// at the fifth element, the first carrying on from them. That holds where the inner size is a multiple of 4 and the
// weight starts on 16 bytes (elsewhere MKL first aligns its reads, and adds in another order), for outputs in whole
// groups of 4. `rows_kernel` adds in that order with 4-lane vectors, eight weight rows at a time: eight sequential
// streams the hardware prefetcher follows, where MKL's reads of a weight outside the core's caches took the latency
// of scattered misses (1.3-1.6x faster there; the same from the caches), and without at::mm's dispatch and checks.
// Whether it gives at::mm's bits is checked once per process for each inner size, row count and thread count against
// at::mm itself (`rows_order_holds`); where it does not (another CPU, another MKL path), or where the shapes, layout
// or alignment differ, the product is at::mm's.
constexpr int64_t kRowBlock = 8, kRowsMax = 3;  // weight rows per pass of the kernel; input rows it takes

#if defined(__SSE2__)
constexpr bool kRowsKernel = true;

// y[j] = x . w[j] for R rows of w (each `k` floats, k a multiple of 4), in the order above (`Lead`: one input row's,
// the first four products first). R is a constant so that the R sums stay in registers.
template <int R, bool Lead>
void row_dots(const float* x, const float* w, int64_t k, float* y) {
  __m128 sums[R];
  for (int r = 0; r < R; ++r) {
    if (Lead) {
      const float* row = w + r * k;
      float first = x[0] * row[0];
      first = first + x[1] * row[1];
      first = first + x[2] * row[2];
      first = first + x[3] * row[3];
      sums[r] = _mm_set_ps(0.0f, 0.0f, 0.0f, first);
    } else {
      sums[r] = _mm_setzero_ps();
    }
  }
  for (int64_t i = Lead ? 4 : 0; i < k; i += 4) {
    const __m128 xs = _mm_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) sums[r] = _mm_add_ps(sums[r], _mm_mul_ps(xs, _mm_loadu_ps(w + r * k + i)));
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, sums[r]);
    y[r] = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  }
}

// `rows` (a multiple of 4, at most kRowBlock) weight rows.
template <bool Lead>
void row_block(const float* x, const float* w, int64_t k, int64_t rows, float* y) {
  if (rows == kRowBlock) {
    row_dots<kRowBlock, Lead>(x, w, k, y);
  } else {
    for (int64_t r = 0; r < rows; r += 4) row_dots<4, Lead>(x, w + r * k, k, y + r);
  }
}
#else
constexpr bool kRowsKernel = false;
template <bool Lead>
void row_block(const float*, const float*, int64_t, int64_t, float*) {}
#endif

// -- the same order from half-width weights ----------------------------------------------------------------------
//
// A float32 weight whose every value is a float16 (the shipped model's checkpoint is stored in float16) or a bfloat16
// (released checkpoints are) holds the same numbers in half the bytes at that width, and a product of a few rows
// waits on those bytes wherever the weights come from beyond the core's caches. Its copy at that width (made and kept
// by `half_width_copy` below) is laid out for the vectors: the weight rows (outputs) in blocks of 16 (the last
// padded with zero rows), and the blocks in groups (kGroupBlocks: four with AVX-512, the last group may hold fewer;
// one with AVX2), each group stored by inner element: element 0 of its blocks' 64 (16) outputs, then element 1's, and
// so on. One load widened to float32 (F16C's conversion; a bfloat16 is the top half of its float32: both exact) then
// holds one inner element's weight for 16 (8) outputs, and each vector lane adds up one output: for one to three rows
// in four sums per output, element i into sum i % 4, each product rounded before it is added, then (sum 0 + sum 2) +
// (sum 1 + sum 3), one row's first four products first added in turn — the order above, so the same bits. A product
// of one row computes a whole group at a time, so it reads the copy as one sequential stream: from DRAM at the
// machine's read speed, where four blocks stored one after the other (four streams, a block's 16 outputs apart) read
// ~15% slower on an AMD EPYC (a 48 MiB weight: 22 against 19 GB/s). AVX-512, or AVX2 with F16C and FMA (`Lanes`);
// elsewhere no copies are made.
constexpr int64_t kHalfBlock = 16;  // outputs per block of the copy
// Blocks per group of the copy, stored by inner element together: as many as one row's product takes at a time, so
// that it reads the copy as one stream: four with AVX-512 (a group's 16 sums fill half its 32 registers), one with
// AVX2 (a block's 8 sums fill half its 16; with groups of four, one row's product read each cache line in two passes
// a group apart, and the 99.7M model's AR step took 1.29x as long).
#if defined(__AVX512F__)
constexpr int64_t kGroupBlocks = 4;
#else
constexpr int64_t kGroupBlocks = 1;
#endif
constexpr int64_t kFewRowsMin = 4, kFewRowsMax = 64;  // input rows few_rows_kernel takes
constexpr int64_t kRowsAheadBytes = 256 * 1024;  // bytes of a weight read ahead at a time (see rows_kernel)

// `blocks` blocks of a weight's rows, `block_bytes` each from `w` (`total_bytes` in all: the last block may be
// short), split between threads in pieces of ~kRowsAheadBytes that start on a multiple of `group` blocks, each read
// ahead just before its products where `ahead`; `piece(first block, blocks)` computes a piece's outputs whole (so the
// bits do not depend on the threads).
template <typename F>
void in_pieces(const void* w, int64_t blocks, int64_t block_bytes, int64_t total_bytes, int64_t group, bool ahead,
               const F& piece) {
  const int64_t groups = (blocks + group - 1) / group;
  // groups per piece, also the least a thread's task holds
  const int64_t chunk = std::max<int64_t>(1, kRowsAheadBytes / (block_bytes * group));
  at::parallel_for(0, groups, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += chunk) {
      const int64_t c = g * group, stop = std::min(blocks, std::min(end, g + chunk) * group);
      const int64_t from = c * block_bytes;
      if (ahead) warm_bytes(static_cast<const char*>(w) + from, std::min(stop * block_bytes, total_bytes) - from);
      piece(c, stop - c);
    }
  });
}

// MKL's runs of a product of 4 or more rows over an inner size k (few_rows_kernel), as [start, end) pairs.
std::vector<std::pair<int64_t, int64_t>> few_rows_runs(int64_t k) {
  if (k <= 192) return {{0, k}};
  if (k <= 384) return {{0, k / 2}, {k / 2, k}};
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t start = 0; start < k; start += 192) runs.emplace_back(start, std::min(k, start + 192));
  return runs;
}

// Where block b of a copy of `blocks` blocks (k inner elements each) starts, and `step`, the elements from one of its
// inner elements to the next: its group's blocks times 16.
struct BlockAt {
  int64_t start, step;
};
inline BlockAt block_at(int64_t b, int64_t blocks, int64_t k) {
  const int64_t group = b / kGroupBlocks, first = group * kGroupBlocks;
  return {(first * k + (b - first)) * kHalfBlock, std::min(kGroupBlocks, blocks - first) * kHalfBlock};
}

// The vector the half-width kernels compute with: 16 float lanes with AVX-512, 8 with AVX2 (with F16C's conversion and
// FMA's multiply-add), so a block of the copy is one vector or two. Each lane adds up one output in the same order
// whatever the width, so the width changes no bit, only how many outputs a register holds.
#if defined(__AVX512F__) && defined(__F16C__)
#define PRINTPRESS_HALF_ROWS 1
struct Lanes {
  using Reg = __m512;
  static constexpr int64_t kWidth = 16;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg load(const at::Half* w) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
  static Reg load(const at::BFloat16* w) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // the first `lanes` (1 to kWidth) of v into y
  static void store(float* y, Reg v, int64_t lanes) {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << lanes) - 1), v);
  }
};
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PRINTPRESS_HALF_ROWS 1
struct Lanes {
  using Reg = __m256;
  static constexpr int64_t kWidth = 8;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg load(const at::Half* w) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
  static Reg load(const at::BFloat16* w) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* y, Reg v, int64_t lanes) {
    if (lanes >= kWidth) {
      _mm256_storeu_ps(y, v);
      return;
    }
    alignas(32) float all[kWidth];
    _mm256_store_ps(all, v);
    std::memcpy(y, all, sizeof(float) * lanes);
  }
};
#endif

#if defined(PRINTPRESS_HALF_ROWS)
constexpr bool kHalfRows = true;
constexpr int64_t kBlockVecs = kHalfBlock / Lanes::kWidth;  // vectors a block of the copy holds
using Reg = Lanes::Reg;

// Bytes of the copy one row's product asks for ahead of its reads with AVX2 (`half_vecs`): the copy is one stream
// there (one block per group), which the hardware prefetcher follows, but asked for 2 KiB ahead the AR step ran 1.09x
// as fast on the 99.7M model (weights from DRAM) and 1.10x on the shipped one (from the L3) on an AMD EPYC Zen 3
// (distances of 0.5-8 KiB alternating in one process, session 46; 1-2 KiB best). None with AVX-512: on a Zen 4 every
// distance tried was slower there (session 43).
#if defined(__AVX512F__)
constexpr int64_t kHalfAheadBytes = 0;
#else
constexpr int64_t kHalfAheadBytes = 2048;
#endif

// Outputs [0, kWidth N) of M input rows (x: stride x_stride; y: y_stride, `valid` of its outputs written) from N
// vectors' columns of one group of the copy, the first column at `w` (inner elements `step` apart);
// `Lead`: one row's, its first four products first, in turn.
template <int M, int N, bool Lead, typename W>
__attribute__((noinline)) void half_vecs(const float* x, int64_t x_stride, const W* w, int64_t step, int64_t k,
                                         float* y, int64_t y_stride, int64_t valid) {
  Reg sums[M][4][N];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < N; ++v) sums[r][j][v] = Lanes::zero();
  if (Lead) {
    for (int v = 0; v < N; ++v) {
      const W* column = w + v * Lanes::kWidth;
      Reg first = Lanes::mul(Lanes::set1(x[0]), Lanes::load(column));
      for (int i = 1; i < 4; ++i)
        first = Lanes::add(first, Lanes::mul(Lanes::set1(x[i]), Lanes::load(column + i * step)));
      sums[0][0][v] = first;
    }
  }
  for (int64_t i = Lead ? 4 : 0; i < k; i += 4) {
    if constexpr (M == 1 && kHalfAheadBytes > 0) {  // the lines of the four elements kHalfAheadBytes on
      const char* ahead = reinterpret_cast<const char*>(w + i * step) + kHalfAheadBytes;
      for (int64_t line = 0; line < 4 * step * static_cast<int64_t>(sizeof(W)); line += 64)
        _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    for (int j = 0; j < 4; ++j) {
      Reg xs[M];
      for (int r = 0; r < M; ++r) xs[r] = Lanes::set1(x[r * x_stride + i + j]);
      for (int v = 0; v < N; ++v) {
        const Reg weights = Lanes::load(w + (i + j) * step + v * Lanes::kWidth);
        for (int r = 0; r < M; ++r) sums[r][j][v] = Lanes::add(sums[r][j][v], Lanes::mul(xs[r], weights));
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    for (int v = 0; v < N; ++v) {
      const Reg total = Lanes::add(Lanes::add(sums[r][0][v], sums[r][2][v]), Lanes::add(sums[r][1][v], sums[r][3][v]));
      const int64_t lanes = std::min<int64_t>(Lanes::kWidth, valid - v * Lanes::kWidth);
      if (lanes > 0) Lanes::store(y + r * y_stride + v * Lanes::kWidth, total, lanes);
    }
  }
}

// Vectors per call: enough sums to keep the adder busy, few enough to stay in the registers (32 with AVX-512, where
// one row's call takes a whole group and reads the copy as one stream; 16 with AVX2).
template <int M>
constexpr int kHalfVecs = Lanes::kWidth == 16 ? (M == 1 ? 4 : 2) : (M == 1 ? 2 : 1);

// `f(group's first block, its blocks, where it starts)` for each group of blocks [first, end) of a copy of `blocks`
// (`first` on a group's start, `end` a group's end or `blocks`).
template <typename F>
void each_group(int64_t first, int64_t end, int64_t blocks, int64_t k, const F& f) {
  for (int64_t b = first; b < end; b += kGroupBlocks) f(b, std::min(kGroupBlocks, end - b), block_at(b, blocks, k));
}

// Blocks [first, end) of a copy of `blocks` (see each_group); x, y and `valid` (the outputs written) count from the
// copy's first block.
template <int M, bool Lead, typename W>
void half_pass(int64_t first, int64_t end, int64_t blocks, const float* x, int64_t x_stride, const W* w, int64_t k,
               float* y, int64_t y_stride, int64_t valid) {
  constexpr int N = kHalfVecs<M>;
  each_group(first, end, blocks, k, [&](int64_t b, int64_t width, BlockAt at) {
    const int64_t vecs = width * kBlockVecs;
    for (int64_t v = 0; v < vecs;) {
      const int64_t out = b * kHalfBlock + v * Lanes::kWidth;
      const W* column = w + at.start + v * Lanes::kWidth;
      if (vecs - v >= N) {
        half_vecs<M, N, Lead>(x, x_stride, column, at.step, k, y + out, y_stride, valid - out);
        v += N;
      } else {
        half_vecs<M, 1, Lead>(x, x_stride, column, at.step, k, y + out, y_stride, valid - out);
        v += 1;
      }
    }
  });
}

// half_pass for `rows` (1 to 3) input rows; `lead` (one row only): its first four products first.
template <typename W>
void half_pass_of(int64_t rows, bool lead, int64_t first, int64_t end, int64_t blocks, const float* x,
                  int64_t x_stride, const W* w, int64_t k, float* y, int64_t y_stride, int64_t valid) {
  if (rows == 1 && lead)
    half_pass<1, true>(first, end, blocks, x, x_stride, w, k, y, y_stride, valid);
  else if (rows == 1)
    half_pass<1, false>(first, end, blocks, x, x_stride, w, k, y, y_stride, valid);
  else if (rows == 2)
    half_pass<2, false>(first, end, blocks, x, x_stride, w, k, y, y_stride, valid);
  else if (rows == 3)
    half_pass<3, false>(first, end, blocks, x, x_stride, w, k, y, y_stride, valid);
}

template <typename W>
void half_rows(const float* xs, int64_t m, int64_t x_stride, const W* w, int64_t k, int64_t whole, int64_t blocks,
               float* y, int64_t y_stride, bool ahead) {
  const int64_t used = (whole + kHalfBlock - 1) / kHalfBlock, block_bytes = kHalfBlock * k * sizeof(W);
  in_pieces(w, used, block_bytes, used * block_bytes, kGroupBlocks, ahead, [&](int64_t c, int64_t count) {
    half_pass_of(m, true, c, c + count, blocks, xs, x_stride, w, k, y, y_stride, whole);
  });
}

// half_rows of the outputs [0, whole) of x (m rows, k) times the weight whose copy is `half`, into y.
void half_rows_of(const float* xs, int64_t m, int64_t x_stride, const Tensor& half, int64_t k, int64_t whole,
                  int64_t blocks, float* y, int64_t y_stride, bool ahead) {
  if (half.scalar_type() == at::kHalf)
    half_rows(xs, m, x_stride, half.data_ptr<at::Half>(), k, whole, blocks, y, y_stride, ahead);
  else
    half_rows(xs, m, x_stride, half.data_ptr<at::BFloat16>(), k, whole, blocks, y, y_stride, ahead);
}

// x (m, k) times weight_t (k, n) as rows_kernel computes it, from `half` (`blocked`'s layout); the last n % 4 outputs
// are at::mm's of those rows alone.
void half_rows_kernel(const Tensor& x, const Tensor& weight_t, const Tensor& half, const Tensor& out, bool ahead) {
  const int64_t k = weight_t.size(0), n = weight_t.size(1), whole = n / 4 * 4;
  const int64_t blocks = (n + kHalfBlock - 1) / kHalfBlock;
  half_rows_of(x.data_ptr<float>(), x.size(0), x.stride(0), half, k, whole, blocks, out.data_ptr<float>(),
               out.stride(0), ahead);
  if (whole < n) out.narrow(1, whole, n - whole).copy_(at::mm(x, weight_t.narrow(1, whole, n - whole)));
}

// at::mm of 4 or more float32 rows by a weight of at least 16 outputs (MKL's matrix product) adds each output's
// products one after the other from zero as multiply-adds, in runs: the whole inner size up to 192, two equal halves
// up to 384, runs of 192 beyond; each run's sum is then added to those before it (found by the same probing, on an AMD
// EPYC with AVX-512, where MKL runs its generic code for AMD's CPUs, and the same on one with AVX2 only; MKL first
// copies the whole weight into its packed layout). On one thread that holds for every row count
// checked (4 to 64, up to which the kernel takes them); on two, for 4, 8 and 12 or more rows, while of 5 to 7 (9 to
// 11) it adds the first four (eight) so and the rest in the four interleaved sums of a product of one to three rows
// (above), and where the outputs are not in whole groups of 4, those rows' last outputs in yet another order (the
// check tells where neither holds). From the same copy, each lane one
// output: a multiply-add per inner element into a run's sum, the runs added up.
using Runs = std::vector<std::pair<int64_t, int64_t>>;

constexpr int64_t kFewAhead = 32;  // inner elements a block's weights are fetched ahead of their products

// Outputs [0, kWidth N) of M rows from N vectors' columns of one group, the first at `w` (inner elements `step`
// apart), `valid` of them written. Not inlined (nor is half_vecs): inlined into its caller, the compiler kept M = 8's
// weights on the stack (a multiply-add from memory each: half the speed).
template <int M, int N, typename W>
__attribute__((noinline)) void few_vecs(const float* x, int64_t x_stride, const W* w, int64_t step, const Runs& runs,
                                        float* y, int64_t y_stride, int64_t valid) {
  constexpr int64_t kBytes = N * Lanes::kWidth * sizeof(W);  // of one inner element's weights
  Reg totals[M][N];
  for (size_t run = 0; run < runs.size(); ++run) {
    Reg sums[M][N];
    for (int r = 0; r < M; ++r)
      for (int v = 0; v < N; ++v) sums[r][v] = Lanes::zero();
    for (int64_t i = runs[run].first; i < runs[run].second; ++i) {
      Reg weights[N];
      // the cache lines of the element kFewAhead elements on
      for (int64_t line = 0; line < kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + (i + kFewAhead) * step) + line, _MM_HINT_T0);
      for (int v = 0; v < N; ++v) weights[v] = Lanes::load(w + i * step + v * Lanes::kWidth);
      for (int r = 0; r < M; ++r) {
        const Reg xs = Lanes::set1(x[r * x_stride + i]);
        for (int v = 0; v < N; ++v) sums[r][v] = Lanes::fmadd(xs, weights[v], sums[r][v]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int v = 0; v < N; ++v) totals[r][v] = run == 0 ? sums[r][v] : Lanes::add(totals[r][v], sums[r][v]);
  }
  for (int r = 0; r < M; ++r) {
    for (int v = 0; v < N; ++v) {
      const int64_t lanes = std::min<int64_t>(Lanes::kWidth, valid - v * Lanes::kWidth);
      if (lanes > 0) Lanes::store(y + r * y_stride + v * Lanes::kWidth, totals[r][v], lanes);
    }
  }
}

template <int N, typename W>
void few_rows_vecs(int64_t rows, const float* x, int64_t x_stride, const W* w, int64_t step, const Runs& runs,
                   float* y, int64_t y_stride, int64_t valid) {
  switch (rows) {
    case 1: return few_vecs<1, N>(x, x_stride, w, step, runs, y, y_stride, valid);
    case 2: return few_vecs<2, N>(x, x_stride, w, step, runs, y, y_stride, valid);
    case 3: return few_vecs<3, N>(x, x_stride, w, step, runs, y, y_stride, valid);
    default: return few_vecs<4, N>(x, x_stride, w, step, runs, y, y_stride, valid);
  }
}

// Vectors per call of few_vecs: four rows by four 16-lane vectors with AVX-512 (16 sums, each weight vector used four
// times; 7% faster than eight rows by two from the caches, on an AMD EPYC), by two 8-lane ones with AVX2.
constexpr int64_t kFewVecs = Lanes::kWidth == 16 ? 4 : 2;

// `rows` input rows from blocks [first, end) of a copy of `blocks` (see each_group): a group at a time (the copy read
// in order), kFewVecs of its vectors' columns at a time, for every four rows while those are in the L1; y and `valid`
// count from the copy's first block.
template <typename W>
void few_pass(int64_t rows, int64_t first, int64_t end, int64_t blocks, const float* x, int64_t x_stride, const W* w,
              int64_t k, const Runs& runs, float* y, int64_t y_stride, int64_t valid) {
  each_group(first, end, blocks, k, [&](int64_t b, int64_t width, BlockAt at) {
    const int64_t vecs = width * kBlockVecs;
    for (int64_t v = 0; v < vecs; v += kFewVecs) {
      const W* column = w + at.start + v * Lanes::kWidth;
      for (int64_t r = 0; r < rows; r += 4) {
        const float* xr = x + r * x_stride;
        const int64_t some = std::min<int64_t>(4, rows - r), out = b * kHalfBlock + v * Lanes::kWidth;
        float* yr = y + r * y_stride + out;
        switch (std::min(kFewVecs, vecs - v)) {
          case 4: few_rows_vecs<4>(some, xr, x_stride, column, at.step, runs, yr, y_stride, valid - out); break;
          case 3: few_rows_vecs<3>(some, xr, x_stride, column, at.step, runs, yr, y_stride, valid - out); break;
          case 2: few_rows_vecs<2>(some, xr, x_stride, column, at.step, runs, yr, y_stride, valid - out); break;
          default: few_rows_vecs<1>(some, xr, x_stride, column, at.step, runs, yr, y_stride, valid - out);
        }
      }
    }
  });
}

template <typename W>
void few_rows(const Tensor& x, const W* w, int64_t k, int64_t n, const Tensor& out, bool ahead) {
  const int64_t m = x.size(0), x_stride = x.stride(0), y_stride = out.stride(0);
  const int64_t blocks = (n + kHalfBlock - 1) / kHalfBlock, block_bytes = kHalfBlock * k * sizeof(W);
  const auto runs = few_rows_runs(k);
  // the rows added as multiply-adds: all of them, but on more than one thread where fewer than 12 are not a multiple
  // of 4 (MKL adds the last m % 4 there as a product of those rows alone)
  const int64_t multiply_added = at::get_num_threads() == 1 || m >= 12 ? m : m / 4 * 4;
  const float* xs = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  in_pieces(w, blocks, block_bytes, blocks * block_bytes, kGroupBlocks, ahead, [&](int64_t c, int64_t count) {
    few_pass(multiply_added, c, c + count, blocks, xs, x_stride, w, k, runs, y, y_stride, n);
    half_pass_of(m - multiply_added, false, c, c + count, blocks, xs + multiply_added * x_stride, x_stride, w, k,
                 y + multiply_added * y_stride, y_stride, n);
  });
}

// x (m, k; 4 <= m <= 64) times the weight whose half-width copy is `half` (`blocked`), n outputs, in MKL's order.
void few_rows_kernel(const Tensor& x, const Tensor& half, int64_t n, const Tensor& out, bool ahead) {
  const int64_t k = x.size(1);
  if (half.scalar_type() == at::kHalf)
    few_rows(x, half.data_ptr<at::Half>(), k, n, out, ahead);
  else
    few_rows(x, half.data_ptr<at::BFloat16>(), k, n, out, ahead);
}
#else
constexpr bool kHalfRows = false;
void half_rows_of(const float*, int64_t, int64_t, const Tensor&, int64_t, int64_t, int64_t, float*, int64_t, bool) {}
void half_rows_kernel(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) {}
void few_rows_kernel(const Tensor&, const Tensor&, int64_t, const Tensor&, bool) {}
#endif

// A weight (n, k) at half width in the layout above: its rows in blocks of 16 (zero rows after the last), the blocks
// in groups of kGroupBlocks (the last with the rest), each group by inner element, flat.
Tensor blocked(const Tensor& half) {
  const int64_t k = half.size(1), n = half.size(0), blocks = (n + kHalfBlock - 1) / kHalfBlock;
  Tensor padded = at::zeros({blocks * kHalfBlock, k}, half.options());
  padded.narrow(0, 0, n).copy_(half);
  const int64_t whole = blocks / kGroupBlocks * kGroupBlocks, rest = blocks - whole;
  std::vector<Tensor> parts;  // (groups, blocks, 16, k) -> (groups, k, blocks, 16)
  if (whole)
    parts.push_back(padded.narrow(0, 0, whole * kHalfBlock).view({-1, kGroupBlocks, kHalfBlock, k})
                        .permute({0, 3, 1, 2}).reshape({-1}));
  if (rest)
    parts.push_back(padded.narrow(0, whole * kHalfBlock, rest * kHalfBlock).view({rest, kHalfBlock, k})
                        .permute({2, 0, 1}).reshape({-1}));
  return at::cat(parts);
}

// out (m, n; unit column stride) = x (m <= kRowsMax rows of unit stride, k) times weight_t (k, n), the transpose of
// a contiguous (n, k) weight; split between threads by blocks of weight rows (each output is computed whole by one
// thread, so the bits do not depend on the threads), each block for every input row while it is in the L1. MKL adds
// the last n % 4 outputs in another order; they are at::mm's own, of those weight rows alone. `ahead`: each ~256 KB
// of the weight is read ahead (`warm`) just before its products, rather than the whole weight before the first: on
// the 99.7M benchmark model, whose weights come from DRAM, a whole 2.4 MB weight read ahead left the L2 before its
// products read it (AR step 1.15x faster in pieces, on an AMD EPYC; the same on the shipped model's small weights).

// The float32 weight's part of rows_kernel: outputs [0, whole) (whole a multiple of 4) of m rows of x (each k floats,
// `x_stride` apart) times the contiguous (n, k) weight at `w`, into y (rows `y_stride` apart).
void float_rows(const float* xs, int64_t m, int64_t x_stride, const float* w, int64_t k, int64_t whole, float* y,
                int64_t y_stride, bool ahead) {
  const int64_t block_bytes = kRowBlock * k * 4, blocks = (whole + kRowBlock - 1) / kRowBlock;
  in_pieces(w, blocks, block_bytes, whole * k * 4, 1, ahead, [&](int64_t c, int64_t count) {
    for (int64_t b = c; b < c + count; ++b) {
      const int64_t first = b * kRowBlock, rows = std::min(kRowBlock, whole - first);
      if (m == 1) {
        row_block<true>(xs, w + first * k, k, rows, y + first);
      } else {
        for (int64_t r = 0; r < m; ++r)
          row_block<false>(xs + r * x_stride, w + first * k, k, rows, y + r * y_stride + first);
      }
    }
  });
}

// `half`, where defined: the weight's values at half width, blocked (`half_width_copy`), read in its place.
void rows_kernel(const Tensor& x, const Tensor& weight_t, const Tensor& out, bool ahead = false,
                 const Tensor& half = Tensor()) {
  if (half.defined()) {
    half_rows_kernel(x, weight_t, half, out, ahead);
    return;
  }
  const int64_t k = weight_t.size(0), n = weight_t.size(1), whole = n / 4 * 4;
  float_rows(x.data_ptr<float>(), x.size(0), x.stride(0), weight_t.data_ptr<float>(), k, whole,
             out.data_ptr<float>(), out.stride(0), ahead);
  if (whole < n) out.narrow(1, whole, n - whole).copy_(at::mm(x, weight_t.narrow(1, whole, n - whole)));
}

// Random float32 numbers for the checks against ATen: magnitudes 2^-7 to 2^6, both signs, one in 17 an exact zero.
void fill_check_numbers(Tensor& t, printpress_sum::CheckNumbers& numbers) {
  float* data = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const uint64_t pick = numbers.next();
    const double magnitude = std::ldexp(1.0, static_cast<int>(pick % 13) - 6);
    data[i] = pick % 17 == 0 ? 0.0f : static_cast<float>((numbers.unit() - 0.5) * magnitude);
  }
}

std::mutex rows_mutex;
// per (inner size, rows, outputs % 4, threads): the kernel gave at::mm's bits
std::map<std::tuple<int64_t, int64_t, int64_t, int>, bool> rows_hold;

// Whether rows_kernel gives at::mm's bits on this machine for inner size k, `rows` input rows and a number of outputs
// that leaves `tail` = n % 4 (MKL adds the last n % 4 outputs of several rows in yet another order where that is 1):
// random rows of mixed magnitudes and signs (and some zeros) times weights of 4, 20 and 100 rows plus the tail, three
// draws each, bit for bit; once per process.
bool rows_order_holds(int64_t k, int64_t rows, int64_t tail) {
  const std::tuple<int64_t, int64_t, int64_t, int> key{k, rows, tail, at::get_num_threads()};
  {
    std::lock_guard<std::mutex> lock(rows_mutex);
    if (auto found = rows_hold.find(key); found != rows_hold.end()) return found->second;
  }
  printpress_sum::CheckNumbers numbers(0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>((k * 4 + rows) * 4 + tail));
  bool holds = kRowsKernel;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  for (const int64_t n : {4 + tail, 20 + tail, 100 + tail}) {
    for (int draw = 0; draw < 3 && holds; ++draw) {
      Tensor x = at::empty({rows, k}, options), weight = at::empty({n, k}, options);
      fill_check_numbers(x, numbers);
      fill_check_numbers(weight, numbers);
      Tensor expected = at::mm(x, weight.t()), got = at::empty({rows, n}, options);
      rows_kernel(x, weight.t(), got);
      holds = std::memcmp(expected.data_ptr<float>(), got.data_ptr<float>(), sizeof(float) * rows * n) == 0;
    }
  }
  std::lock_guard<std::mutex> lock(rows_mutex);
  rows_hold[key] = holds;
  return holds;
}

std::atomic<bool> rows_kernel_on{true};  // off: every product is at::mm's (`set_rows_kernel`, for A/B measurements)

// Whether x (m, k) times weight_t (k, n) may run as rows_kernel: float32 on the CPU, 1 to 3 rows of unit stride
// (2 or 3 each starting on 16 bytes: MKL's order for them depends on that too), weight_t the transpose of a contiguous
// weight starting on 16 bytes, k a multiple of 4, and the kernel's order checked.
bool rows_kernel_applies(const Tensor& x, const Tensor& weight_t) {
  if (!kRowsKernel || !rows_kernel_on.load(std::memory_order_relaxed) || x.dim() != 2 || x.size(0) < 1 ||
      x.size(0) > kRowsMax || weight_t.dim() != 2)
    return false;
  const int64_t k = weight_t.size(0);
  return x.scalar_type() == at::kFloat && weight_t.scalar_type() == at::kFloat && x.device().is_cpu() &&
         weight_t.device().is_cpu() && x.size(1) == k && k >= 4 && k % 4 == 0 && weight_t.size(1) > 0 &&
         x.stride(1) == 1 && weight_t.stride(0) == 1 && weight_t.stride(1) == k &&
         reinterpret_cast<std::uintptr_t>(weight_t.data_ptr()) % 16 == 0 &&
         (x.size(0) == 1 || (reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 4 == 0)) &&
         rows_order_holds(k, x.size(0), weight_t.size(1) % 4);
}

// -- the half-width copies ----------------------------------------------------------------------------------------
//
// A weight's half-width copy (`blocked`) is made on its first product by the kernels above (one conversion and one
// comparison; where a value does not fit, that is remembered instead) and used while the weight's storage lives and
// its version counter (which every in-place change through autograd's view of the tensor moves: an optimizer's step,
// a `copy_` into the parameter under no_grad) stands where it stood. Writes that bypass the counter (through
// `.data`, or into a storage as FSDP's all-gathers refill theirs) would leave a copy stale, so copies are made only
// for the weights of a model marked for inference (`allow_half_width`, which printpress.load calls): a model being
// trained or evaluated in a training loop keeps at::mm's products from its float32 weights. A copy costs half the
// weight's bytes again; the copy of a weight that is gone is dropped when the next copy is made.
// `set_half_width(false)` turns the copies off (for A/B measurements, or to save their memory).
struct HalfWidth {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the weight's, not kept alive by this entry
  int64_t version = 0;
  Tensor copy;  // `blocked`, float16 or bfloat16; undefined where the values do not fit either
};

std::mutex half_mutex;
// The storages whose weights may be read from copies (`allow_half_width`: an inference model's, marked by
// printpress.load), each with a reference that does not keep it alive.
std::map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> half_allowed;
// by the weight's first element and its view's sizes and strides (a weight read in both layouts has two copies)
std::map<std::tuple<const void*, int64_t, int64_t, int64_t, int64_t>, HalfWidth> half_widths;
std::atomic<bool> half_width_on{true};
std::atomic<int64_t> half_widths_made{0};  // copies made (or found not to fit) so far, a weight's again when it changed

// The weight (n, k) at the narrower width that holds every one of its values exactly, blocked, or undefined.
Tensor narrower_copy(const Tensor& weight) {
  if (!kHalfRows) return Tensor();
  const float* values = weight.data_ptr<float>();
  const int64_t sample = std::min<int64_t>(weight.numel(), 64);
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    bool fits = true;  // the first few values first: most weights that do not fit show it there, without a copy
    for (int64_t i = 0; i < sample && fits; ++i) {
      fits = dtype == at::kHalf ? static_cast<float>(at::Half(values[i])) == values[i]
                                : static_cast<float>(at::BFloat16(values[i])) == values[i];
    }
    if (!fits) continue;
    Tensor copy = weight.to(dtype);
    if (at::equal(copy.to(at::kFloat), weight)) return blocked(copy);
  }
  return Tensor();
}

// The half-width copy of a float32 weight_t (k, n; the transpose of a contiguous (n, k) weight, as rows_kernel_applies
// found it), made on first use; undefined where the values do not fit, the copies are off, or the weight is an
// inference tensor (no version counter to tell whether it changed).
Tensor half_width_copy(const Tensor& weight_t) {
  if (!half_width_on.load(std::memory_order_relaxed) || weight_t.is_inference()) return Tensor();
  const std::tuple<const void*, int64_t, int64_t, int64_t, int64_t> key{
      weight_t.data_ptr(), weight_t.size(0), weight_t.size(1), weight_t.stride(0), weight_t.stride(1)};
  c10::StorageImpl* storage = weight_t.storage().unsafeGetStorageImpl();
  const int64_t version = weight_t._version();
  std::lock_guard<std::mutex> lock(half_mutex);
  const auto allowed = half_allowed.find(storage);
  if (allowed == half_allowed.end() || allowed->second.expired()) return Tensor();
  auto found = half_widths.find(key);
  if (found != half_widths.end()) {
    const HalfWidth& entry = found->second;
    if (!entry.storage.expired() && entry.storage._unsafe_get_target() == storage && entry.version == version)
      return entry.copy;
  }
  for (auto it = half_widths.begin(); it != half_widths.end();) {  // entries of weights that are gone
    it = it->second.storage.expired() ? half_widths.erase(it) : std::next(it);
  }
  half_widths_made.fetch_add(1, std::memory_order_relaxed);
  HalfWidth entry{weight_t.storage().getWeakStorageImpl(), version, narrower_copy(weight_t.t())};
  Tensor copy = entry.copy;
  half_widths.insert_or_assign(key, std::move(entry));
  return copy;
}

// per (inner size, rows, outputs % 4, the weight's layout, threads); under rows_mutex
std::map<std::tuple<int64_t, int64_t, int64_t, bool, int>, bool> few_hold;

// Whether few_rows_kernel gives at::mm's bits on this machine for inner size k, `rows` rows and a number of outputs
// that leaves `tail` = n % 4, the weight (n, k) handed over transposed as a linear's is or (`plain`) stored (k, n) as
// an embedding multiplied from the left is: random rows as rows_order_holds makes them times weights of 16 and 100
// rows plus the tail whose values are float16s, and then bfloat16s, two draws each, bit for bit; once per process.
bool few_rows_holds(int64_t k, int64_t rows, int64_t tail, bool plain) {
  const std::tuple<int64_t, int64_t, int64_t, bool, int> key{k, rows, tail, plain, at::get_num_threads()};
  {
    std::lock_guard<std::mutex> lock(rows_mutex);
    if (auto found = few_hold.find(key); found != few_hold.end()) return found->second;
  }
  printpress_sum::CheckNumbers numbers(0x5851f42d4c957f2dull ^
                                      static_cast<uint64_t>(((k * 16 + rows) * 4 + tail) * 2 + plain));
  bool holds = kHalfRows;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  for (const int64_t n : {16 + tail, 100 + tail}) {
    for (const auto dtype : {at::kHalf, at::kBFloat16}) {
      for (int draw = 0; draw < 2 && holds; ++draw) {
        Tensor x = at::empty({rows, k}, options), weight = at::empty({n, k}, options);
        fill_check_numbers(x, numbers);
        fill_check_numbers(weight, numbers);
        Tensor half = weight.to(dtype);
        Tensor widened = half.to(at::kFloat).t();  // (k, n)
        Tensor expected = at::mm(x, plain ? widened.contiguous() : widened), got = at::empty({rows, n}, options);
        few_rows_kernel(x, blocked(half), n, got, false);
        holds = std::memcmp(expected.data_ptr<float>(), got.data_ptr<float>(), sizeof(float) * rows * n) == 0;
      }
    }
  }
  std::lock_guard<std::mutex> lock(rows_mutex);
  few_hold[key] = holds;
  return holds;
}

// The half-width copy to compute x (m, k) times weight_t (k, n) from by few_rows_kernel, or undefined where it may
// not: float32 on the CPU, 4 to 64 rows of unit stride starting on 16 bytes, at least 16 outputs, an inner size k a
// multiple of 4 (some rows may add in fours), weight_t the transpose of a contiguous weight (a linear's) or itself
// contiguous (an embedding's, multiplied from the left), starting on 16 bytes, its values fitting half width, and the
// kernel's order checked for that layout.
Tensor few_rows_copy(const Tensor& x, const Tensor& weight_t) {
  if (!kHalfRows || !rows_kernel_on.load(std::memory_order_relaxed) || x.dim() != 2 || x.size(0) < kFewRowsMin ||
      x.size(0) > kFewRowsMax || weight_t.dim() != 2)
    return Tensor();
  const int64_t k = weight_t.size(0);
  if (x.scalar_type() != at::kFloat || weight_t.scalar_type() != at::kFloat || !x.device().is_cpu() ||
      !weight_t.device().is_cpu() || x.size(1) != k || k < 4 || k % 4 != 0 || weight_t.size(1) < 16 ||
      x.stride(1) != 1 || x.stride(0) % 4 != 0 || reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 ||
      reinterpret_cast<std::uintptr_t>(weight_t.data_ptr()) % 16)
    return Tensor();
  const int64_t n = weight_t.size(1);
  const bool transposed = weight_t.stride(0) == 1 && weight_t.stride(1) == k;
  const bool plain = weight_t.stride(0) == n && weight_t.stride(1) == 1;
  if (!transposed && !plain) return Tensor();
  // the order first: where it does not hold (another CPU's MKL), no copy is made
  return few_rows_holds(k, x.size(0), n % 4, plain) ? half_width_copy(weight_t) : Tensor();
}

// x times weight_t by one of the kernels into `out` (unit column stride) where one applies; false where none does.
bool kernel_product_into(const Tensor& out, const Tensor& x, const Tensor& weight_t) {
  if (rows_kernel_applies(x, weight_t)) {
    rows_kernel(x, weight_t, out, warming(x.size(0)), half_width_copy(weight_t));
    return true;
  }
  if (Tensor half = few_rows_copy(x, weight_t); half.defined()) {
    few_rows_kernel(x, half, weight_t.size(1), out, warming(x.size(0)));
    return true;
  }
  return false;
}

// x times weight_t by one of the kernels into a new tensor, or undefined where none applies.
Tensor kernel_product(const Tensor& x, const Tensor& weight_t) {
  if (x.dim() != 2 || weight_t.dim() != 2) return Tensor();
  Tensor out = at::empty({x.size(0), weight_t.size(1)}, x.options());
  return kernel_product_into(out, x, weight_t) ? out : Tensor();
}

// at::mm_out(out, x, weight_t), the weight read ahead where that pays: by a kernel where one applies and `out` is
// contiguous (into rows padded apart MKL may add otherwise).
void product_into(Tensor& out, const Tensor& x, const Tensor& weight_t) {
  if (out.is_contiguous() && kernel_product_into(out, x, weight_t)) return;
  warm(weight_t, x.size(0));
  at::mm_out(out, x, weight_t);
}

// F.linear without a bias on rows: at::linear's own path for a 2-D input (matmul, then mm), without its two layers.
// `weight_t` is the linear's weight transposed, (in, out): the view at::linear hands mm, made once in the plan
// (model.py, `native_plan`) rather than on every product. By a kernel above where one applies. Also the canvas's
// soft embedding (probs @ embedding, model.py `embed_canvas`: matmul's mm of the rows), where weight_t is the
// embedding itself.
Tensor product(const Tensor& x, const Tensor& weight_t) {
  if (x.dim() > 2 && x.is_contiguous() && weight_t.dim() == 2) {  // the rows, as at::linear folds them for its mm
    std::vector<int64_t> sizes = x.sizes().vec();
    if (Tensor out = kernel_product(x.view({-1, x.size(-1)}), weight_t); out.defined()) {
      sizes.back() = weight_t.size(1);
      return out.view(sizes);
    }
  }
  if (Tensor out = kernel_product(x, weight_t); out.defined()) return out;
  warm(weight_t, x.size(-1) == 0 ? 0 : x.numel() / x.size(-1));
  return x.dim() == 2 ? at::mm(x, weight_t) : at::linear(x, weight_t.t());
}

// The logits' product with the tied embedding (vocabulary x hidden: 3 MB on the shipped model, more than the L2),
// where weights are read ahead: in blocks of rows that fit the L2, each read ahead and multiplied into its columns
// of the output. Each output is one dot product over the hidden size, which a block computes as the whole product
// does wherever MKL takes the same path for both; that is checked on the first call of each shape (rows, sizes,
// dtype, threads): the whole product and the blocks on the call's own data, bit for bit, and where they differ that
// shape keeps the whole product. Measured on an AMD EPYC: 1.07x the AR step (session 34).
constexpr int64_t kHeadBlockBytes = 384 * 1024;

std::mutex head_mutex;
std::map<std::vector<int64_t>, bool> head_blocks_hold;  // per shape key: the blocks gave the whole product's bits

Tensor head_in_blocks(const Tensor& x, const Tensor& weight, int64_t block) {
  Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  for (int64_t start = 0; start < weight.size(0); start += block) {
    const int64_t end = std::min(start + block, weight.size(0));
    const Tensor rows = weight.slice(0, start, end);
    warm(rows, x.size(0));
    Tensor columns = out.slice(1, start, end);
    at::mm_out(columns, x, rows.t());
  }
  return out;
}

Tensor head(const Tensor& x, const Tensor& weight) {
  if (Tensor out = kernel_product(x, weight.t()); out.defined()) return out;  // read ahead in pieces too
  const int64_t row_bytes = weight.size(1) * static_cast<int64_t>(weight.element_size());
  const int64_t block = std::max<int64_t>(16, kHeadBlockBytes / row_bytes / 16 * 16);
  if (x.dim() != 2 || !warming(x.size(0)) || !x.is_contiguous() ||
      !weight.is_contiguous() || !x.device().is_cpu() || block >= weight.size(0))
    return at::mm(x, weight.t());
  const std::vector<int64_t> key{x.size(0), weight.size(1), weight.size(0), static_cast<int64_t>(x.scalar_type()),
                                 at::get_num_threads()};
  std::optional<bool> holds;
  {
    std::lock_guard<std::mutex> lock(head_mutex);
    if (auto found = head_blocks_hold.find(key); found != head_blocks_hold.end()) holds = found->second;
  }
  if (!holds.has_value()) {
    Tensor whole = at::mm(x, weight.t());
    const bool equal = at::equal(whole, head_in_blocks(x, weight, block));
    std::lock_guard<std::mutex> lock(head_mutex);
    head_blocks_hold[key] = equal;
    return whole;
  }
  return *holds ? head_in_blocks(x, weight, block) : at::mm(x, weight.t());
}

// DiffusionGemma.logits of a float32 model: `head`, then the logits' softcap (cap > 0) in place, with model.softcap's
// operators (one call in place of four from Python).
Tensor capped_head(const Tensor& x, const Tensor& weight, double cap) {
  Tensor out = head(x, weight);
  if (cap > 0.0 && out.scalar_type() == at::kFloat) out.div_(cap).tanh_().mul_(cap);
  return out;
}

// The shapes the head has checked so far, and in how many its blocks gave the whole product's bits (for the tests).
std::tuple<int64_t, int64_t> head_checks() {
  std::lock_guard<std::mutex> lock(head_mutex);
  int64_t held = 0;
  for (const auto& entry : head_blocks_hold) held += entry.second ? 1 : 0;
  return {static_cast<int64_t>(head_blocks_hold.size()), held};
}

// -- the gated activation in one loop ------------------------------------------------------------------------------
//
// act(gate) * up, for GELU's tanh form (gelu_tanh, the released models' activation): at::gelu(gate, "tanh") writes a
// new tensor and at::mul another. ATen's GELU kernel runs over the runs its iteration makes (the whole tensor where
// gate is contiguous; each row where gate is every other half of a wider row, as the experts' are), each run two
// vectors at a time by ATen's vector formula (`vectorized_gelu_approximated_with_tanh`, Sleef's tanh) and the rest of
// the run by its scalar formula (`scalar_gelu_approximated_with_tanh`, std::tanh); the product is one rounding.
// `gated` computes each element so, in one loop into one tensor. Whether that gives ATen's bits is checked once per
// process for each layout, row length, row count and thread count (where ATen would share the rows between threads,
// its runs are other ones) against the operators themselves (`gated_holds`); where it does not, or for another
// activation, dtype or layout, the operators run.
#ifdef PRINTPRESS_VEC
// GELU's tanh form as ATen's build computes it (its kernels are compiled with contraction on, and the disassembly of
// torch 2.13's AVX-512 and scalar forms shows one multiply-add: x + kappa * x^3): ((x * x) * x) * kappa + x in one
// rounding, times beta, Sleef's (or libm's) tanh, plus one, times 0.5 * x. This file is built with contraction off, so
// the multiply-add is written out and nothing else is fused.
constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kGeluKappa = 0.044715f;

void gelu_tanh_times(const float* gate, const float* up, int64_t n, float* out) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {  // pairs of vectors, as ATen's loop takes them
    for (int64_t j = i; j < i + 2 * Vec::size(); j += Vec::size()) {
      const Vec x = Vec::loadu(gate + j);
      const Vec inner = at::vec::fmadd(x * x * x, Vec(kGeluKappa), x) * Vec(kGeluBeta);
      const Vec activated = Vec(0.5f) * x * (Vec(1.0f) + inner.tanh());
      (activated * Vec::loadu(up + j)).store(out + j);
    }
  }
  for (; i < n; ++i) {
    const float x = gate[i], inner = std::fma(x * x * x, kGeluKappa, x) * kGeluBeta;
    out[i] = (0.5f * x * (1.0f + std::tanh(inner))) * up[i];
  }
}

// Whether the fused loop may run for gate and up of these sizes and strides: float32 on the CPU, the same sizes and
// strides, rows of unit stride, and either contiguous or each row its own run.
bool gated_layout(const Tensor& gate, const Tensor& up) {
  return gate.dim() == 2 && gate.device().is_cpu() && gate.scalar_type() == at::kFloat &&
         up.scalar_type() == at::kFloat && up.device().is_cpu() && gate.sizes() == up.sizes() &&
         gate.strides() == up.strides() && gate.stride(1) == 1 && gate.stride(0) >= gate.size(1) && gate.size(1) > 0;
}

Tensor gated_loop(const Tensor& gate, const Tensor& up) {
  const int64_t rows = gate.size(0), cols = gate.size(1), stride = gate.stride(0);
  Tensor out = at::empty({rows, cols}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (stride == cols) {
    gelu_tanh_times(g, u, rows * cols, o);
  } else {
    for (int64_t r = 0; r < rows; ++r) gelu_tanh_times(g + r * stride, u + r * stride, cols, o + r * cols);
  }
  return out;
}

std::mutex gated_mutex;
std::map<std::tuple<int64_t, int64_t, bool, int>, bool> gated_hold;  // (rows, cols, contiguous, threads)

// Whether gated_loop gives at::gelu(gate, "tanh") * up's bits for this shape and layout: random values over ~30
// octaves (tanh's saturation included) of both signs, and exact zeros, bit for bit; once per process.
// `contiguous`: gate's rows one after the other (else each row its own run: every other half of a wider row).
bool gated_holds(int64_t rows, int64_t cols, bool contiguous) {
  const std::tuple<int64_t, int64_t, bool, int> key{rows, cols, contiguous, at::get_num_threads()};
  {
    std::lock_guard<std::mutex> lock(gated_mutex);
    if (auto found = gated_hold.find(key); found != gated_hold.end()) return found->second;
  }
  printpress_sum::CheckNumbers numbers(0x2545f4914f6cdd1dull ^ static_cast<uint64_t>(rows * 8191 + cols));
  bool holds = true;
  for (int draw = 0; draw < 6 && holds; ++draw) {
    // gate and up side by side, as the experts' are
    Tensor both = at::empty({rows, 2 * cols}, at::TensorOptions().dtype(at::kFloat));
    float* data = both.data_ptr<float>();
    for (int64_t i = 0; i < both.numel(); ++i) {
      const uint64_t pick = numbers.next();
      data[i] = pick % 23 == 0 ? 0.0f : static_cast<float>((numbers.unit() - 0.5) *
                                                           std::ldexp(1.0, static_cast<int>(pick % 31) - 15));
    }
    Tensor g = both.narrow(1, 0, cols), u = both.narrow(1, cols, cols);
    if (contiguous) {
      g = g.contiguous();
      u = u.contiguous();
    }
    Tensor expected = at::gelu(g, "tanh") * u, got = gated_loop(g, u);
    holds = std::memcmp(expected.data_ptr<float>(), got.data_ptr<float>(), sizeof(float) * rows * cols) == 0;
  }
  std::lock_guard<std::mutex> lock(gated_mutex);
  gated_hold[key] = holds;
  return holds;
}

bool gated_holds(const Tensor& gate) { return gated_holds(gate.size(0), gate.size(1), gate.stride(0) == gate.size(1)); }
#endif

// Whether `gated` runs its one loop for these inputs (else the operators).
bool gated_fused(const Tensor& gate, const Tensor& up, int64_t code) {
#ifdef PRINTPRESS_VEC
  return code == 0 && gated_layout(gate, up) && gated_holds(gate);
#else
  return false;
#endif
}

// act(gate) * up. Contiguous inputs of more dimensions (the self-conditioning MLP's (B, C, H)) as their rows: ATen
// runs them as one run too.
Tensor gated(const Tensor& gate, const Tensor& up, int64_t code) {
#ifdef PRINTPRESS_VEC
  if (gate.dim() > 2 && gate.is_contiguous() && up.is_contiguous() && gate.sizes() == up.sizes() && gate.numel() > 0) {
    const int64_t cols = gate.size(-1);
    const Tensor rows = gate.view({-1, cols}), up_rows = up.view({-1, cols});
    if (gated_fused(rows, up_rows, code)) return gated_loop(rows, up_rows).view(gate.sizes());
  }
  if (gated_fused(gate, up, code)) return gated_loop(gate, up);
#endif
  return act(gate, code) * up;
}

// GatedMLP.forward / SelfConditioning's MLP: down(act(gate(x)) * up(x)).
Tensor gated_mlp(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down, int64_t code) {
  return product(gated(product(x, gate), product(x, up), code), down);
}

// t.chunk(2, -1) for an even last size: the same two views, without chunk's and split's own dispatches.
std::array<Tensor, 2> halves(const Tensor& t) {
  const int64_t n = t.size(-1);
  if (n % 2 != 0) {
    auto parts = t.chunk(2, -1);
    return {parts[0], parts[1]};
  }
  return {t.narrow(-1, 0, n / 2), t.narrow(-1, n / 2, n / 2)};
}

// Experts.expert_mlp: one expert's gated MLP from the packed weights.
Tensor expert_mlp(const Tensor& x, const Tensor& gate_up, const Tensor& down, int64_t code) {
  auto gate_up_out = halves(product(x, gate_up));
  return product(gated(gate_up_out[0], gate_up_out[1], code), down);
}

// F.grouped_mm(x, weights_t, offs=cumsum(counts)) on a CPU, `weights_t` the experts' weights transposed (E, in,
// out): ATen runs it as one mm per expert into its rows of an output whose rows start at multiples of 16 bytes
// (`_grouped_mm_fallback`); the same products into the same layout here, without the checks, the offsets' copy and
// the empty experts' calls.
Tensor grouped_mm(const Tensor& x, const Tensor& weights_t, const std::vector<int64_t>& count) {
  const int64_t columns = weights_t.size(2), align = 16 / static_cast<int64_t>(x.element_size());
  Tensor out = at::empty_strided({x.size(0), columns}, {(columns + align - 1) / align * align, 1}, x.options());
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(count.size()); ++e) {
    if (count[e] == 0) continue;
    Tensor rows = out.slice(0, start, start + count[e]);
    product_into(rows, x.slice(0, start, start + count[e]), weights_t[e]);
    start += count[e];
  }
  return out;
}

// x.index_select(0, order // top_k): the row of the token each sorted (token, slot) pair belongs to (copies).
Tensor gather_rows(const Tensor& x, const Tensor& order, int64_t top_k) {
  const int64_t rows = order.numel(), h = x.size(-1);
  Tensor out = at::empty({rows, h}, x.options());
  const int64_t* index = order.data_ptr<int64_t>();
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) std::memcpy(dst + i * h, src + (index[i] / top_k) * h, sizeof(float) * h);
  return out;
}

// What Experts.forward makes of the experts' outputs `out` (rows in sorted order, float32): each row times its
// (token, slot) weight, put back in (token, slot) order, and each token's top_k rows summed, as ATen's sum over that
// dimension adds them (`cascade_sum`'s outer reduction, for top_k < 16: the columns in whole groups of 4 vectors add
// the slots one after the other from 0, then three zeros; the other columns as four interleaved sequences, like a
// row's sum). The same bits as the operators, without the five intermediate tensors.
// An undefined `order`: the rows are already in (token, slot) order.
void slot_sums(const float* src, int64_t stride, const int64_t* row_of, const float* slot_weight, int64_t tokens,
               int64_t top_k, int64_t h, float* dst);

Tensor weighted_slot_sum(const Tensor& out, const Tensor& order, const Tensor& weights, int64_t top_k) {
  const int64_t pairs = out.size(0), tokens = pairs / top_k, h = out.size(1);
  std::vector<int64_t> row_of(pairs);  // the sorted row of each (token, slot) pair
  const int64_t* index = order.defined() ? order.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < pairs; ++i) row_of[index != nullptr ? index[i] : i] = i;
  Tensor w = weights.contiguous();
  Tensor result = at::empty({tokens, h}, out.options().memory_format(at::MemoryFormat::Contiguous));
  slot_sums(out.data_ptr<float>(), out.stride(0), row_of.data(), w.data_ptr<float>(), tokens, top_k, h,
            result.data_ptr<float>());
  return result;
}

// weighted_slot_sum's loops: `tokens` rows of h sums into dst, token t's slot j the row row_of[t * top_k + j] of src
// (rows `stride` apart) times slot_weight[t * top_k + j].
void slot_sums(const float* src, int64_t stride, const int64_t* row_of, const float* slot_weight, int64_t tokens,
               int64_t top_k, int64_t h, float* dst) {
  const int64_t grouped = h / (4 * FusedNorms::width()) * (4 * FusedNorms::width());
  std::vector<float> products(top_k * (h - grouped));
  for (int64_t t = 0; t < tokens; ++t) {
    float* sums = dst + t * h;
    // columns [0, grouped): each the slots' products added in slot order from 0, then the three zeros of the other
    // sequences and the output's 0 (ATen's sum of k values a lane), a column per lane of the loops
    for (int64_t c = 0; c < grouped; ++c) sums[c] = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      const float* row = src + row_of[t * top_k + j] * stride;
      const float weight = slot_weight[t * top_k + j];
      for (int64_t c = 0; c < grouped; ++c) sums[c] += row[c] * weight;
    }
    for (int64_t c = 0; c < grouped; ++c) sums[c] = 0.0f + (((sums[c] + 0.0f) + 0.0f) + 0.0f);
    // the rest: ATen's row sum over the k products
    for (int64_t j = 0; j < top_k; ++j) {
      const float* row = src + row_of[t * top_k + j] * stride;
      const float weight = slot_weight[t * top_k + j];
      for (int64_t c = grouped; c < h; ++c) products[(c - grouped) * top_k + j] = row[c] * weight;
    }
    for (int64_t c = grouped; c < h; ++c) sums[c] = 0.0f + row_sum<1>(products.data() + (c - grouped) * top_k, top_k);
  }
}

// Whether weighted_slot_sum gives the operators' bits on this machine: checked once per process against ATen itself,
// on random outputs, weights and orders for 1 to 15 slots and widths from 16 to 200 columns.
bool slot_sums_hold() {
  static const bool holds = [] {
    if (FusedNorms::width() == 0) return false;
    printpress_sum::CheckNumbers numbers(0x2545f4914f6cdd1dull);
    const auto options = at::TensorOptions().dtype(at::kFloat);
    for (int64_t k : {1, 2, 3, 4, 5, 8, 15}) {
      for (int64_t h : {16, 24, 40, 72, 200}) {
        const int64_t tokens = 7, pairs = tokens * k;
        Tensor out = at::empty({pairs, h}, options), weights = at::empty({tokens, k}, options);
        fill_check_numbers(out, numbers);
        fill_check_numbers(weights, numbers);
        Tensor order = at::empty({pairs}, at::TensorOptions().dtype(at::kLong));
        int64_t* index = order.data_ptr<int64_t>();
        for (int64_t i = 0; i < pairs; ++i) index[i] = i;
        for (int64_t i = pairs - 1; i > 0; --i) std::swap(index[i], index[numbers.next() % (i + 1)]);
        Tensor slot_weights = weights.reshape(-1).index_select(0, order);
        Tensor expected = at::empty_like(out).index_copy_(0, order, out * slot_weights.unsqueeze(1))
                              .view({tokens, k, h}).sum(1);
        Tensor got = weighted_slot_sum(out, order, weights, k);
        if (std::memcmp(expected.data_ptr<float>(), got.data_ptr<float>(), sizeof(float) * tokens * h) != 0)
          return false;
      }
    }
    return true;
  }();
  return holds;
}

// Experts.forward with gradients off: `_one_token` for one row, else the sort, the two grouped products and the
// slot-ordered sum. `gate_up_proj` and `down_proj` come transposed, (E, in, out).
Tensor experts(const Tensor& x, const Tensor& weights, const Tensor& chosen, const Tensor& gate_up_proj,
               const Tensor& down_proj, int64_t code) {
  const int64_t top_k = chosen.size(-1);
  const bool slot_sums = fused(x, {weights}) && top_k < 16 && x.size(-1) >= 16 && slot_sums_hold();
  if (x.size(0) == 1) {
    Tensor row = chosen.is_contiguous() ? chosen : chosen.contiguous();  // (1, top_k)
    const int64_t* index = row.data_ptr<int64_t>();
    if (slot_sums) {  // each expert's row straight into its slot's row, then the weighted sum in one loop
      Tensor out = at::empty({top_k, x.size(-1)}, x.options());
      for (int64_t slot = 0; slot < top_k; ++slot) {
        auto gate_up = halves(product(x, gate_up_proj.select(0, index[slot])));
        Tensor slot_row = out.narrow(0, slot, 1);
        product_into(slot_row, gated(gate_up[0], gate_up[1], code), down_proj.select(0, index[slot]));
      }
      return weighted_slot_sum(out, Tensor(), weights, top_k);
    }
    std::vector<Tensor> rows;
    for (int64_t slot = 0; slot < row.numel(); ++slot) {
      rows.push_back(expert_mlp(x, gate_up_proj.select(0, index[slot]), down_proj.select(0, index[slot]), code));
    }
    Tensor weighted = at::cat(rows) * weights.reshape({-1, 1});
    Tensor summed = weighted.sum(0, /*keepdim=*/true);
    return summed.scalar_type() == x.scalar_type() ? summed : summed.to(x.scalar_type());
  }
  auto [sorted, order] = at::sort(chosen.reshape(-1));
  // bincount(chosen, minlength=E), from the sorted choices: each expert's rows
  std::vector<int64_t> counts(gate_up_proj.size(0), 0);
  const Tensor choices = sorted.contiguous();
  const int64_t* choice = choices.data_ptr<int64_t>();
  for (int64_t i = 0; i < choices.numel(); ++i) ++counts[choice[i]];
  Tensor gathered = fused(x) ? gather_rows(x, order, top_k) : x.index_select(0, at::floor_divide(order, top_k));
  auto gate_up = halves(grouped_mm(gathered, gate_up_proj, counts));
  Tensor out = grouped_mm(gated(gate_up[0], gate_up[1], code), down_proj, counts);
  if (slot_sums) return weighted_slot_sum(out, order, weights, top_k);
  Tensor slot_weights = weights.reshape(-1).index_select(0, order);
  Tensor weighted = at::empty_like(out, out.options().dtype(slot_weights.scalar_type()))
                        .index_copy_(0, order, out * slot_weights.unsqueeze(1));
  Tensor summed = weighted.view({-1, top_k, x.size(-1)}).sum(1);
  return summed.scalar_type() == x.scalar_type() ? summed : summed.to(x.scalar_type());
}

// shared_norm's loop over `rows` rows of n floats at x: each value of a row's norm times the dense weight (into
// dense), times the router's scale and then root_size (into routed), times the experts' weight (into experts).
void rows_shared_norm(const float* x, int64_t rows, int64_t n, double eps, const float* dense_weight,
                      const float* router_scale, double root_size, const float* experts_weight, float* dense,
                      float* routed, float* experts) {
  const float root = static_cast<float>(root_size);
  rms_rows(x, rows, n, eps, [&](int64_t r, const float* row, float inverse) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = row[i] * inverse;
      dense[r * n + i] = v * dense_weight[i];
      routed[r * n + i] = (v * router_scale[i]) * root;
      experts[r * n + i] = v * experts_weight[i];
    }
  });
}

// The three inputs after_attention takes from one norm of x: the dense MLP's (its pre_feedforward_layernorm weight),
// the router's (its weightless norm, * its scale, * root_size) and the experts' (pre_feedforward_layernorm_2).
std::tuple<Tensor, Tensor, Tensor> shared_norm(const Tensor& x, const Tensor& dense_weight,
                                               const Tensor& router_scale, double root_size,
                                               const Tensor& experts_weight, double eps) {
  const auto dtype = x.scalar_type();
  if (!fused(x, {dense_weight, router_scale, experts_weight})) {
    Tensor normalized = rms_normalize(x, eps);
    return {scale(normalized, dense_weight, dtype), scale(normalized, Tensor(), dtype) * router_scale * root_size,
            scale(normalized, experts_weight, dtype)};
  }
  Tensor dense = at::empty_like(x), routed = at::empty_like(x), experts = at::empty_like(x);
  const int64_t n = x.size(-1);
  rows_shared_norm(x.data_ptr<float>(), x.numel() / n, n, eps, dense_weight.data_ptr<float>(),
                   router_scale.data_ptr<float>(), root_size, experts_weight.data_ptr<float>(), dense.data_ptr<float>(),
                   routed.data_ptr<float>(), experts.data_ptr<float>());
  return {dense, routed, experts};
}

// route_weights' loop: `rows` rows of k chosen probabilities `p` and experts `index` into their weights `dst`.
void route_rows(const float* p, const int64_t* index, int64_t rows, int64_t k, const float* scale, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float total = printpress_sum::aten_sum(p + r * k, k, FusedNorms::width());
    for (int64_t j = 0; j < k; ++j) dst[r * k + j] = (p[r * k + j] / total) * scale[index[r * k + j]];
  }
}

// Router.route after its top-k: the chosen probabilities over their sum, times each chosen expert's scale. For
// float32, one loop with ATen's roundings (the sum of a row's k values as ATen's sum adds them, then a division and
// a product per value).
Tensor route_weights(const Tensor& top, const Tensor& chosen, const Tensor& per_expert_scale) {
  if (!fused(top, {per_expert_scale}) || !chosen.is_contiguous()) {
    Tensor weights = top / top.sum(-1, /*keepdim=*/true);
    return weights * at::index(per_expert_scale, {chosen});
  }
  Tensor weights = at::empty_like(top);
  const int64_t k = top.size(-1);
  route_rows(top.data_ptr<float>(), chosen.data_ptr<int64_t>(), top.numel() / k, k,
             per_expert_scale.data_ptr<float>(), weights.data_ptr<float>());
  return weights;
}

// Layer.attention_inputs: the input norm, then Attention.project. `w`: input_layernorm, q_proj, k_proj, q_norm and
// k_norm weights, then v_proj's where the layer has one (not on K=V layers); the matrices (here and in every `w`
// below) transposed, as the products read them (`product`). Returns q (B, T, heads, D) and k, v
// (B, kv_heads, T, D).
std::tuple<Tensor, Tensor, Tensor> attention_inputs(const Tensor& x, at::TensorList w, int64_t batch, int64_t length,
                                                    int64_t head_dim, double eps, const Tensor& cos,
                                                    const Tensor& signed_sin) {
  TORCH_CHECK(w.size() == 5 || w.size() == 6, "printpress_layers.attention_inputs: 5 or 6 weights, not ", w.size());
  Tensor h = norm(x, w[0], eps);
  Tensor q = norm_rotate(product(h, w[1]).view({batch, length, -1, head_dim}), w[3], eps, cos, signed_sin);
  Tensor k_normalized;  // before k_norm's weight: a K=V layer's values
  Tensor k = norm_rotate(product(h, w[2]).view({batch, length, -1, head_dim}), w[4], eps, cos, signed_sin,
                         w.size() == 5 ? &k_normalized : nullptr);
  Tensor v = w.size() == 5 ? k_normalized : norm(product(h, w[5]).view({batch, length, -1, head_dim}), Tensor(), eps);
  return {q, k.transpose(1, 2), v.transpose(1, 2)};
}

// Slots [slot, slot + count) of `dst` (B, H, S, D) set to positions [from, from + count) of `src` (B, H, T, D), as
// `dst.narrow(2, slot, count).copy_(src.narrow(2, from, count))` sets them: one memcpy per (b, h) run where both
// have unit-stride rows of the same dtype (each row a run of D elements, a (b, h)'s rows one after the other where
// they are so in both), without ATen's copy machinery (~3 us a copy on an AMD Zen 3, four to six a layer's AR step).
// With gradients on, ATen's copy, which autograd records.
void copy_slots(const Tensor& dst, int64_t slot, const Tensor& src, int64_t from, int64_t count) {
  if (count <= 0) return;
  if (at::GradMode::is_enabled() || dst.dim() != 4 || src.dim() != 4 || dst.scalar_type() != src.scalar_type() ||
      dst.stride(3) != 1 || src.stride(3) != 1 || dst.size(0) != src.size(0) || dst.size(1) != src.size(1) ||
      dst.size(3) != src.size(3) || !dst.device().is_cpu() || !src.device().is_cpu()) {
    dst.narrow(2, slot, count).copy_(src.narrow(2, from, count));
    return;
  }
  const int64_t d = dst.size(3), item = dst.element_size();
  const bool runs = dst.stride(2) == d && src.stride(2) == d;  // a (b, h)'s rows: one run of count * d elements
  char* to = static_cast<char*>(dst.data_ptr());
  const char* of = static_cast<const char*>(src.data_ptr());
  for (int64_t b = 0; b < dst.size(0); ++b) {
    for (int64_t h = 0; h < dst.size(1); ++h) {
      char* dst_row = to + (b * dst.stride(0) + h * dst.stride(1) + slot * dst.stride(2)) * item;
      const char* src_row = of + (b * src.stride(0) + h * src.stride(1) + from * src.stride(2)) * item;
      if (runs) {
        std::memcpy(dst_row, src_row, count * d * item);
        continue;
      }
      for (int64_t i = 0; i < count; ++i)
        std::memcpy(dst_row + i * dst.stride(2) * item, src_row + i * src.stride(2) * item, d * item);
    }
  }
}

// KVJoin.__call__ and Attention.attend (printpress/model.py): the block's keys/values `k`, `v` (B, kv_heads, T, D)
// joined to the layer's cached ones (`keys`, `values`), then attention of `q` (B, T, heads, D) over them; returns
// (B*T, heads*D), before the output projection. In place: the block is written at `start` and the first start + T
// slots are read. Otherwise the first `start` slots, from slot `wrap` on and then from 0, are concatenated before the
// block, and then the block's last `keep` keys/values are written to slots `write_at` onwards (or to `slots`).
Tensor join(const Tensor& cached, const Tensor& block, bool in_place, int64_t start, int64_t wrap, int64_t keep,
            int64_t write_at, const std::optional<Tensor>& slots) {
  const int64_t t = block.size(2);
  if (in_place) {
    copy_slots(cached, start, block, 0, t);
    return cached.narrow(2, 0, start + t);
  }
  // at::cat: the same joins as copy_slots into a new tensor took 1.03-1.07x as long in a canvas-32 pass (session 46)
  Tensor joined = wrap > 0 ? at::cat({cached.narrow(2, wrap, start - wrap), cached.narrow(2, 0, wrap), block}, 2)
                           : at::cat({cached.narrow(2, 0, start), block}, 2);
  if (keep > 0) {  // after the concatenation: the ring may overwrite what it just read
    if (slots)
      cached.index_copy_(2, *slots, block.narrow(2, t - keep, keep));
    else
      copy_slots(cached, write_at, block, t - keep, keep);
  }
  return joined;
}

// -- the attention in loops -----------------------------------------------------------------------------------------
//
// at::scaled_dot_product_attention's CPU flash kernel for float32, re-done without the tensors, a bool mask's
// conversion and the dispatch around it (aten_attention.h), where it gives the same numbers: keys of one block (at
// most 512), a bool or float32 (additive) mask or none, shared by the heads, and the form of the kernel that matched
// ATen in this process at this thread count (`attention_form`). Elsewhere ATen's call runs.
// `set_attention_in_loops(false)`: always ATen's (A/B measurements).
std::atomic<bool> attention_loops_on{true};

// Whether `attention_loops` takes at::scaled_dot_product_attention(q, k, v, mask, 0, false, scale, gqa) for q (B,
// heads, T, D), k and v (B, kv_heads, S, D) (any form; `attention_form` says which one would run).
bool attention_loops_apply(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                           bool gqa) {
  const auto fits = [](const Tensor& t) {
    return t.dim() == 4 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(3) == 1;
  };
  if (at::GradMode::is_enabled() || !fits(q) || !fits(k) || !fits(v)) return false;
  const int64_t B = q.size(0), heads = q.size(1), T = q.size(2), D = q.size(3), kv_heads = k.size(1), S = k.size(2);
  if (k.size(0) != B || v.size(0) != B || v.size(1) != kv_heads || v.size(2) != S || k.size(3) != D ||
      v.size(3) != D || T < 1 || D < 1 || S < 1 || S > printpress_attention::kKeyBlock || kv_heads < 1 ||
      heads % kv_heads != 0 || (heads != kv_heads && !gqa))
    return false;
  if (!mask) return true;
  const Tensor& m = *mask;
  return m.dim() == 4 && (m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat) && m.device().is_cpu() &&
         (m.size(0) == 1 || m.size(0) == B) &&
         m.size(1) == 1 && (m.size(2) == 1 || m.size(2) == T) && (m.size(3) == 1 || m.size(3) == S);
}

// attention_loops_apply's attention in the loops of form `form` (1 + exp_u20 + 2 * a tail in double + 4 * a fused
// mask; aten_attention.h's Form), into out: (B, T, heads, D), contiguous (what `attend` reshapes ATen's output to).
void attention_loops(int form, const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                     double scale, float* out) {
#ifdef PRINTPRESS_VEC
  using printpress_attention::Operand;
  const auto operand = [](const Tensor& t) {
    return Operand{t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
  };
  printpress_attention::Mask seen;
  if (mask) {
    const Tensor& m = *mask;
    const bool boolean = m.scalar_type() == at::kBool;
    seen = {boolean ? m.data_ptr<bool>() : nullptr, boolean ? nullptr : m.data_ptr<float>(),
            m.size(0) > 1 ? m.stride(0) : 0, m.size(2) > 1 ? m.stride(2) : 0, m.size(3) > 1 ? m.stride(3) : 0};
  }
  const printpress_attention::Form kind{((form - 1) & 1) != 0, ((form - 1) & 2) != 0, ((form - 1) & 4) != 0};
  printpress_attention::attend(kind, operand(q), operand(k), operand(v), seen, q.size(0), q.size(2), q.size(1),
                               k.size(1), k.size(2), q.size(3), static_cast<float>(scale), out);
#else
  TORCH_CHECK(false, "printpress_layers: the attention's loops need ATen's vector code (AVX2 or AVX-512)");
#endif
}

// The form of ATen's flash kernel (aten_attention.h) that gives at::scaled_dot_product_attention's numbers on this
// machine with this many threads, checked once per process and thread count (`attention_form`) on random queries,
// keys and values of the shapes the passes have (one to 64 query rows, 1 to 512 keys, no mask, bool and additive
// masks, rows that see no key, grouped-query heads, a cache's strided keys): 1 + (ATen's exp_u20, else Sleef's) + 2 *
// (the tail in double, else in float) + 4 * (the mask added in a fused multiply-add); 0 if none does.
int attention_form_now() {
#ifdef PRINTPRESS_VEC
  if (!printpress_attention::blas_found()) return 0;
  struct Probe {
    int64_t B, heads, kv_heads, T, S, D;
    int mask;  // 0 none, 1 causal over the block's last T keys (row 0 of the second batch row sees none), 2 per key,
               // 3 additive: random values, -inf on 1's pattern
  };
  // the three of 64 rows: ~40000 elements past the rows' last whole vectors, where the two tails' exps rarely differ;
  // the last two: additive masks of any values, whose sum with the scores a fused multiply-add rounds once
  const Probe probes[] = {{1, 3, 1, 1, 1, 64, 0},   {1, 3, 1, 1, 121, 64, 0}, {1, 3, 1, 1, 7, 64, 0},
                          {1, 3, 1, 8, 120, 64, 1}, {2, 4, 2, 5, 13, 32, 1},  {1, 3, 1, 32, 100, 64, 1},
                          {1, 2, 2, 40, 512, 64, 0}, {1, 3, 1, 1, 129, 64, 2}, {2, 3, 1, 8, 67, 64, 2},
                          {4, 8, 2, 64, 7, 16, 0},  {4, 8, 8, 64, 13, 8, 2},  {2, 8, 4, 64, 31, 16, 1},
                          {2, 3, 1, 8, 70, 64, 3},  {1, 3, 1, 1, 5, 64, 3}};
  const auto options = at::TensorOptions().dtype(at::kFloat);
  for (int form : {8, 4, 6, 2, 7, 3, 5, 1}) {
    printpress_sum::CheckNumbers numbers(0x9e3779b97f4a7c15ull);
    const auto fill = [&numbers](const Tensor& t, double spread) {
      float* data = t.data_ptr<float>();
      for (int64_t i = 0; i < t.numel(); ++i) data[i] = static_cast<float>((numbers.unit() - 0.5) * spread);
    };
    bool ok = true;
    for (const Probe& p : probes) {
      // the queries as rows_layer views its buffer, the keys and values as a cache's first S slots of S + 3
      const Tensor q = at::empty({p.B, p.T, p.heads, p.D}, options).transpose(1, 2);
      const Tensor k = at::empty({p.B, p.kv_heads, p.S + 3, p.D}, options), v = at::empty_like(k);
      fill(q, 6.0);
      fill(k, 6.0);
      fill(v, 2.0);
      std::optional<Tensor> mask;
      if (p.mask != 0) {
        const int64_t rows = p.mask == 2 ? 1 : p.T;
        mask = at::empty({p.B, 1, rows, p.S}, p.mask == 3 ? options : at::TensorOptions().dtype(at::kBool));
        for (int64_t b = 0; b < p.B; ++b)
          for (int64_t t = 0; t < rows; ++t)
            for (int64_t j = 0; j < p.S; ++j) {
              const int64_t at = (b * rows + t) * p.S + j;
              const bool causal = !(b == 1 && t == 0) && j <= p.S - p.T + t;
              if (p.mask == 3)
                mask->data_ptr<float>()[at] = causal ? static_cast<float>((numbers.unit() - 0.5) * 3.0)
                                                     : -std::numeric_limits<float>::infinity();
              else
                mask->data_ptr<bool>()[at] = p.mask == 1 ? causal : numbers.unit() < 0.7 || j == 0;
            }
      }
      const Tensor keys = k.narrow(2, 0, p.S), values = v.narrow(2, 0, p.S);
      // a scale that is no power of two for the additive masks: its products are rounded, as a fused add is not
      const double scale = 1.0 / std::sqrt(static_cast<double>(p.D)) * (p.mask == 2 ? 2.0 : p.mask == 3 ? 1.1 : 1.0);
      const Tensor expected =
          at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale, p.heads != p.kv_heads)
              .transpose(1, 2)
              .contiguous();
      std::vector<float> got(expected.numel());
      attention_loops(form, q, keys, values, mask, scale, got.data());
      if (std::memcmp(expected.data_ptr<float>(), got.data(), sizeof(float) * got.size()) != 0) {
        ok = false;
        break;
      }
    }
    if (ok) return form;
  }
  return 0;
#else
  return 0;
#endif
}

std::mutex attention_mutex;
std::map<int, int> attention_forms;  // per thread count: with two, ATen's kernel adds up some shapes another way

int attention_form() {
  const int threads = at::get_num_threads();
  {
    std::lock_guard<std::mutex> lock(attention_mutex);
    if (auto found = attention_forms.find(threads); found != attention_forms.end()) return found->second;
  }
  const int form = attention_form_now();
  std::lock_guard<std::mutex> lock(attention_mutex);
  attention_forms[threads] = form;
  return form;
}

// The form `attention_loops` runs at::scaled_dot_product_attention(q, k, v, mask, 0, false, scale, gqa) in, where
// they apply, are on and give ATen's numbers here; 0 where ATen's call must run.
int attention_in_loops_form(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                            bool gqa) {
  if (!attention_loops_on.load(std::memory_order_relaxed) || !attention_loops_apply(q, k, v, mask, gqa)) return 0;
  return attention_form();
}

// The attention into out (B, T, heads, D), contiguous, by `attention_loops` where `attention_in_loops_form` says they
// may run; false (nothing written) where ATen's call must.
bool attention_in_loops(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                        double scale, bool gqa, float* out) {
  const int form = attention_in_loops_form(q, k, v, mask, gqa);
  if (form == 0) return false;
  attention_loops(form, q, k, v, mask, scale, out);
  return true;
}

// `attention_loops` of form `form` (-1: `attention_form`'s) as an operator, for the tests: (B, T, heads, D).
Tensor attention_loops_op(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                          double scale, bool gqa, int64_t form) {
  TORCH_CHECK(attention_loops_apply(q, k, v, mask, gqa), "printpress_layers.attention_loops: not an attention the "
              "loops take (float32 (B, heads, T, D) queries, at most ", printpress_attention::kKeyBlock, " keys, a "
              "bool or float32 mask shared by the heads)");
  const int which = form < 0 ? attention_form() : static_cast<int>(form);
  TORCH_CHECK(which >= 1 && which <= 8, "printpress_layers.attention_loops: no form ", which);
  Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  attention_loops(which, q, k, v, mask, scale, out.data_ptr<float>());
  return out;
}

Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& keys, const Tensor& values,
              const std::optional<Tensor>& mask, bool in_place, int64_t start, int64_t wrap, int64_t keep,
              int64_t write_at, const std::optional<Tensor>& slots, bool gqa, double scale) {
  Tensor joined_k = join(keys, k, in_place, start, wrap, keep, write_at, slots);
  Tensor joined_v = join(values, v, in_place, start, wrap, keep, write_at, slots);
  const Tensor query = q.transpose(1, 2);
  if (const int form = attention_in_loops_form(query, joined_k, joined_v, mask, gqa); form != 0) {
    Tensor out = at::empty({q.size(0) * q.size(1), q.size(2) * q.size(3)}, q.options());
    attention_loops(form, query, joined_k, joined_v, mask, scale, out.data_ptr<float>());
    return out;
  }
  Tensor out = at::scaled_dot_product_attention(query, joined_k, joined_v, mask, 0.0, false, scale, gqa);
  return out.transpose(1, 2).reshape({q.size(0) * q.size(1), -1});
}

// Layer.after_attention with a bool `encoder` (its layer scalar comes in `w`). `w`: o_proj,
// post_attention_layernorm, pre_feedforward_layernorm, mlp gate/up/down, post_feedforward_layernorm_1, router
// scale, router proj, router per_expert_scale, pre_feedforward_layernorm_2, experts gate_up_proj and down_proj,
// post_feedforward_layernorm_2, post_feedforward_layernorm, the layer scalar.
Tensor after_attention(const Tensor& x_in, const Tensor& attended, at::TensorList w, int64_t top_k, double root_size,
                       double eps, int64_t code) {
  TORCH_CHECK(w.size() == 16, "printpress_layers.after_attention: 16 weights, not ", w.size());
  const auto dtype = x_in.scalar_type();
  Tensor x = add_norm(x_in, product(attended, w[0]), w[1], eps);
  auto [pre, routed, pre2] = shared_norm(x, w[2], w[7], root_size, w[10], eps);
  Tensor dense = norm(gated_mlp(pre, w[3], w[4], w[5], code), w[6], eps);
  Tensor probs = at::softmax(product(routed, w[8]), -1, at::kFloat);
  auto [top, chosen] = at::topk(probs, top_k, -1);
  Tensor weights = route_weights(top, chosen, w[9]);
  Tensor sparse = experts(pre2, weights, chosen, w[11], w[12], code);
  return add_norm(x, add_norm(dense, sparse, w[13], eps), w[14], eps, w[15]);
}

// Layer.forward with a bool `encoder` and its keys/values joined as a KVJoin describes: attention_inputs, attend
// and after_attention in one call (the weights of each in `attention_w` and `after_w`).
Tensor layer(const Tensor& x, at::TensorList attention_w, at::TensorList after_w, int64_t batch, int64_t length,
             int64_t head_dim, double eps, const Tensor& cos, const Tensor& signed_sin, const Tensor& keys,
             const Tensor& values, const std::optional<Tensor>& mask, bool in_place, int64_t start, int64_t wrap,
             int64_t keep, int64_t write_at, const std::optional<Tensor>& slots, bool gqa, double scale,
             int64_t top_k, double root_size, int64_t code) {
  auto [q, k, v] = attention_inputs(x, attention_w, batch, length, head_dim, eps, cos, signed_sin);
  Tensor attended = attend(q, k, v, keys, values, mask, in_place, start, wrap, keep, write_at, slots, gqa, scale);
  return after_attention(x, attended, after_w, top_k, root_size, eps, code);
}

// Whether t is a float32 CPU tensor, contiguous.
bool float_vector(const Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// Whether one row times weight_t (k, n) is rows_kernel's as far as the weight tells (kernel_product_into for a row of
// unit stride): the transpose of a contiguous float32 weight on 16 bytes, k a multiple of 4, n of 4 (no at::mm tail).
bool row_product_shapes(const Tensor& weight_t) {
  if (!kRowsKernel || weight_t.dim() != 2 || weight_t.scalar_type() != at::kFloat || !weight_t.device().is_cpu())
    return false;
  const int64_t k = weight_t.size(0), n = weight_t.size(1);
  return k >= 4 && k % 4 == 0 && n > 0 && n % 4 == 0 && weight_t.stride(0) == 1 && weight_t.stride(1) == k &&
         reinterpret_cast<std::uintptr_t>(weight_t.data_ptr()) % 16 == 0;
}

// Whether a layer's weights (`layer`'s attention ones and one mode's after-attention ones) let a few rows' layer run
// in buffers (`rows_layer`), as far as their dtypes, layouts and sizes tell.
bool buffer_shapes(const std::vector<Tensor>& a, const std::vector<Tensor>& w, int64_t d, int64_t top_k, int64_t act) {
  const Tensor &gate_up = w[11], &down = w[12];  // (experts, h, 2 * width), (experts, width, h)
  bool ok = act == 0 && d % 2 == 0 && top_k < 16 && gate_up.dim() == 3 && down.dim() == 3 &&
            gate_up.size(0) == down.size(0) && gate_up.size(0) > 0 && gate_up.size(2) == 2 * down.size(1) &&
            gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat;
  for (int i : {0, 3, 4}) ok = ok && float_vector(a[i]);
  for (int i : {1, 2, 6, 7, 9, 10, 13, 14}) ok = ok && float_vector(w[i]);
  ok = ok && (!w[15].defined() || (float_vector(w[15]) && w[15].numel() == 1));
  for (const Tensor& t : {a[1], a[2], a.size() == 6 ? a[5] : a[2], w[0], w[3], w[4], w[5], w[8]})
    ok = ok && t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu();
  if (!ok) return false;
  // the sizes agree: hidden h, heads and kv heads of d, the MLP's and the experts' widths
  const int64_t h = a[1].size(0);
  ok = h >= 16 && a[1].size(1) % d == 0 && a[2].size(1) % d == 0 && a[2].size(0) == h && a[0].numel() == h &&
       a[3].numel() == d && a[4].numel() == d && (a.size() == 5 || a[5].sizes() == a[2].sizes()) &&
       w[0].size(0) == a[1].size(1) && w[0].size(1) == h && w[3].size(0) == h && w[4].sizes() == w[3].sizes() &&
       w[5].size(0) == w[3].size(1) && w[5].size(1) == h && w[8].size(0) == h &&
       w[8].size(1) == gate_up.size(0) && w[9].numel() == w[8].size(1) && top_k <= w[8].size(1) &&
       gate_up.size(1) == h && down.size(2) == h;
  for (int i : {1, 2, 6, 7, 10, 13, 14}) ok = ok && w[i].numel() == h;
  return ok;
}

// -- a model's layers in one call --------------------------------------------------------------------------------
//
// `layer` from Python takes each layer's ~22 weights and ~17 numbers on every call, which the binding converts one by
// one: about 20 us a call on an AMD Zen 3 (one call for all six: the shipped model's AR step 1.07x). A LayerStack
// holds every layer's weights and sizes, handed over once per plan (model.py, `DiffusionGemma._layer_stack`), and
// `layers` runs them all in one call from what changes between passes: the same `layer` calls, so the same bits.
struct LayerStack : torch::CustomClassHolder {
  struct Entry {
    std::vector<Tensor> attention, after_decoder, after_encoder;
    int64_t head_dim, top_k, act;
    double eps, scale, root_size;
    bool gqa, sliding;
    // per mode (decoder, encoder): whether a few rows' layer may run in buffers (`rows_layer`) as far as the weights
    // tell
    std::array<bool, 2> in_buffers{false, false};
  };
  std::vector<Entry> entries;

  // The next layer: `layer`'s weights (the after-attention ones per mode) and sizes, and its kind.
  void add(std::vector<Tensor> attention, std::vector<Tensor> after_decoder, std::vector<Tensor> after_encoder,
           int64_t head_dim, double eps, bool gqa, double scale, int64_t top_k, double root_size, int64_t act,
           bool sliding) {
    TORCH_CHECK((attention.size() == 5 || attention.size() == 6) && after_decoder.size() == 16 &&
                    after_encoder.size() == 16,
                "LayerStack.add: 5 or 6 attention weights and 16 after attention per mode, not ", attention.size(),
                ", ", after_decoder.size(), " and ", after_encoder.size());
    Entry entry{std::move(attention), std::move(after_decoder), std::move(after_encoder), head_dim, top_k, act,
                eps, scale, root_size, gqa, sliding};
    for (int mode = 0; mode < 2; ++mode)
      entry.in_buffers[mode] =
          buffer_shapes(entry.attention, mode == 0 ? entry.after_decoder : entry.after_encoder, head_dim, top_k, act);
    entries.push_back(std::move(entry));
  }
  int64_t size() const { return static_cast<int64_t>(entries.size()); }
};

// -- a few rows' layer in buffers of its own ---------------------------------------------------------------------
//
// An AR step's layer (batch 1, one token) or a verification's (batch 1, a few tokens) is `layer`'s parts on a few rows,
// and most of its time outside the products went to the ~100 ATen tensors a layer made, viewed and freed between them
// (allocations, views, dispatch: a quarter of the shipped model's AR step on an AMD EPYC, session 47). `rows_layer`
// computes the same parts with the same code, the values between them in buffers of this thread: the norms' `rms_rows`,
// `rotate_row`, `gelu_tanh_times`, the router's softmax and top-k (`route`) and the experts' `slot_sums` in their
// loops, more rows' experts grouped as `experts` groups them (`buffer_experts`; these two since session 48); each
// product as `product` would (one row: `rows_kernel`'s own loops where it applies; else kernel_product_into or
// at::mm_out on views of the buffers, at::from_blob, whose parts start on 64 bytes as ATen's allocations do); ATen only
// for the attention (at::scaled_dot_product_attention over the joined cache, `join`) and, where the loops would not
// give their numbers, the router's at::softmax and at::topk, on views of the buffers with the sizes and strides `layer`
// hands them. It runs where the norms and the gated activation would take their loops in `layer` (checked before
// anything is written; `buffer_shapes` for the weights); elsewhere `layer` runs. The same bits either way
// (tests/test_layers_native.py: the AR steps and verification-sized passes of the both-sides tests run here where they
// can). The switches of the A/B measurements (bench/checkouts_ab.py --switch): `set_layers_in_buffers(false)` runs
// `layer`, `set_experts_in_buffers(false)` more rows' experts by `experts`.
constexpr int64_t kBufferRows = 8;  // the most rows rows_layer takes (a verification of 8 tokens)
std::atomic<bool> buffers_on{true};
std::atomic<bool> experts_in_buffers_on{true};  // off: more rows' experts by `experts`, on views of the buffers (A/Bs)
std::atomic<int64_t> buffer_layers_run{0};  // layers rows_layer ran (for the tests)

// x (m rows of k floats, unit stride, on 64 bytes) times weight_t (k, n) into y (m rows of n floats), as `product` (or
// `product_into`) computes it.
void buffer_product(const float* x, int64_t m, const Tensor& weight_t, float* y) {
  const int64_t k = weight_t.size(0), n = weight_t.size(1);
  if (m == 1 && rows_kernel_on.load(std::memory_order_relaxed) && row_product_shapes(weight_t) &&
      rows_order_holds(k, 1, 0)) {  // rows_kernel_applies for a row of unit stride, without a tensor of it
    const bool ahead = warming(1);
    const Tensor half = half_width_copy(weight_t);
    if (half.defined())
      half_rows_of(x, 1, k, half, k, n, (n + kHalfBlock - 1) / kHalfBlock, y, n, ahead);
    else
      float_rows(x, 1, k, weight_t.data_ptr<float>(), k, n, y, n, ahead);
    return;
  }
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const Tensor rows = at::from_blob(const_cast<float*>(x), {m, k}, options);
  Tensor out = at::from_blob(y, {m, n}, options);
  if (kernel_product_into(out, rows, weight_t)) return;
  warm(weight_t, m);
  at::mm_out(out, rows, weight_t);
}

// buffer_product of a tensor x (m, k) (the attention's output, as `layer` reshapes it).
void buffer_product(const Tensor& x, const Tensor& weight_t, float* y) {
  if (x.stride(1) == 1 && x.stride(0) == x.size(1) && reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 64 == 0) {
    buffer_product(x.data_ptr<float>(), x.size(0), weight_t, y);
    return;
  }
  const Tensor out = product(x, weight_t).contiguous();
  std::memcpy(y, out.data_ptr<float>(), sizeof(float) * out.numel());
}

// The floats of this thread's buffers (one tensor, so on ATen's 64 bytes), handed out in order (`take`), each part on
// 64 bytes, after `reset` for at least `total` (counting each part rounded up to 16 floats).
struct RowScratch {
  Tensor data;
  int64_t used = 0;
  void reset(int64_t total) {
    if (!data.defined() || data.numel() < total) data = at::empty({total}, at::TensorOptions().dtype(at::kFloat));
    used = 0;
  }
  float* take(int64_t n) {
    float* out = data.data_ptr<float>() + used;
    used += (n + 15) / 16 * 16;
    TORCH_CHECK(used <= data.numel(), "printpress_layers: rows_layer's scratch is too small");
    return out;
  }
};

// The router's softmax over the experts and top-k in loops (`route`), where they give at::softmax's and at::topk's
// numbers: the softmax as ATen computes it (aten_softmax.h; which exp, checked once per process against at::softmax on
// random rows of 1 to 128 experts: `router_form`), and the k largest in descending order by a selection, where they are
// unique: no NaN in the row and no two of its k + 1 largest equal (else at::topk may order equal ones its own way, and
// it runs).
int router_form() {
#ifdef PRINTPRESS_VEC
  static const int form = [] {
    for (int code : {2, 1}) {  // exp_u20 (torch's builds of late), Sleef's exp
      bool ok = true;
      printpress_sum::CheckNumbers numbers(0x2545f4914f6cdd1dull);
      for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 64, 128}) {
        const int64_t rows = 8;
        Tensor x = at::empty({rows, n}, at::TensorOptions().dtype(at::kFloat));
        float* data = x.data_ptr<float>();
        for (int64_t i = 0; i < rows * n; ++i) data[i] = static_cast<float>((numbers.unit() - 0.5) * 4.0 * (1 + i % 5));
        const Tensor expected = at::softmax(x, -1, at::kFloat);
        std::vector<float> got(rows * n);
        for (int64_t r = 0; r < rows; ++r)
          printpress_softmax_row::softmax_row(code, data + r * n, got.data() + r * n, n);
        ok = std::memcmp(expected.data_ptr<float>(), got.data(), sizeof(float) * rows * n) == 0;
        if (!ok) break;
      }
      if (ok) return code;
    }
    return 0;
  }();
  return form;
#else
  return 0;
#endif
}

// The router of t rows: `logits` (t rows of E) into the top_k experts `chosen` and their weights `slot_weight` (t rows
// of top_k), as `after_attention` has at::softmax, at::topk and route_weights make them; `probs` and `top`: room for
// t * E and t * top_k floats.
void route(const float* logits, int64_t t, int64_t E, int64_t top_k, const float* scale, float* probs, float* top,
           int64_t* chosen, float* slot_weight) {
  bool loops = false;
#ifdef PRINTPRESS_VEC
  if (const int form = router_form(); form != 0 && E <= 128) {
    loops = true;
    std::array<int64_t, 128> order;  // every entry written below
    for (int64_t r = 0; r < t && loops; ++r) {
      const float* row = logits + r * E;
      float* p = probs + r * E;
      printpress_softmax_row::softmax_row(form, row, p, E);
      for (int64_t i = 0; i < E; ++i) {
        loops = loops && !std::isnan(p[i]);
        order[i] = i;
      }
      // the k + 1 largest, in descending order, by selection
      const int64_t ranked = std::min(top_k + 1, E);
      for (int64_t j = 0; j < ranked && loops; ++j) {
        for (int64_t i = j + 1; i < E; ++i)
          if (p[order[i]] > p[order[j]]) std::swap(order[i], order[j]);
        if (j > 0 && !(p[order[j - 1]] > p[order[j]])) loops = false;  // two equal: at::topk's order decides
      }
      for (int64_t j = 0; j < top_k; ++j) {
        chosen[r * top_k + j] = order[j];
        top[r * top_k + j] = p[order[j]];
      }
    }
  }
#endif
  if (!loops) {
    const auto options = at::TensorOptions().dtype(at::kFloat);
    const Tensor p = at::softmax(at::from_blob(const_cast<float*>(logits), {t, E}, options), -1, at::kFloat);
    auto [values, indices] = at::topk(p, top_k, -1);
    const Tensor v = values.contiguous(), i = indices.contiguous();
    std::memcpy(top, v.data_ptr<float>(), sizeof(float) * t * top_k);
    std::memcpy(chosen, i.data_ptr<int64_t>(), sizeof(int64_t) * t * top_k);
  }
  route_rows(top, chosen, t, top_k, scale, slot_weight);
}

// The stable order of n expert choices (each pair's index, by expert, ties in index order) where at::sort gives it: its
// CPU sort of up to 16 keys is an insertion sort, so stable; more may come in another order of equal keys, and there
// at::sort itself gives the order. Whether at::sort of up to 16 keys is stable is checked once per process on random
// choices (every length, a few numbers of experts).
constexpr int64_t kStableSortKeys = 16;
bool small_sorts_stable() {
  static const bool stable = [] {
    printpress_sum::CheckNumbers numbers(0x9e3779b97f4a7c15ull);
    for (int64_t n = 2; n <= kStableSortKeys; ++n) {
      for (int64_t experts : {2, 3, 4, 8, 64}) {
        for (int draw = 0; draw < 8; ++draw) {
          Tensor keys = at::empty({n}, at::TensorOptions().dtype(at::kLong));
          int64_t* key = keys.data_ptr<int64_t>();
          for (int64_t i = 0; i < n; ++i) key[i] = static_cast<int64_t>(numbers.next() % experts);
          const Tensor order = std::get<1>(at::sort(keys)).contiguous();
          std::vector<int64_t> expected(n);
          std::iota(expected.begin(), expected.end(), 0);
          std::stable_sort(expected.begin(), expected.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
          if (std::memcmp(order.data_ptr<int64_t>(), expected.data(), sizeof(int64_t) * n) != 0) return false;
        }
      }
    }
    return true;
  }();
  return stable;
}

// Whether rows_layer may compute t rows' experts in buffers (`buffer_experts`, one row's in its own loop) with
// `experts`' bits: the gated activation's loop holds for the rows `experts` hands it at once (one row's slot; all
// t * top_k pairs' rows, every other half of a wider row) and the grouped products' rows lie contiguous (`grouped_mm`
// pads a row to 16 bytes).
bool experts_in_buffers_hold(int64_t t, int64_t top_k, int64_t expert, int64_t h) {
  if (t == 1) return gated_holds(1, expert, false);
  return expert % 2 == 0 && h % 4 == 0 && gated_holds(t * top_k, expert, false);
}

// `experts`' path for t > 1 rows (x: t rows of h floats) into `out` (t rows of h), with its tensors' layout in
// buffers: the pairs (token, slot) sorted by expert, their rows gathered, each expert's rows through its gated MLP
// (`product_into` on each group's rows, as `grouped_mm` runs them), and the slot-ordered weighted sum (`slot_sums`).
void buffer_experts(const float* x, int64_t t, int64_t h, const int64_t* choice, const float* slot_weight,
                    int64_t top_k, const Tensor& gate_up_proj, const Tensor& down_proj, int64_t expert,
                    RowScratch& scratch, float* out) {
  const int64_t pairs = t * top_k, experts_n = gate_up_proj.size(0);
  std::array<int64_t, kBufferRows * 16> order_of;  // the sorted pairs' indices; t <= kBufferRows, top_k < 16
  if (pairs <= kStableSortKeys && small_sorts_stable()) {
    int64_t next = 0;
    for (int64_t e = 0; e < experts_n; ++e)
      for (int64_t i = 0; i < pairs; ++i)
        if (choice[i] == e) order_of[next++] = i;
  } else {
    const Tensor choices = at::from_blob(const_cast<int64_t*>(choice), {pairs}, at::TensorOptions().dtype(at::kLong));
    const Tensor order = std::get<1>(at::sort(choices)).contiguous();
    std::memcpy(order_of.data(), order.data_ptr<int64_t>(), sizeof(int64_t) * pairs);
  }
  std::vector<int64_t> counts(experts_n, 0);
  for (int64_t i = 0; i < pairs; ++i) ++counts[choice[i]];
  float* gathered = scratch.take(pairs * h);
  float* gate_up = scratch.take(pairs * 2 * expert);
  float* activated = scratch.take(pairs * expert);
  float* rows_out = scratch.take(pairs * h);
  for (int64_t i = 0; i < pairs; ++i)
    std::memcpy(gathered + i * h, x + (order_of[i] / top_k) * h, sizeof(float) * h);
  int64_t start = 0;
  for (int64_t e = 0; e < experts_n; ++e) {
    if (counts[e] == 0) continue;
    buffer_product(gathered + start * h, counts[e], gate_up_proj.select(0, e), gate_up + start * 2 * expert);
    start += counts[e];
  }
  for (int64_t r = 0; r < pairs; ++r)  // the gated activation of all pairs' rows, each row its own run
    gelu_tanh_times(gate_up + r * 2 * expert, gate_up + r * 2 * expert + expert, expert, activated + r * expert);
  start = 0;
  for (int64_t e = 0; e < experts_n; ++e) {
    if (counts[e] == 0) continue;
    buffer_product(activated + start * expert, counts[e], down_proj.select(0, e), rows_out + start * h);
    start += counts[e];
  }
  std::array<int64_t, kBufferRows * 16> row_of;  // the sorted row of each (token, slot) pair
  for (int64_t i = 0; i < pairs; ++i) row_of[order_of[i]] = i;
  slot_sums(rows_out, h, row_of.data(), slot_weight, t, top_k, h, out);
}

// `layer` on t rows `x` (batch 1; t * h floats) into `out`, as described above; false (nothing computed or written)
// where it may not run in buffers (then `layer` runs).
bool rows_layer(const float* x, int64_t t, float* out, const LayerStack::Entry& e, bool encoder, const Tensor& cos,
                const Tensor& signed_sin, const Tensor& keys, const Tensor& values, const std::optional<Tensor>& mask,
                bool in_place, int64_t start, int64_t wrap, int64_t keep, int64_t write_at,
                const std::optional<Tensor>& slots) {
#ifdef PRINTPRESS_VEC
  const int mode = encoder ? 1 : 0;
  if (!buffers_on.load(std::memory_order_relaxed) || at::GradMode::is_enabled() || FusedNorms::width() == 0 ||
      !e.in_buffers[mode] || t < 1 || t > kBufferRows)
    return false;
  const std::vector<Tensor>& a = e.attention;
  const std::vector<Tensor>& w = mode == 0 ? e.after_decoder : e.after_encoder;
  const int64_t h = a[1].size(0), d = e.head_dim, heads = a[1].size(1) / d, kv_heads = a[2].size(1) / d;
  const int64_t inner = w[3].size(1), experts_n = w[8].size(1), expert = w[12].size(1), top_k = e.top_k;
  if (!float_vector(cos) || !float_vector(signed_sin) || cos.dim() != 4 || cos.sizes() != signed_sin.sizes() ||
      cos.size(0) != 1 || cos.size(1) != t || cos.size(2) != 1 || cos.size(3) != d ||
      keys.scalar_type() != at::kFloat || values.scalar_type() != at::kFloat || !gated_holds(t, inner, true) ||
      !slot_sums_hold() || !experts_in_buffers_hold(t, top_k, expert, h))
    return false;
  thread_local RowScratch scratch;
  // what the `take`s below and buffer_experts' hand out, each rounded up to 16 floats (30 of them)
  scratch.reset(t * ((10 + top_k) * h + (std::max(heads, kv_heads) + 2 * heads + 2 * kv_heads) * d + 3 * inner +
                     3 * expert + 2 * experts_n + top_k * (2 + 2 * h + 3 * expert)) + d + 30 * 16);
  const double eps = e.eps;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  // attention_inputs
  float* normed = scratch.take(t * h);
  rows_norm(x, t, h, eps, a[0].data_ptr<float>(), normed);
  float* projected = scratch.take(t * std::max(heads, kv_heads) * d);
  float* q = scratch.take(t * heads * d);
  float* k = scratch.take(t * kv_heads * d);
  float* v = scratch.take(t * kv_heads * d);
  float* scaled = scratch.take(d);
  const float *c = cos.data_ptr<float>(), *sn = signed_sin.data_ptr<float>();
  buffer_product(normed, t, a[1], projected);
  rows_norm_rotate(projected, t, t, heads, d, eps, a[3].data_ptr<float>(), c, sn, true, q, nullptr, scaled);
  buffer_product(normed, t, a[2], projected);
  rows_norm_rotate(projected, t, t, kv_heads, d, eps, a[4].data_ptr<float>(), c, sn, true, k,
                   a.size() == 5 ? v : nullptr, scaled);
  if (a.size() == 6) {
    buffer_product(normed, t, a[5], projected);
    rows_norm(projected, t * kv_heads, d, eps, nullptr, v);
  }
  // attend: q (1, heads, t, d) and the block's keys and values (1, kv_heads, t, d) as `layer` transposes them
  const Tensor q_view = at::from_blob(q, {1, heads, t, d}, {t * heads * d, d, heads * d, 1}, options);
  const Tensor k_view = at::from_blob(k, {1, kv_heads, t, d}, {t * kv_heads * d, d, kv_heads * d, 1}, options);
  const Tensor v_view = at::from_blob(v, {1, kv_heads, t, d}, {t * kv_heads * d, d, kv_heads * d, 1}, options);
  const Tensor joined_k = join(keys, k_view, in_place, start, wrap, keep, write_at, slots);
  const Tensor joined_v = join(values, v_view, in_place, start, wrap, keep, write_at, slots);
  float* attended_rows = scratch.take(t * heads * d);
  Tensor attended;  // ATen's, where the loops do not run
  if (!attention_in_loops(q_view, joined_k, joined_v, mask, e.scale, e.gqa, attended_rows))
    attended = at::scaled_dot_product_attention(q_view, joined_k, joined_v, mask, 0.0, false, e.scale, e.gqa)
                   .transpose(1, 2).reshape({t, -1});
  // after_attention
  float* o = scratch.take(t * h);
  float* x1 = scratch.take(t * h);
  if (attended.defined())
    buffer_product(attended, w[0], o);
  else
    buffer_product(attended_rows, t, w[0], o);
  rows_norm(o, t, h, eps, w[1].data_ptr<float>(), x1, x);
  float* pre = scratch.take(t * h);
  float* routed = scratch.take(t * h);
  float* pre2 = scratch.take(t * h);
  rows_shared_norm(x1, t, h, eps, w[2].data_ptr<float>(), w[7].data_ptr<float>(), e.root_size, w[10].data_ptr<float>(),
                   pre, routed, pre2);
  // the dense MLP: the gated activation over the rows as one run, as gated_loop takes two contiguous tensors
  float* gate = scratch.take(t * inner);
  float* up = scratch.take(t * inner);
  float* activated = scratch.take(t * inner);
  float* mlp = scratch.take(t * h);
  float* dense = scratch.take(t * h);
  buffer_product(pre, t, w[3], gate);
  buffer_product(pre, t, w[4], up);
  gelu_tanh_times(gate, up, t * inner, activated);
  buffer_product(activated, t, w[5], mlp);
  rows_norm(mlp, t, h, eps, w[6].data_ptr<float>(), dense);
  // the router and the experts
  float* router = scratch.take(t * experts_n);
  buffer_product(routed, t, w[8], router);
  std::array<int64_t, kBufferRows * 16> chosen;  // t <= kBufferRows, top_k < 16; written by `route`
  float* slot_weight = scratch.take(t * top_k);
  route(router, t, experts_n, top_k, w[9].data_ptr<float>(), scratch.take(t * experts_n), scratch.take(t * top_k),
        chosen.data(), slot_weight);
  float* sparse = scratch.take(t * h);
  float* gate_up = scratch.take(2 * expert);
  float* expert_act = scratch.take(expert);
  float* slot_rows = scratch.take(top_k * h);
  if (t == 1) {  // `experts`' one-row path: each chosen expert's row into its slot's row, then the weighted sum
    // (each expert's weights selected here, as `experts` selects them: a half-width copy is kept per view's version,
    // and views made once ahead carry a version of their own, so both would make and remake their copies)
    const int64_t* index = chosen.data();
    std::vector<int64_t> order(top_k);
    for (int64_t slot = 0; slot < top_k; ++slot) {
      order[slot] = slot;
      buffer_product(pre2, 1, w[11].select(0, index[slot]), gate_up);
      gelu_tanh_times(gate_up, gate_up + expert, expert, expert_act);
      buffer_product(expert_act, 1, w[12].select(0, index[slot]), slot_rows + slot * h);
    }
    slot_sums(slot_rows, h, order.data(), slot_weight, 1, top_k, h, sparse);
  } else if (experts_in_buffers_on.load(std::memory_order_relaxed)) {  // `experts`' path, laid out as its tensors are
    buffer_experts(pre2, t, h, chosen.data(), slot_weight, top_k, w[11], w[12], expert, scratch, sparse);
  } else {  // `set_experts_in_buffers(false)`: the A/B's other side
    const Tensor routed_out =
        experts(at::from_blob(pre2, {t, h}, options), at::from_blob(slot_weight, {t, top_k}, options),
                at::from_blob(chosen.data(), {t, top_k}, at::TensorOptions().dtype(at::kLong)), w[11], w[12], e.act)
            .contiguous();
    std::memcpy(sparse, routed_out.data_ptr<float>(), sizeof(float) * t * h);
  }
  float* mixed = scratch.take(t * h);
  rows_norm(sparse, t, h, eps, w[13].data_ptr<float>(), mixed, dense);
  rows_norm(mixed, t, h, eps, w[14].data_ptr<float>(), out, x1, w[15].defined() ? w[15].data_ptr<float>() : nullptr);
  buffer_layers_run.fetch_add(1, std::memory_order_relaxed);
  return true;
#else
  return false;
#endif
}

void set_layers_in_buffers(bool on) { buffers_on.store(on); }
void set_experts_in_buffers(bool on) { experts_in_buffers_on.store(on); }
int64_t layers_in_buffers() { return buffer_layers_run.load(); }

// A new tensor like x holding the first x.numel() floats of `buffer`.
Tensor from_buffer(const Tensor& buffer, const Tensor& x) {
  Tensor out = at::empty_like(x);
  std::memcpy(out.data_ptr<float>(), buffer.data_ptr<float>(), sizeof(float) * x.numel());
  return out;
}

// Every layer of `stack` in turn over x, as `layer` with each one's weights: the RoPE tables and mask of its kind
// (sliding or full), and its cache and join (KVJoin's fields, one per layer).
Tensor layers(const Tensor& x, c10::intrusive_ptr<LayerStack> stack, bool encoder, int64_t batch, int64_t length,
              const std::optional<Tensor>& sliding_cos, const std::optional<Tensor>& sliding_sin,
              const std::optional<Tensor>& full_cos, const std::optional<Tensor>& full_sin,
              const std::optional<Tensor>& sliding_mask, const std::optional<Tensor>& full_mask, at::TensorList keys,
              at::TensorList values, const c10::List<bool>& in_place, at::IntArrayRef start, at::IntArrayRef wrap,
              at::IntArrayRef keep, at::IntArrayRef write_at, const c10::List<std::optional<Tensor>>& slots) {
  const size_t n = stack->entries.size();
  TORCH_CHECK(keys.size() == n && values.size() == n && in_place.size() == n && start.size() == n &&
                  wrap.size() == n && keep.size() == n && write_at.size() == n && slots.size() == n,
              "printpress_layers.layers: one cache and join per layer (", n, ")");
  Tensor h = x;
  // a few rows of one batch row (an AR step, a verification): the layers that may run in buffers (`rows_layer`) pass
  // the rows between them in two buffers of this thread (tensors: on ATen's 64 bytes); a tensor is made of them
  // where a layer may not, and at the end
  const bool few_rows = batch == 1 && length <= kBufferRows && x.dim() == 2 && x.size(0) == length && fused(x);
  thread_local Tensor rows[2];
  int in_buffer = -1;  // which of `rows` holds h, if one does
  for (size_t i = 0; i < n; ++i) {
    const LayerStack::Entry& e = stack->entries[i];
    const auto& cos = e.sliding ? sliding_cos : full_cos;
    const auto& sin = e.sliding ? sliding_sin : full_sin;
    TORCH_CHECK(cos.has_value() && sin.has_value(), "printpress_layers.layers: no RoPE tables for layer ", i,
                "'s kind");
    if (few_rows) {
      const int to = in_buffer == 0 ? 1 : 0;
      if (!rows[to].defined() || rows[to].numel() < x.numel()) rows[to] = at::empty({x.numel()}, x.options());
      const float* from = in_buffer >= 0 ? rows[in_buffer].data_ptr<float>() : h.data_ptr<float>();
      if (rows_layer(from, length, rows[to].data_ptr<float>(), e, encoder, *cos, *sin, keys[i], values[i],
                     e.sliding ? sliding_mask : full_mask, in_place.get(i), start[i], wrap[i], keep[i], write_at[i],
                     slots.get(i))) {
        in_buffer = to;
        continue;
      }
      if (in_buffer >= 0) {
        h = from_buffer(rows[in_buffer], x);
        in_buffer = -1;
      }
    }
    h = layer(h, e.attention, encoder ? e.after_encoder : e.after_decoder, batch, length, e.head_dim, e.eps, *cos,
              *sin, keys[i], values[i], e.sliding ? sliding_mask : full_mask, in_place.get(i), start[i], wrap[i],
              keep[i], write_at[i], slots.get(i), e.gqa, e.scale, e.top_k, e.root_size, e.act);
  }
  if (in_buffer >= 0) h = from_buffer(rows[in_buffer], x);
  return h;
}

// SelfConditioning.forward with a previous step's signal `soft`: post_norm(embeds + MLP(pre_norm(soft))), the MLP's
// weights and the pre-norm's in `w` (pre_norm, gate, up, down); the post-norm has no weight.
Tensor self_conditioning(const Tensor& embeds, const Tensor& soft, at::TensorList w, double eps, int64_t code) {
  TORCH_CHECK(w.size() == 4, "printpress_layers.self_conditioning: 4 weights, not ", w.size());
  return norm(embeds + gated_mlp(norm(soft, w[0], eps), w[1], w[2], w[3], code), Tensor(), eps);
}

}  // namespace

// targets[i][:, :, starts[i] : starts[i] + counts[i]] = sources[i][:, :, offsets[i] : offsets[i] + counts[i]] for
// every i (a block's keys and values into each layer's cache, `KVCache.write_all`; a sliding ring's slots saved
// and put back around a verification, `KVCache.snapshot` / `truncate`): one call instead of two views
// and a copy per tensor from Python.
void write_rows(at::TensorList targets, at::TensorList sources, at::IntArrayRef starts, at::IntArrayRef offsets,
                at::IntArrayRef counts) {
  const auto n = targets.size();
  TORCH_CHECK(sources.size() == n && starts.size() == n && offsets.size() == n && counts.size() == n,
              "printpress_layers::write_rows takes as many sources, starts, offsets and counts as targets");
  for (size_t i = 0; i < n; ++i) {
    const auto& to = targets[i];
    const auto& from = sources[i];
    const int64_t count = counts[i];
    if (count == 0) continue;
    TORCH_CHECK(to.dim() == 4 && from.dim() == 4 && to.size(0) == from.size(0) && to.size(1) == from.size(1) &&
                    to.size(3) == from.size(3) && starts[i] >= 0 && starts[i] + count <= to.size(2) &&
                    offsets[i] >= 0 && offsets[i] + count <= from.size(2),
                "printpress_layers::write_rows: rows ", offsets[i], "..", offsets[i] + count, " of a ", from.sizes(),
                " block do not fit at ", starts[i], " of a ", to.sizes(), " cache");
    const int64_t D = to.size(3);
    const bool rows_contiguous = to.scalar_type() == from.scalar_type() && to.device().is_cpu() &&
                                 from.device().is_cpu() && to.stride(3) == 1 && from.stride(3) == 1 &&
                                 to.stride(2) == D && from.stride(2) == D;
    if (!rows_contiguous) {
      to.narrow(2, starts[i], count).copy_(from.narrow(2, offsets[i], count));
      continue;
    }
    // Each (batch, head) holds the block's rows as one run of count * D values in both: a memcpy each.
    const int64_t item = to.element_size(), bytes = count * D * item;
    char* to_base = static_cast<char*>(to.data_ptr()) + starts[i] * D * item;
    const char* from_base = static_cast<const char*>(from.data_ptr()) + offsets[i] * D * item;
    for (int64_t b = 0; b < to.size(0); ++b)
      for (int64_t h = 0; h < to.size(1); ++h)
        std::memcpy(to_base + (b * to.stride(0) + h * to.stride(1)) * item,
                    from_base + (b * from.stride(0) + h * from.stride(1)) * item, bytes);
  }
}

// DiffusionGemma._causal_mask (printpress/model.py): the additive mask (batch, 1, t, s) of a block of t tokens at
// positions length .. length + t - 1, with no padding anywhere, over the keys a layer reads: the cached ones, at the
// positions `keys` holds in the order attention reads them (undefined: 0 .. length - 1, a full layer's), then the
// block's own. 0 where a key is seen (not after the query and, where window > 0, less than `window` positions before
// it), -inf elsewhere, in `dtype`: one call in place of the dozen operators that build it from positions.
Tensor causal_mask(const std::optional<Tensor>& keys, int64_t length, int64_t t, int64_t window, int64_t batch,
                   at::ScalarType dtype) {
  TORCH_CHECK(length >= 0 && t >= 0 && batch >= 1, "printpress_layers::causal_mask: length ", length, ", t ", t,
              " and batch ", batch, " must be whole, with a batch of at least one row");
  Tensor cached = keys.has_value() ? keys->to(at::kLong).contiguous() : Tensor();
  const int64_t before = cached.defined() ? cached.numel() : length, s = before + t;
  Tensor mask = at::empty({t, s}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* key = cached.defined() ? cached.data_ptr<int64_t>() : nullptr;
  float* out = mask.data_ptr<float>();
  const float hidden = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t query = length + i;
    for (int64_t j = 0; j < s; ++j) {
      const int64_t position = j < before ? (key != nullptr ? key[j] : j) : length + (j - before);
      const int64_t distance = query - position;
      out[i * s + j] = distance >= 0 && (window <= 0 || distance < window) ? 0.0f : hidden;
    }
  }
  if (dtype != at::kFloat) mask = mask.to(dtype);
  return mask.expand({batch, 1, t, s});
}

// The width the one-loop norm found matching ATen's (16 or 8 lanes), or 0 where it computes norms with ATen's
// operators; whether the experts' weighted sums hold; and the norm itself (`rms_norm(x, weight, eps)`, the weight
// optional), for the tests.
int64_t fused_norm_width() { return FusedNorms::width(); }

bool fused_slot_sums() { return slot_sums_hold(); }

// For the tests: `product` of a few rows (the kernel where it applies, else at::mm); the kernel itself on a
// contiguous (n, k) weight, whether or not its order holds here (k a multiple of 4); and the (inner size, rows,
// outputs % 4) cases checked so far, and in how many the kernel's order held.
Tensor rows_product(const Tensor& x, const Tensor& weight_t) { return product(x, weight_t); }

Tensor rows_kernel_product(const Tensor& x, const Tensor& weight) {
  TORCH_CHECK(kRowsKernel, "printpress_layers.rows_kernel_product: no kernel on this CPU");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || kHalfRows,
              "printpress_layers.rows_kernel_product: no kernel for half-width weights on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kRowsMax && x.is_contiguous() &&
                  x.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) &&
                  weight.size(1) == x.size(1) && x.size(1) % 4 == 0 && x.size(1) >= 4,
              "printpress_layers.rows_kernel_product: 1-3 contiguous float32 rows and an (n, k) weight (float32, "
              "float16 or bfloat16), k a multiple of 4");
  Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  // (the kernel, whether or not its order holds here; a narrower weight read as it is, its tail widened)
  if (dtype == at::kFloat)
    rows_kernel(x, weight.t(), out);
  else
    rows_kernel(x, weight.to(at::kFloat).t(), out, false, blocked(weight));
  return out;
}

void set_rows_kernel(bool on) { rows_kernel_on.store(on); }

void set_half_width(bool on) { half_width_on.store(on); }

// Marks the storages of `weights` (an inference model's parameters) as ones whose weights may be read from half-width
// copies; returns how many storages are marked now (of tensors that live).
int64_t allow_half_width(const std::vector<Tensor>& weights) {
  std::lock_guard<std::mutex> lock(half_mutex);
  for (auto it = half_allowed.begin(); it != half_allowed.end();) {
    it = it->second.expired() ? half_allowed.erase(it) : std::next(it);
  }
  for (const Tensor& weight : weights) {
    if (weight.defined() && weight.has_storage() && weight.device().is_cpu())
      half_allowed.insert_or_assign(weight.storage().unsafeGetStorageImpl(), weight.storage().getWeakStorageImpl());
  }
  return static_cast<int64_t>(half_allowed.size());
}

// Whether this build has the half-width kernels (AVX-512, or AVX2 with F16C and FMA); what the many-row check found
// for inner size k and `rows` rows at the current thread count (1 held, 0 did not, -1 not checked yet).
bool half_width_kernels() { return kHalfRows; }

int64_t few_rows_verdict(int64_t k, int64_t rows, int64_t tail, bool plain) {
  std::lock_guard<std::mutex> lock(rows_mutex);
  const auto found = few_hold.find({k, rows, tail, plain, at::get_num_threads()});
  return found == few_hold.end() ? -1 : (found->second ? 1 : 0);
}

// For the tests: the half-width copies held now (of weights that live), as (float16 ones, bfloat16 ones, weights
// whose values fit neither).
std::tuple<int64_t, int64_t, int64_t> half_width_copies() {
  std::lock_guard<std::mutex> lock(half_mutex);
  int64_t counts[3] = {0, 0, 0};
  for (const auto& [key, entry] : half_widths) {
    if (entry.storage.expired()) continue;
    ++counts[!entry.copy.defined() ? 2 : entry.copy.scalar_type() == at::kHalf ? 0 : 1];
  }
  return {counts[0], counts[1], counts[2]};
}

// For the tests: how many copies were made so far (each weight's once, and again after it changed in place).
int64_t half_width_copies_made() { return half_widths_made.load(); }

// What the check found for inner size k, `rows` input rows and `tail` = outputs % 4 at the current thread count:
// 1 held, 0 did not, -1 not checked (yet).
int64_t rows_kernel_verdict(int64_t k, int64_t rows, int64_t tail) {
  std::lock_guard<std::mutex> lock(rows_mutex);
  const auto found = rows_hold.find({k, rows, tail, at::get_num_threads()});
  return found == rows_hold.end() ? -1 : (found->second ? 1 : 0);
}

std::tuple<int64_t, int64_t> rows_kernel_checks() {
  std::lock_guard<std::mutex> lock(rows_mutex);
  int64_t held = 0;
  for (const auto& entry : rows_hold) held += entry.second ? 1 : 0;
  return {static_cast<int64_t>(rows_hold.size()), held};
}

Tensor rms_norm(const Tensor& x, const std::optional<Tensor>& weight, double eps) {
  return norm(x, weight.value_or(Tensor()), eps);
}

// Whether reading weights ahead pays on this machine: 1-row products, then 32-row products, one per weight (every
// matrix of every layer, as an AR step and a canvas pass read them), cycled with and without `warm` in alternation,
// `rounds` times each after one cycle each to warm up (fewer rounds, at least one, where they would take over ~0.15 s:
// a large model); each kind turned on where its median cycle with it is faster. Vectors (norm weights, scalars) among
// `weights` are skipped. Returns the medians in seconds: (few rows without, with, many rows without, with).
std::vector<double> choose_warm(const std::vector<Tensor>& weights, int64_t rounds) {
  TORCH_CHECK(rounds >= 1, "printpress_layers.choose_warm: at least one round, not ", rounds);
  std::vector<Tensor> matrices;
  for (const Tensor& w : weights) {
    if (w.dim() < 2) continue;
    for (const Tensor& matrix : w.dim() == 3 ? w.unbind(0) : std::vector<Tensor>{w}) matrices.push_back(matrix);
  }
  std::vector<double> medians;
  for (const int64_t rows : {int64_t{1}, int64_t{32}}) {
    std::vector<Tensor> inputs;
    for (const Tensor& matrix : matrices) inputs.push_back(at::ones({rows, matrix.size(0)}, matrix.options()));
    std::atomic<bool>& flag = rows < kManyRows ? warm_few : warm_many;
    std::vector<double> times[2];
    int64_t wanted = rounds;
    for (int64_t round = 0; round < 1 + wanted; ++round) {
      for (int on = 0; on < 2; ++on) {
        flag.store(on == 1);
        const auto start = std::chrono::steady_clock::now();
        for (size_t i = 0; i < matrices.size(); ++i) product(inputs[i], matrices[i]);
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
        times[on].push_back(took.count());
      }
      if (round == 0) {  // it warmed up both; fewer rounds where a cycle is long
        wanted = std::min(wanted, std::max<int64_t>(1, static_cast<int64_t>(0.15 / (times[0][0] + times[1][0]))));
        times[0].clear();
        times[1].clear();
      }
    }
    for (auto& t : times) std::sort(t.begin(), t.end());
    const double without = times[0][times[0].size() / 2], with = times[1][times[1].size() / 2];
    flag.store(with < without);
    medians.push_back(without);
    medians.push_back(with);
  }
  return medians;
}

void set_warm(bool few, bool many) {
  warm_few.store(few);
  warm_many.store(many);
}

std::tuple<bool, bool> warm_enabled() { return {warm_few.load(), warm_many.load()}; }

TORCH_LIBRARY(printpress_layers, m) {
  m.def("write_rows(Tensor(a!)[] targets, Tensor[] sources, int[] starts, int[] offsets, int[] counts) -> ()",
        &Below<&write_rows>::op);
  m.def("choose_warm(Tensor[] weights, int rounds) -> float[]", &choose_warm);
  m.def("set_warm(bool few, bool many) -> ()", &set_warm);
  m.def("warm_enabled() -> (bool, bool)", &warm_enabled);
  m.def("head(Tensor x, Tensor weight, float cap=0.0) -> Tensor", &Below<&capped_head>::op);
  m.def("head_checks() -> (int, int)", &head_checks);
  m.def("product(Tensor x, Tensor weight_t) -> Tensor", &Below<&product>::op);
  m.def("rows_product(Tensor x, Tensor weight_t) -> Tensor", &rows_product);
  m.def("rows_kernel_product(Tensor x, Tensor weight) -> Tensor", &rows_kernel_product);
  m.def("rows_kernel_checks() -> (int, int)", &rows_kernel_checks);
  m.def("set_rows_kernel(bool on) -> ()", &set_rows_kernel);
  m.def("set_half_width(bool on) -> ()", &set_half_width);
  m.def("set_layers_in_buffers(bool on) -> ()", &set_layers_in_buffers);
  m.def("set_experts_in_buffers(bool on) -> ()", &set_experts_in_buffers);
  m.def("set_attention_in_loops(bool on) -> ()", [](bool on) { attention_loops_on.store(on); });
  m.def("attention_form() -> int", [] { return static_cast<int64_t>(attention_form()); });
  m.def("attention_loops(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool gqa, int form=-1) -> Tensor",
        &attention_loops_op);
  m.def("router_form() -> int", [] { return static_cast<int64_t>(router_form()); });
  m.def("layers_in_buffers() -> int", &layers_in_buffers);
  m.def("allow_half_width(Tensor[] weights) -> int", &allow_half_width);
  m.def("half_width_kernels() -> bool", &half_width_kernels);
  m.def("few_rows_verdict(int k, int rows, int tail, bool plain=False) -> int", &few_rows_verdict);
  m.def("half_width_copies() -> (int, int, int)", &half_width_copies);
  m.def("half_width_copies_made() -> int", &half_width_copies_made);
  m.def("rows_kernel_verdict(int k, int rows, int tail) -> int", &rows_kernel_verdict);
  m.def("fused_norm_width() -> int", &fused_norm_width);
  m.def("fused_slot_sums() -> bool", &fused_slot_sums);
  m.def("gated(Tensor gate, Tensor up, int act) -> Tensor", &gated);
  m.def("gated_fused(Tensor gate, Tensor up, int act) -> bool", &gated_fused);
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", &Below<&rms_norm>::op);
  m.def("causal_mask(Tensor? keys, int length, int t, int window, int batch, ScalarType dtype) -> Tensor",
        &causal_mask);
  m.def("attention_inputs(Tensor x, Tensor[] w, int batch, int length, int head_dim, float eps, Tensor cos, "
        "Tensor signed_sin) -> (Tensor, Tensor, Tensor)",
        &Below<&attention_inputs>::op);
  m.def("layer(Tensor x, Tensor[] attention_w, Tensor[] after_w, int batch, int length, int head_dim, float eps, "
        "Tensor cos, Tensor signed_sin, Tensor(a!) keys, Tensor(b!) values, Tensor? mask, bool in_place, int start, "
        "int wrap, int keep, int write_at, Tensor? slots, bool gqa, float scale, int top_k, float root_size, "
        "int act) -> Tensor",
        &Below<&layer>::op);
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("size", &LayerStack::size);
  m.def("layers(Tensor x, __torch__.torch.classes.printpress_layers.LayerStack stack, bool encoder, int batch, "
        "int length, Tensor? sliding_cos, Tensor? sliding_sin, Tensor? full_cos, Tensor? full_sin, "
        "Tensor? sliding_mask, Tensor? full_mask, Tensor(a!)[] keys, Tensor(b!)[] values, bool[] in_place, "
        "int[] start, int[] wrap, int[] keep, int[] write_at, Tensor?[] slots) -> Tensor",
        &Below<&layers>::op);
  m.def("self_conditioning(Tensor embeds, Tensor soft, Tensor[] w, float eps, int act) -> Tensor",
        &Below<&self_conditioning>::op);
  m.def("after_attention(Tensor x, Tensor attended, Tensor[] w, int top_k, float root_size, float eps, int act) "
        "-> Tensor",
        &Below<&after_attention>::op);
}
