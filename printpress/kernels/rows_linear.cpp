// A float32 linear for a few rows (y = x @ w^T, x: (M, K), w: (N, K), both row-major), for the opt-in compiled
// AR step (printpress/fast.py): an AR step multiplies one row by every weight matrix, so it is bound by reading
// the weights, and MKL's one-row GEMM reads them at 60-70% of the bandwidth a plain streaming loop reaches on
// this project's CPUs (docs/benchmarks.md §6, "Few-row linears"). Here four weight rows stream side by side through
// AVX2 FMAs, each weight read once from memory and reused from L1 for every row of x.
//
// `expert_rows` does the same for a few rows each through its own expert's weights, read in place.
//
// Not bit-exact to MKL (another summation order); only the compiled paths, which are not exact anyway, use it.
#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four output channels (w0..w3, K each) against one row x: out[0..3].
inline void four_dots(const float* x, const float* w0, const float* w1, const float* w2, const float* w3,
                      int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
  }
  float s0 = horizontal_sum(a0), s1 = horizontal_sum(a1), s2 = horizontal_sum(a2), s3 = horizontal_sum(a3);
  for (; k < K; ++k) {
    s0 += w0[k] * x[k];
    s1 += w1[k] * x[k];
    s2 += w2[k] * x[k];
    s3 += w3[k] * x[k];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

inline float one_dot(const float* x, const float* w, int64_t K) {
  __m256 a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
  float s = horizontal_sum(a);
  for (; k < K; ++k) s += w[k] * x[k];
  return s;
}

}  // namespace

static void rows_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  float four[4];
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    const float* w0 = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      four_dots(x + m * K, w0, w0 + K, w0 + 2 * K, w0 + 3 * K, K, four);
      for (int j = 0; j < 4; ++j) y[m * N + n + j] = four[j];
    }
  }
  for (; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = one_dot(x + m * K, w + n * K, K);
}

#else  // a portable loop where AVX2/FMA is missing (the compiler vectorises what it can)

static void rows_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += w[n * K + k] * x[m * K + k];
      y[m * N + n] = s;
    }
}

#endif

// x (M, K) float32, weight (N, K) float32 -> (M, N); any strides in, contiguous out. More than `max_rows` rows
// (a graph compiled for any batch size meets them) go to ATen's linear, MKL's GEMM, which is faster there.
torch::Tensor rows(const torch::Tensor& x, const torch::Tensor& weight, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "printpress_fast::rows_linear expects x (M, K) and weight (N, K)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "printpress_fast::rows_linear is float32 only");
  if (x.size(0) > max_rows) return at::linear(x, weight);
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = torch::empty({x.size(0), weight.size(0)}, x.options());
  rows_linear(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), x.size(0), weight.size(0),
              x.size(1));
  return y;
}

// Row r of x (R, K) through expert index[r] of weight (E, N, K) -> (R, N): what a gather of the chosen experts'
// weights followed by a batched product computes (the compiled AR step's experts), without copying the weights.
torch::Tensor expert_rows(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& index) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && index.dim() == 1 && x.size(0) == index.size(0) &&
                  x.size(1) == weight.size(2),
              "printpress_fast::expert_rows expects x (R, K), weight (E, N, K) and index (R,)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "printpress_fast::expert_rows is float32 only");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const auto ic = index.to(torch::kLong).contiguous();
  const int64_t R = x.size(0), E = weight.size(0), N = weight.size(1), K = weight.size(2);
  auto y = torch::empty({R, N}, x.options());
  const int64_t* chosen = ic.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(chosen[r] >= 0 && chosen[r] < E, "printpress_fast::expert_rows: expert ", chosen[r],
                " is not in [0, ", E, ")");
    rows_linear(xc.data_ptr<float>() + r * K, wc.data_ptr<float>() + chosen[r] * N * K,
                y.data_ptr<float>() + r * N, 1, N, K);
  }
  return y;
}

TORCH_LIBRARY(printpress_fast, m) {
  m.def("rows_linear(Tensor x, Tensor weight, int max_rows) -> Tensor");
  m.def("expert_rows(Tensor x, Tensor weight, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(printpress_fast, CPU, m) {
  m.impl("rows_linear", &rows);
  m.impl("expert_rows", &expert_rows);
}
