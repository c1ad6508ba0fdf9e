// int8 weight-only linear for the CPU: y = x @ (w * scale)^T with x float32, w int8 (one scale per output channel).
//
// Loaded by printpress/quantize.py (torch.utils.cpp_extension.load, compiled once per machine, -O3 -march=native).
// The weights are packed at quantization time into blocks of 16 output channels, k-major: packed[b, k, j] is
// w[16 b + j, k]. A block is one contiguous stream of K x 16 bytes, so the kernel reads each weight byte once, in
// order (the point: a quarter of fp32's bytes for bandwidth-bound shapes), converts 16 of them to float per k and
// multiplies them into up to 6 rows of x at once (a 6 x 16 register tile, as BLAS micro-kernels do), so the
// conversion is shared by the rows and the same code serves an AR step (1 row) and a canvas (32 rows).
// The int8 -> float conversion is exact; the sums run in another order than the fp32 GEMM's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 16;  // output channels per packed block
constexpr int64_t PREFETCH = 4096;  // bytes ahead in the weight stream (a DRAM-bound step gains ~20%)

#if defined(__AVX2__) && defined(__FMA__)

inline __m256 widen(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// rows x 16 outputs of one block: acc[i] += x[i, k] * w[k, 0:16] over k, then scaled and stored. The
// accumulators are named variables, not an array: GCC stores an array of vectors to the stack on every iteration.
#define PRINTPRESS_ROW(i)                                                         \
  if constexpr (ROWS > i) {                                                       \
    const __m256 xi = _mm256_broadcast_ss(x + i * ldx + k);                       \
    lo##i = _mm256_fmadd_ps(xi, w_lo, lo##i);                                     \
    hi##i = _mm256_fmadd_ps(xi, w_hi, hi##i);                                     \
  }
#define PRINTPRESS_STORE(i)                                                       \
  if constexpr (ROWS > i) store(lo##i, hi##i, scale, y + i * ldy, width);

inline void store(__m256 lo, __m256 hi, const float* scale, float* y, int64_t width) {
  alignas(32) float out[BLOCK];
  _mm256_store_ps(out, _mm256_mul_ps(lo, _mm256_loadu_ps(scale)));
  _mm256_store_ps(out + 8, _mm256_mul_ps(hi, _mm256_loadu_ps(scale + 8)));
  std::copy(out, out + width, y);
}

template <int ROWS>
void tile(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scale, float* y, int64_t ldy,
          int64_t width) {
  __m256 lo0 = _mm256_setzero_ps(), lo1 = lo0, lo2 = lo0, lo3 = lo0, lo4 = lo0, lo5 = lo0;
  __m256 hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0, hi4 = lo0, hi5 = lo0;
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* wk = w + k * BLOCK;
    if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH), _MM_HINT_T0);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk));
    const __m256 w_lo = widen(bytes), w_hi = widen(_mm_unpackhi_epi64(bytes, bytes));
    PRINTPRESS_ROW(0) PRINTPRESS_ROW(1) PRINTPRESS_ROW(2) PRINTPRESS_ROW(3) PRINTPRESS_ROW(4) PRINTPRESS_ROW(5)
  }
  PRINTPRESS_STORE(0) PRINTPRESS_STORE(1) PRINTPRESS_STORE(2) PRINTPRESS_STORE(3) PRINTPRESS_STORE(4)
  PRINTPRESS_STORE(5)
}

// One row: two accumulator pairs, over even and odd k, so that each FMA does not wait for the one before.
template <>
void tile<1>(const float* x, int64_t, const int8_t* w, int64_t K, const float* scale, float* y, int64_t,
             int64_t width) {
  __m256 lo0 = _mm256_setzero_ps(), lo1 = lo0, hi0 = lo0, hi1 = lo0;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const int8_t* wk = w + k * BLOCK;
    _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH), _MM_HINT_T0);
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
    const __m128i even = _mm256_castsi256_si128(both), odd = _mm256_extracti128_si256(both, 1);
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    lo0 = _mm256_fmadd_ps(x0, widen(even), lo0);
    hi0 = _mm256_fmadd_ps(x0, widen(_mm_unpackhi_epi64(even, even)), hi0);
    lo1 = _mm256_fmadd_ps(x1, widen(odd), lo1);
    hi1 = _mm256_fmadd_ps(x1, widen(_mm_unpackhi_epi64(odd, odd)), hi1);
  }
  if (k < K) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * BLOCK));
    const __m256 xk = _mm256_broadcast_ss(x + k);
    lo0 = _mm256_fmadd_ps(xk, widen(bytes), lo0);
    hi0 = _mm256_fmadd_ps(xk, widen(_mm_unpackhi_epi64(bytes, bytes)), hi0);
  }
  store(_mm256_add_ps(lo0, lo1), _mm256_add_ps(hi0, hi1), scale, y, width);
}

constexpr int MAX_ROWS = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast: 15 of AVX2's 16 registers

#else  // portable C++: the compiler vectorises what it can

template <int ROWS>
void tile(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scale, float* y, int64_t ldy,
          int64_t width) {
  float acc[ROWS][BLOCK] = {};
  for (int64_t k = 0; k < K; ++k) {
    float wk[BLOCK];
    for (int64_t j = 0; j < BLOCK; ++j) wk[j] = static_cast<float>(w[k * BLOCK + j]);
    for (int i = 0; i < ROWS; ++i)
      for (int64_t j = 0; j < BLOCK; ++j) acc[i][j] += x[i * ldx + k] * wk[j];
  }
  for (int i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < width; ++j) y[i * ldy + j] = acc[i][j] * scale[j];
}

constexpr int MAX_ROWS = 4;

#endif

// The last rows of x (fewer than MAX_ROWS): the tile of that height.
template <int ROWS>
void last_rows(int64_t rows, const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N,
               int64_t width) {
  if constexpr (ROWS >= 1) {
    if (rows == ROWS) tile<ROWS>(x, K, w, K, scale, y, N, width);
    else last_rows<ROWS - 1>(rows, x, K, w, scale, y, N, width);
  }
}

void rows_of_block(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N,
                   int64_t width) {
  int64_t m = 0;
  for (; m + MAX_ROWS <= M; m += MAX_ROWS) tile<MAX_ROWS>(x + m * K, K, w, K, scale, y + m * N, N, width);
  last_rows<MAX_ROWS - 1>(M - m, x + m * K, K, w, scale, y + m * N, N, width);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8 linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == BLOCK,
              "int8 linear: packed weights must be int8 (blocks, in_features, 16)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == packed.size(0) * BLOCK,
              "int8 linear: one float32 scale per packed output channel");
  const int64_t K = packed.size(1), blocks = packed.size(0), N = out_features;
  TORCH_CHECK(x.size(-1) == K, "int8 linear: x has ", x.size(-1), " features, the weights ", K);
  TORCH_CHECK(0 < N && N <= blocks * BLOCK && N > (blocks - 1) * BLOCK, "int8 linear: bad out_features ", N);
  const at::Tensor xs = x.contiguous(), ws = packed.contiguous(), ss = scale.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t M = K ? xs.numel() / K : 0;
  if (M == 0) return y;
  const float* X = xs.data_ptr<float>();
  const int8_t* W = ws.data_ptr<int8_t>();
  const float* S = ss.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // A thread takes whole blocks; a block's K x 16 bytes stay in L1/L2 while every row of x passes over them.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * BLOCK * M));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t width = std::min(BLOCK, N - b * BLOCK);
      rows_of_block(X, M, K, W + b * K * BLOCK, S + b * BLOCK, Y + b * BLOCK, N, width);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(printpress_int8, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scale, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(printpress_int8, CPU, m) {
  m.impl("linear", &linear);
}
