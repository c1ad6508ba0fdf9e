// The exact sampler's softmax and entropy a row at a time (printpress/canvas.py, `probabilities_and_entropy`):
// ATen's bits, in cache, instead of ~14 operators each reading the whole canvas and allocating its result (0.25-0.29
// against 0.31-0.90 ms for 32 x 4096 on one thread, an Intel Xeon; with more threads ATen's operators are faster and
// run instead).
//
// What the sampler computes, as the reference does (torch.softmax, then Categorical's entropy):
//   probs = softmax(x);  lse = logsumexp(x);  lp = x - lse;  q = softmax(lp);  entropy = -sum(clamp(lp) * q)
// - softmax: ATen's over a last dimension is vec::reduce_all for the maximum, vec::map of exp(x - max), vec::reduce_all
//   for the sum and a product with its reciprocal; here the same functions of ATen's vector headers run, built for
//   the CPU capability ATen dispatches to on this machine (AVX-512 or AVX2, from the compiler's -march=native).
// - logsumexp: ATen's own operator, once for the rows (its exp is not one a header offers: presumably MKL's vector
//   exp, which torch's build links).
// - the difference, clamp and products: single roundings whatever computes them (the library is built with
//   -ffp-contract=off); the entropy's sum in ATen's order (aten_sum.h).
// Which exp ATen's softmax uses (Sleef's or exp_u20) and how many lanes its sums take depend on torch's build: the
// library tries each form once per process against ATen's operators on random rows (`form`), and the caller uses
// ATen's operators where none holds. Built only where ATen's AVX2 or AVX-512 vector code compiles.
#include "aten_vec.h"  // first: it picks the CPU capability of ATen's vector headers

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "aten_softmax.h"
#include "aten_sum.h"
#include "below_autograd.h"

namespace {

using at::Tensor;

#ifdef PRINTPRESS_VEC
using printpress_softmax_row::Exp;
using printpress_softmax_row::softmax_row;

template <Exp E>
void probs_and_entropy(const float* x, int64_t rows, int64_t n, int64_t free, const float* lse, int width,
                       float* probs, float* entropy) {
  for (int64_t r = 0; r < rows; ++r) softmax_row<E>(x + r * n, probs + r * n, n);
  std::vector<float> log_probs(n), q(n), products(n);
  const float lowest = std::numeric_limits<float>::lowest();
  for (int64_t r = 0; r < free; ++r) {
    const float* row = x + r * n;
    for (int64_t i = 0; i < n; ++i) log_probs[i] = row[i] - lse[r];
    softmax_row<E>(log_probs.data(), q.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const float clamped = log_probs[i] < lowest ? lowest : log_probs[i];
      products[i] = clamped * q[i];
    }
    entropy[r] = -printpress_sum::aten_sum(products.data(), n, width);
  }
}
#endif

// The sampler's numbers through ATen's operators (canvas.py's exact path), for the check.
std::tuple<Tensor, Tensor> with_aten(const Tensor& x, int64_t free) {
  Tensor probs = at::softmax(x, -1, at::kFloat);
  Tensor head = x.slice(0, 0, free);
  Tensor log_probs = head - at::logsumexp(head, {-1}, true);
  Tensor q = at::softmax(log_probs, -1);
  Tensor clamped = at::clamp(log_probs, std::numeric_limits<float>::lowest());
  return {probs, -(clamped * q).sum(-1)};
}

// A form of the one-pass numbers, coded 100 x the softmax's exp (1: Sleef's, 2: exp_u20) + the lanes of the sums (8 or
// 16): what ATen's build may do on an x86 CPU.
constexpr int64_t kForms[] = {108, 116, 208, 216};

// probs and entropy of x by form `code`, on one thread (a sum ATen may split between threads is not its);
// false for a form this build cannot run.
bool run(int64_t code, const Tensor& x, int64_t free, Tensor& probs, Tensor& entropy) {
#ifdef PRINTPRESS_VEC
  const int64_t e = code / 100;
  const int width = static_cast<int>(code % 100);
  if ((e != 1 && e != 2) || (width != 8 && width != 16)) return false;
  Tensor lse = at::logsumexp(x.slice(0, 0, free), {-1}, false).contiguous();
  const float* in = x.data_ptr<float>();
  float *p = probs.data_ptr<float>(), *h = entropy.data_ptr<float>();
  if (e == 1) {
    probs_and_entropy<Exp::sleef>(in, x.size(0), x.size(1), free, lse.data_ptr<float>(), width, p, h);
  } else {
    probs_and_entropy<Exp::u20>(in, x.size(0), x.size(1), free, lse.data_ptr<float>(), width, p, h);
  }
  return true;
#else
  return false;
#endif
}

// The form that gives ATen's bits on this machine, found once per process on random rows of several lengths (with
// tails, and -inf for banned tokens) against ATen's operators themselves; 0 where none does.
int64_t form() {
  static const int64_t chosen = [] {
    for (int64_t code : kForms) {
      bool ok = true;
      printpress_sum::CheckNumbers numbers(0x9e3779b97f4a7c15ull);
      for (int64_t n : {8, 37, 100, 1000, 4096, 4099}) {
        const int64_t rows = 5, free = 3;
        Tensor x = at::empty({rows, n}, at::TensorOptions().dtype(at::kFloat));
        float* data = x.data_ptr<float>();
        for (int64_t i = 0; i < rows * n; ++i) {
          data[i] = static_cast<float>((numbers.unit() - 0.5) * 12.0 * (1 + (i / n)));
          if (i % 97 == 5) data[i] = -std::numeric_limits<float>::infinity();  // banned tokens
        }
        auto [probs, entropy] = with_aten(x, free);
        Tensor got_probs = at::empty_like(x), got_entropy = at::empty({free}, x.options());
        ok = run(code, x, free, got_probs, got_entropy) &&
             std::memcmp(probs.data_ptr<float>(), got_probs.data_ptr<float>(), sizeof(float) * rows * n) == 0 &&
             std::memcmp(entropy.contiguous().data_ptr<float>(), got_entropy.data_ptr<float>(),
                         sizeof(float) * free) == 0;
        if (!ok) break;
      }
      if (ok) return code;
    }
    return int64_t(0);
  }();
  return chosen;
}

bool holds() { return form() != 0; }

// probs (rows, n) and the entropy (free,) of x (rows, n), with ATen's bits: the one-pass form where it holds, on one
// thread; ATen's operators elsewhere (with more threads they share the rows out, which the one-pass form, built
// without OpenMP to stay out of torch's runtime, does not: 0.17 against 0.27 ms at canvas 32 on two threads).
std::tuple<Tensor, Tensor> sampler_numbers(const Tensor& x, int64_t free) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "printpress_softmax.sampler_numbers: a contiguous float32 CPU matrix");
  TORCH_CHECK(0 <= free && free <= x.size(0), "printpress_softmax.sampler_numbers: free out of range");
  const int64_t code = form();
  if (code == 0 || at::get_num_threads() > 1) return with_aten(x, free);
  Tensor probs = at::empty_like(x), entropy = at::empty({free}, x.options());
  run(code, x, free, probs, entropy);
  return {probs, entropy};
}

}  // namespace

TORCH_LIBRARY(printpress_softmax, m) {
  m.def("holds() -> bool", &holds);
  m.def("form() -> int", &form);
  m.def("sampler_numbers(Tensor x, int free) -> (Tensor, Tensor)", &Below<&sampler_numbers>::op);
}
