// ATen's CPU flash attention for float32 (at::scaled_dot_product_attention's kernel on a CPU), re-done for the few
// query rows of an exact pass without the tensors, the bool mask's conversion and the dispatch around it: an AR step's
// attention (1 query row, 3 heads, ~120 keys) 15 -> 12 us, a verification's (8 rows, a mask) 43 -> 31 us, on an AMD
// Zen 3; what is left is mostly MKL's two calls per head. Include aten_vec.h first.
//
// The same numbers as ATen's, because the same work in the same order: per (batch, query head, block of query rows)
// the scores are one sgemm call of the BLAS torch links (MKL), with the arguments ATen's cpublas::gemm hands it, into
// a buffer laid out (and aligned) as ATen's; the scale and the mask (a bool one as ATen turns it into an additive
// one: 0 where a key is seen, -inf where not), each row's maximum, its exponentials and their sum in ATen's vector
// order (at::vec), then the weighted sum of the values as a second sgemm call, and the division by the row's sum. Only
// one block of keys is taken (ATen splits the keys into blocks of 512, rescaling between them): longer rows of keys go
// to ATen. Which form of the kernel torch's build has (`Form`: ATen's exp_u20 or Sleef's, the scalar tail's exp in
// float or in double, the mask added in a fused multiply-add or not) is checked against ATen once per process and
// thread count by the user (layers.cpp, `attention_form`), which takes the one that matches, or ATen's call where none
// does.
#pragma once

#ifdef PRINTPRESS_VEC
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

// The BLAS torch links (MKL in the x86 wheels), which ATen's cpublas::gemm calls for float32. Weak: where torch's
// libraries do not export it, the library still loads, and ATen's attention runs (`blas_found`).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace printpress_attention {

inline bool blas_found() { return &sgemm_ != nullptr; }

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kKeyBlock = 512;  // ATen's keys per block below 768 query rows; longer rows of keys: ATen's call

// ATen's query rows per block: its kernel's three sizes by the number of query rows.
inline int64_t query_block(int64_t rows) { return rows >= 768 ? 256 : rows >= 192 ? 64 : 32; }

// C = op(A) B + beta C in column-major terms, as cpublas::gemm passes it on to the BLAS: a leading dimension that
// cannot matter (a single column or row) is first set to the one cpublas normalises it to.
inline void blas_gemm(bool transpose_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float beta, float* c, int64_t ldc) {
  if (n == 1) ldc = m;
  if (transpose_a) {
    if (m == 1) lda = k;
  } else if (k == 1) {
    lda = m;
  }
  if (n == 1) ldb = k;  // op(B) not transposed here
  const char ta = transpose_a ? 'T' : 'N', tb = 'N';
  const int m_ = static_cast<int>(m), n_ = static_cast<int>(n), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(lda), ldb_ = static_cast<int>(ldb), ldc_ = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm_(&ta, &tb, &m_, &n_, &k_, &one, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

// One operand's layout: element (b, h, row, 0) at data + b * batch + h * head + row * row; unit stride within a row.
struct Operand {
  const float* data;
  int64_t batch, head, row;
};

// A mask by strides (0 along a dimension it is broadcast in), bool (`seen`: mask[b, t, j] says query row t sees key
// j) or additive (`added`: mask[b, t, j] is added to the scaled score), or neither (no mask).
struct Mask {
  const bool* seen = nullptr;
  const float* added = nullptr;
  int64_t batch = 0, row = 0, key = 0;
};

// The forms of ATen's kernel: `u20` its exps' vector part by ATen's exp_u20 (else Sleef's exp), `tail_double` the
// elements past the last whole vector by the C library's double exp, rounded to float (else its float exp: the two
// differ rarely, on 15 of 720 random attentions of 1-5 tail elements a row in one check). The sum is in float.
struct Form {
  bool u20;
  bool tail_double;
  bool fused;  // a mask added to the scaled scores in one fused multiply-add (as ATen's kernels, built with
               // contraction, do); for masks of 0 and -inf the same numbers either way
};

template <bool U20>
inline Vec vec_exp(const Vec& x) {
  if constexpr (U20) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// row[i] <- exp(row[i] - max) for n elements; returns their sum, in ATen's order: whole vectors summed lane-wise and
// then across the lanes, then the tail one by one.
template <bool U20>
inline float exp_and_sum(float* row, int64_t n, float max, bool tail_double) {
  const Vec vmax(max);
  Vec lanes(0.0f);
  const int64_t whole = n - n % Vec::size();
  for (int64_t i = 0; i < whole; i += Vec::size()) {
    const Vec e = vec_exp<U20>(Vec::loadu(row + i) - vmax);
    lanes = lanes + e;
    e.store(row + i);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, lanes);
  for (int64_t i = whole; i < n; ++i) {
    const float x = row[i] - max;
    const float e = tail_double ? static_cast<float>(std::exp(static_cast<double>(x))) : std::exp(x);
    sum += e;
    row[i] = e;
  }
  return sum;
}

// The calling thread's scratch: a float tensor, so on 64 bytes as ATen's buffer is (MKL's results may depend on its
// operands' alignment), kept and grown as needed.
inline float* scratch(int64_t floats) {
  static thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < floats)
    buffer = at::empty({floats}, at::TensorOptions().dtype(at::kFloat));
  return buffer.data_ptr<float>();
}

// softmax(scale q k^T + mask) v for queries q (B, T, heads, D), keys and values (B, kv_heads, S, D), S <= kKeyBlock,
// query head h reading key head h / (heads / kv_heads); out: (B, T, heads, D), contiguous. A query row that sees no
// key gets zeros, as ATen's.
template <bool U20>
void attend(const Operand& q, const Operand& k, const Operand& v, const Mask& mask, int64_t B, int64_t T,
            int64_t heads, int64_t kv_heads, int64_t S, int64_t D, float scale, bool tail_double, bool fused,
            float* out) {
  const int64_t split = std::min(query_block(T), T);
  const int64_t slices = (T + split - 1) / split;
  const int64_t group = heads / kv_heads;
  // ATen's buffer, a part per thread: the scores (split x S), the rows' maxima and sums (split each), the output rows
  const int64_t per_thread = split * S + 2 * split + split * D;
  float* buffer = scratch(at::get_num_threads() * per_thread);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * heads * slices, 1, [&](int64_t begin, int64_t end) {
    float* scores = buffer + at::get_thread_num() * per_thread;
    float* sums = scores + split * S + split;
    float* dst = sums + split;
    for (int64_t z = begin; z < end; ++z) {
      const int64_t slice = z % slices, h = (z / slices) % heads, b = z / (slices * heads);
      const int64_t m = slice * split, rows = std::min(split, T - m);
      const float* qs = q.data + b * q.batch + h * q.head + m * q.row;
      const float* ks = k.data + b * k.batch + (h / group) * k.head;
      const float* vs = v.data + b * v.batch + (h / group) * v.head;
      blas_gemm(true, S, rows, D, ks, k.row, qs, q.row, 0.0f, scores, S);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * S;
        if (mask.seen != nullptr) {  // ATen turns it into an additive one first: 0 where seen, else -inf
          const bool* seen = mask.seen + b * mask.batch + (m + r) * mask.row;
          for (int64_t j = 0; j < S; ++j) row[j] = row[j] * scale + (seen[j * mask.key] ? 0.0f : minus_inf);
        } else if (mask.added != nullptr) {
          const float* added = mask.added + b * mask.batch + (m + r) * mask.row;
          if (fused)
            for (int64_t j = 0; j < S; ++j) row[j] = std::fma(row[j], scale, added[j * mask.key]);
          else
            for (int64_t j = 0; j < S; ++j) row[j] = row[j] * scale + added[j * mask.key];
        } else {
          const Vec vscale(scale);
          const int64_t whole = S - S % Vec::size();
          for (int64_t j = 0; j < whole; j += Vec::size()) (Vec::loadu(row + j) * vscale).store(row + j);
          for (int64_t j = whole; j < S; ++j) row[j] = row[j] * scale;
        }
        const float max = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row, S);
        if (max == minus_inf) {
          std::fill(row, row + S, 0.0f);
          sums[r] = 0.0f;
        } else {
          sums[r] = exp_and_sum<U20>(row, S, max, tail_double);
        }
      }
      blas_gemm(false, D, rows, S, vs, v.row, scores, S, 0.0f, dst, D);
      for (int64_t r = 0; r < rows; ++r) {
        const float reciprocal = 1 / (sums[r] == 0.0f ? 1.0f : sums[r]);
        at::vec::map([reciprocal](Vec x) { return x * Vec(reciprocal); }, out + ((b * T + m + r) * heads + h) * D,
                     dst + r * D, D);
      }
    }
  });
}

inline void attend(const Form& form, const Operand& q, const Operand& k, const Operand& v, const Mask& mask, int64_t B,
                   int64_t T, int64_t heads, int64_t kv_heads, int64_t S, int64_t D, float scale, float* out) {
  if (form.u20)
    attend<true>(q, k, v, mask, B, T, heads, kv_heads, S, D, scale, form.tail_double, form.fused, out);
  else
    attend<false>(q, k, v, mask, B, T, heads, kv_heads, S, D, scale, form.tail_double, form.fused, out);
}

}  // namespace printpress_attention
#endif
