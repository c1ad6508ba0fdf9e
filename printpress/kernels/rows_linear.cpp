// A float32 linear for a few rows (y = x @ w^T, x: (M, K), w: (N, K), both row-major), for the opt-in compiled
// passes (printpress/fast.py). An AR step multiplies one row by every weight matrix, so it is bound by reading
// the weights, and MKL's one-row GEMM reads them at 60-70% of the bandwidth a plain streaming loop reaches on
// this project's CPUs (docs/benchmarks.md §6, "Few-row linears"). Up to 4 rows, four weight rows stream side by
// side through AVX2 FMAs, each weight read once from memory and reused from L1 for every row of x; from 5 rows
// (a canvas of 8, a batch of AR steps) 3 x 4 register tiles keep the FMA units busy. Where the CPU has AVX-512,
// 2 to 64 rows (a speculative verification, a canvas of 32) go through a copy of the weight packed in panels
// instead (`panel_linear`).
//
// `expert_rows` does the same for a few rows each through its own expert's weights, read in place, and
// `routed_experts` runs a canvas's experts each on the tokens routed to it (float32, or bfloat16 where a CPU has
// native bf16 matmul: the weighted sum over experts is taken in float32 either way). `rows_linear_capped` makes a
// pass's logits with their softcap, and `small_attention` attends a block's queries over the cached keys and its
// own, both read in place. `amx_linear` (and `routed_experts_amx`) run a canvas's products on AMX tiles in bfloat16,
// an opt-in of the compiled passes (`weights="bfloat16"`) where the CPU has them.
//
// A helper for the Python around a compiled call (printpress/fast.py): `metadata_signature` stands for the
// parameters' dtypes, devices and sizes in the check before each call.
//
// Not bit-exact to MKL (another summation order); only the compiled paths, which are not exact anyway, use it.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "argmax.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight weights as float32: float32 as they are, bfloat16 widened exactly (its bits are a float32's upper half).
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The last k..K of four dot products whose vector parts summed to s0..s3, written to out[0..3].
template <typename W>
inline void four_tails(const float* x, const W* w0, const W* w1, const W* w2, const W* w3, int64_t k, int64_t K,
                       float s0, float s1, float s2, float s3, float* out) {
  for (; k < K; ++k) {
    s0 += static_cast<float>(w0[k]) * x[k];
    s1 += static_cast<float>(w1[k]) * x[k];
    s2 += static_cast<float>(w2[k]) * x[k];
    s3 += static_cast<float>(w3[k]) * x[k];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// Four output channels (w0..w3, K each) against one row x: out[0..3].
template <typename W>
inline void four_dots(const float* x, const W* w0, const W* w1, const W* w2, const W* w3, int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(load8(w0 + k), xv, a0);
    a1 = _mm256_fmadd_ps(load8(w1 + k), xv, a1);
    a2 = _mm256_fmadd_ps(load8(w2 + k), xv, a2);
    a3 = _mm256_fmadd_ps(load8(w3 + k), xv, a3);
  }
  float s0 = horizontal_sum(a0), s1 = horizontal_sum(a1), s2 = horizontal_sum(a2), s3 = horizontal_sum(a3);
  four_tails(x, w0, w1, w2, w3, k, K, s0, s1, s2, s3, out);
}

#if defined(__AVX512F__)
// bfloat16 weights on AVX-512: sixteen at a time (widening costs two instructions per vector, half as many here).
inline __m512 load16(const at::BFloat16* w) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <>
inline void four_dots(const float* x, const at::BFloat16* w0, const at::BFloat16* w1, const at::BFloat16* w2,
                      const at::BFloat16* w3, int64_t K, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    a0 = _mm512_fmadd_ps(load16(w0 + k), xv, a0);
    a1 = _mm512_fmadd_ps(load16(w1 + k), xv, a1);
    a2 = _mm512_fmadd_ps(load16(w2 + k), xv, a2);
    a3 = _mm512_fmadd_ps(load16(w3 + k), xv, a3);
  }
  float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1), s2 = _mm512_reduce_add_ps(a2),
        s3 = _mm512_reduce_add_ps(a3);
  four_tails(x, w0, w1, w2, w3, k, K, s0, s1, s2, s3, out);
}
#endif

template <typename W>
inline float one_dot(const float* x, const W* w, int64_t K) {
  __m256 a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a);
  float s = horizontal_sum(a);
  for (; k < K; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

// A tile of MR rows of x against NR weight rows, over K (a slice of both): acc[m][n] holds eight partial sums of
// x[m] . w[n] along k. Each step loads MR x vectors and NR weight vectors for MR * NR FMAs (3 x 4: 7 loads, 12
// FMAs, 16 registers), so the loop runs at the FMA units' rate from L1. `accumulate` adds to y (a later K slice).
template <int MR, int NR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K,
                 bool accumulate) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int n = 0; n < NR; ++n) {
      const __m256 wv = _mm256_loadu_ps(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float sums[4];
    if (NR == 4) {  // four horizontal sums at once
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[m][0], acc[m][1]),
                                          _mm256_hadd_ps(acc[m][2 % NR], acc[m][3 % NR]));
      _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
    } else {
      for (int n = 0; n < NR; ++n) sums[n] = horizontal_sum(acc[m][n]);
    }
    for (int n = 0; n < NR; ++n) {
      float s = sums[n];
      for (int64_t j = k; j < K; ++j) s += x[m * ldx + j] * w[n * ldw + j];
      y[m * ldy + n] = accumulate ? y[m * ldy + n] + s : s;
    }
  }
}

template <int MR>
inline void tile_rows(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t N,
                      int64_t K, bool accumulate) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) tile<MR, 4>(x, ldx, w + n * ldw, ldw, y + n, ldy, K, accumulate);
  switch (N - n) {
    case 3: tile<MR, 3>(x, ldx, w + n * ldw, ldw, y + n, ldy, K, accumulate); break;
    case 2: tile<MR, 2>(x, ldx, w + n * ldw, ldw, y + n, ldy, K, accumulate); break;
    case 1: tile<MR, 1>(x, ldx, w + n * ldw, ldw, y + n, ldy, K, accumulate); break;
    default: break;
  }
}

}  // namespace

// 5-8 rows (a canvas of 8, a batch of AR steps): 3 x 4 register tiles. The weight is read in blocks of 16 rows that
// stay in L1 while every row of x passes them; K is cut into slices of `kSlice` so that a block and the rows of x
// fit there too. y = x @ w^T, all row-major and contiguous.
static void tiled_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kSlice = 512, kBlock = 16;  // K per slice; weight rows per block
  for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
    const int64_t kc = std::min(kSlice, K - k0);
    const bool accumulate = k0 > 0;
    for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
      const int64_t nc = std::min(kBlock, N - n0);
      const float* wb = w + n0 * K + k0;
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) tile_rows<3>(x + m * K + k0, K, wb, K, y + m * N + n0, N, nc, kc, accumulate);
      if (M - m == 2) tile_rows<2>(x + m * K + k0, K, wb, K, y + m * N + n0, N, nc, kc, accumulate);
      if (M - m == 1) tile_rows<1>(x + m * K + k0, K, wb, K, y + m * N + n0, N, nc, kc, accumulate);
    }
  }
}

template <typename W>
static void rows_linear(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  float four[4];
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    const W* w0 = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      four_dots(x + m * K, w0, w0 + K, w0 + 2 * K, w0 + 3 * K, K, four);
      for (int j = 0; j < 4; ++j) y[m * N + n + j] = four[j];
    }
  }
  for (; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = one_dot(x + m * K, w + n * K, K);
}

#else  // a portable loop where AVX2/FMA is missing (the compiler vectorises what it can)

template <typename W>
static void rows_linear(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += static_cast<float>(w[n * K + k]) * x[m * K + k];
      y[m * N + n] = s;
    }
}

static void tiled_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  rows_linear(x, w, y, M, N, K);
}

#endif

// Up to this many rows the weights stream past each row (bound by reading them: an AR step); more rows run in
// register tiles (bound by the FMAs: a canvas, a prompt block). Where the CPU has AVX-512, every product of 2 rows
// or more goes through packed panels instead (`few_rows`).
constexpr int64_t kStreamRows = 4;

// -- bfloat16 copies of float32 weights (`rows_linear_bf16`, `expert_rows_bf16`) --------------------------------
// A compiled AR step is bound by reading its weights (docs/benchmarks.md §6); a bfloat16 copy is half the bytes.
// The products are then those of the weights rounded to bfloat16 (widened exactly, summed in float32 with the
// float32 rows of x): not the float32 model's numbers, so an opt-in (`compile_ar_step(model, weights="bfloat16")`).
// A weight's copy is made on its first use and kept, together with the weight itself (so that its memory cannot
// be another tensor's while the copy exists), until the weight changes in place (its version counter moves) or
// `forget_weight_copies()` drops every copy (the packed panels below too).

namespace {

enum class Kind { bf16, panels, amx, amx_transposed };
struct Copy {
  torch::Tensor source;
  int64_t version = -1;
  torch::Tensor copy;
};
std::mutex copies_mutex;
std::map<std::pair<const void*, Kind>, Copy> copies;  // by the weight's data pointer and the copy's kind

// The weight's copy of `kind`, made by `make` on first use and again once the weight changed.
template <typename Make>
torch::Tensor cached_copy(const torch::Tensor& w, Kind kind, Make make) {
  const int64_t version = w.is_inference() ? 0 : w._version();
  std::lock_guard<std::mutex> lock(copies_mutex);
  Copy& entry = copies[{w.data_ptr(), kind}];
  if (!entry.copy.defined() || entry.version != version || entry.source.sizes() != w.sizes() ||
      entry.source.strides() != w.strides()) {  // (a transposed view starts where its weight does)
    entry.source = w;
    entry.version = version;
    entry.copy = make(w);
  }
  return entry.copy;
}

torch::Tensor bf16_copy(const torch::Tensor& w) {
  return cached_copy(w, Kind::bf16, [](const torch::Tensor& t) { return t.to(torch::kBFloat16).contiguous(); });
}

}  // namespace

void forget_weight_copies() {
  std::lock_guard<std::mutex> lock(copies_mutex);
  copies.clear();
}

// -- exp on AVX-512, and the logits' softcap -------------------------------------------------------------------

#if defined(__AVX512F__)
namespace {

// exp of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (truncated below 1.3e-7
// relative), scaled by 2^n; inputs below -104 give 0 (or a subnormal), above 88.7 the largest it makes.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: n ln2_hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// 1 / d for 16 floats: the 14-bit estimate refined by one Newton step (within 2 ulp for finite d > 0), a few
// cycles where a division takes ~10 per vector.
inline __m512 reciprocal16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

}  // namespace
#endif

// y[m, 0 .. cols) = cap tanh(y / cap) for M rows ldy apart, in place: the logits' softcap, with tanh written through
// exp as the compiled graphs write it (tanh(z) = 1 - 2 / (exp(2z) + 1)); applied by the products that make the
// logits while their rows are still in cache.
static void softcap_rows(float* y, int64_t ldy, int64_t M, int64_t cols, float cap) {
  for (int64_t m = 0; m < M; ++m) {
    float* row = y + m * ldy;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 two_over_cap = _mm512_set1_ps(2.f / cap), cap_v = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f),
                 two = _mm512_set1_ps(2.f);
    for (; i < cols; i += 16) {
      const __mmask16 lanes = cols - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - i)) - 1);
      const __m512 e = exp16(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + i), two_over_cap));
      const __m512 t = _mm512_fnmadd_ps(two, reciprocal16(_mm512_add_ps(e, one)), one);
      _mm512_mask_storeu_ps(row + i, lanes, _mm512_mul_ps(t, cap_v));
    }
#endif
    for (; i < cols; ++i) row[i] = cap * std::tanh(row[i] / cap);
  }
}

// -- packed panels of float32 weights, for 2-64 rows on AVX-512 (`panel_linear`) --------------------------------
// From two rows on, a product is bound by the FMAs, not by reading the weight, and the dot-product kernels above
// spend much of it summing each output's vector across its lanes. Here a copy of the weight is packed once into
// panels of 32 output channels, (ceil(N / 32), K, 32): for each k, the 32 weights of a panel lie side by side, so
// every row of x is broadcast against two vectors of them, with MR rows x 32 channels of sums held in registers and
// no horizontal sums at all (the broadcast form of a GEMM micro-kernel). 1.4-2x the tiles above at 2-8 rows on the
// shipped model's shapes (its LM head at 8 rows: 228 -> 122 us), and 1.05-1.5x MKL's GEMM from 16 to 64 rows. The
// copy doubles the memory of the weights that meet such blocks (a compiled model's), and is dropped with the
// bfloat16 copies.

#if defined(__AVX512F__)
constexpr int64_t kPanel = 32;

namespace {

torch::Tensor pack_panels(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto panels = torch::zeros({P, K, kPanel}, w.options());
  const auto wc = w.contiguous();
  const float* from = wc.data_ptr<float>();
  float* to = panels.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) to[((n / kPanel) * K + k) * kPanel + n % kPanel] = from[n * K + k];
  return panels;
}

// MR rows of x (K each, contiguous) against one panel (K, 32): y[m, 0 .. cols - 1], rows ldy apart.
template <int MR>
inline void panel_tile(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t cols) {
  __m512 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = _mm512_setzero_ps(), hi[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel), w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * K + k]);
      lo[m] = _mm512_fmadd_ps(xm, w0, lo[m]);
      hi[m] = _mm512_fmadd_ps(xm, w1, hi[m]);
    }
  }
  const __mmask16 lo_mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi_mask = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(y + m * ldy, lo_mask, lo[m]);
    _mm512_mask_storeu_ps(y + m * ldy + 16, hi_mask, hi[m]);
  }
}

}  // namespace

// y (M, N) = x (M, K) @ w (N, K)^T through w's packed panels; x and y row-major and contiguous. Each panel (K x 32
// weights: 24 KiB at K = 192) is read once and passes every row of x in blocks of 8, so more rows do not read the
// weight again. True where this CPU runs them (AVX-512), else false and nothing written.
static bool panel_linear(const float* x, const torch::Tensor& w, float* y, int64_t M, int64_t N, int64_t K,
                         float cap) {
  const auto panels = cached_copy(w, Kind::panels, pack_panels);
  const float* packed = panels.data_ptr<float>();
  for (int64_t n = 0; n < N; n += kPanel) {
    const float* panel = packed + n * K;
    const int64_t cols = std::min(kPanel, N - n);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) panel_tile<8>(x + m * K, K, panel, y + m * N + n, N, cols);
    switch (M - m) {
      case 7: panel_tile<7>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      case 6: panel_tile<6>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      case 5: panel_tile<5>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      case 4: panel_tile<4>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      case 3: panel_tile<3>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      case 2: panel_tile<2>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      case 1: panel_tile<1>(x + m * K, K, panel, y + m * N + n, N, cols); break;
      default: break;
    }
    if (cap > 0.f) softcap_rows(y + n, N, M, cols, cap);  // the panel's columns, still in L1
  }
  return true;
}
constexpr bool kPanels = true;
#else
static bool panel_linear(const float*, const torch::Tensor&, float*, int64_t, int64_t, int64_t, float) {
  return false;
}
constexpr bool kPanels = false;
#endif

// Whether products of 2 rows or more go through packed panels on this CPU (printpress/fast.py hands the kernel up
// to 64 rows then, 8 otherwise).
bool packed_panels() { return kPanels; }

// A float32 product of a few rows by printpress's kernels: one row streams the weight past it (an AR step: bound
// by reading the weight), more go through the packed panels where the CPU has AVX-512, else register tiles (or,
// up to kStreamRows, the stream). x and y row-major and contiguous; w (N, K) the weight itself, in any layout (its
// panels are cached by it, so never a temporary copy of it).
static void few_rows(const float* x, const torch::Tensor& w, float* y, int64_t M, float cap = 0.f) {
  const int64_t N = w.size(0), K = w.size(1);
  if (M >= 2 && panel_linear(x, w, y, M, N, K, cap)) return;
  (M <= kStreamRows ? rows_linear<float> : tiled_linear)(x, w.contiguous().data_ptr<float>(), y, M, N, K);
  if (cap > 0.f) softcap_rows(y, N, M, N, cap);
}

// -- AMX: bfloat16 tiles for products of 16 rows or more (`amx_linear`, opt-in) ---------------------------------
// A canvas's products (32 rows and more) are bound by the multiply-adds, where a CPU with AMX multiplies bfloat16
// tiles many times faster than float32 FMAs: on the shipped model's shapes, 3-7x the packed panels above. The
// weight's copy is packed once for the tiles (`Kind::amx`: blocks of 16 output channels x 32 inputs, each pair of
// inputs side by side, as `_tile_dpbf16ps` reads them) and x is rounded to bfloat16 on the way in; the sums are
// float32. Not the float32 model's numbers (both factors rounded to bfloat16), so only the opt-in
// `weights="bfloat16"` of the compiled passes uses it. Linux asks a process to request the tiles' state first.

constexpr int64_t kAmxRows = 32, kAmxColumns = 32, kAmxDepth = 32;  // a block: 2 x 2 tiles of 16 x 16 sums
constexpr int64_t kAmxMinRows = 16;  // fewer rows: the packed panels (a block's rows are padded to 32)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use the tiles: asked of the kernel once (ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// The weight (N, K), any strides, as (N / 16, K / 32) blocks of 16 rows of 32 bfloat16: row r of a block holds,
// for each of its 16 output channels n, the weights of inputs 2r and 2r + 1.
torch::Tensor amx_pack(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  auto packed = torch::empty({N / 16, K / kAmxDepth, 16, 32}, torch::TensorOptions().dtype(torch::kBFloat16));
  const auto source = w.to(torch::kBFloat16);  // rounded to nearest even, as x is below
  const auto s = source.accessor<at::BFloat16, 2>();
  at::BFloat16* out = packed.data_ptr<at::BFloat16>();
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < K / kAmxDepth; ++kb)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t n = 0; n < 16; ++n) {
          *out++ = s[nb * 16 + n][kb * kAmxDepth + 2 * r];
          *out++ = s[nb * 16 + n][kb * kAmxDepth + 2 * r + 1];
        }
  return packed;
}

__attribute__((target("avx512f,avx512bf16"))) void round_to_bf16(const float* x, at::BFloat16* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = at::BFloat16(x[i]);
}

// y (M, N), N apart = x (M, K) @ w^T through the tiles, capped (`softcap_rows`) block by block when cap > 0.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
void amx_product(const float* x, const torch::Tensor& w, float* y, int64_t M, int64_t N, int64_t K, float cap) {
  const bool transposed = w.stride(0) == 1 && w.size(1) > 1;  // a view such as E.t(): its own copy
  const auto packed = cached_copy(w, transposed ? Kind::amx_transposed : Kind::amx, amx_pack);
  const int64_t padded = (M + kAmxRows - 1) / kAmxRows * kAmxRows, depth = K / kAmxDepth;
  auto rounded = torch::empty({padded, K}, torch::TensorOptions().dtype(torch::kBFloat16));
  at::BFloat16* xb = rounded.data_ptr<at::BFloat16>();
  round_to_bf16(x, xb, M * K);
  std::memset(static_cast<void*>(xb + M * K), 0, (padded - M) * K * sizeof(at::BFloat16));
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
  const char* a = reinterpret_cast<const char*>(xb);
  const char* b = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  alignas(64) float last[kAmxRows * kAmxColumns];  // the last block's sums where x has fewer rows than it
  for (int64_t mb = 0; mb < padded; mb += kAmxRows) {
    const int64_t rows = std::min(kAmxRows, M - mb);
    for (int64_t nb = 0; nb < N; nb += kAmxColumns) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const char* b0 = b + (nb / 16) * depth * 1024;
      const char* b1 = b0 + depth * 1024;
      for (int64_t kb = 0; kb < depth; ++kb) {
        _tile_loadd(4, a + (mb * K + kb * kAmxDepth) * 2, K * 2);
        _tile_loadd(5, a + ((mb + 16) * K + kb * kAmxDepth) * 2, K * 2);
        _tile_loadd(6, b0 + kb * 1024, 64);
        _tile_loadd(7, b1 + kb * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = rows == kAmxRows ? y + mb * N + nb : last;
      const int64_t ld = rows == kAmxRows ? N : kAmxColumns;
      _tile_stored(0, out, ld * 4);
      _tile_stored(1, out + 16, ld * 4);
      _tile_stored(2, out + 16 * ld, ld * 4);
      _tile_stored(3, out + 16 * ld + 16, ld * 4);
      if (rows < kAmxRows)
        for (int64_t m = 0; m < rows; ++m) std::memcpy(y + (mb + m) * N + nb, last + m * kAmxColumns, 4 * kAmxColumns);
      if (cap > 0.f) softcap_rows(y + mb * N + nb, N, rows, kAmxColumns, cap);
    }
  }
  _tile_release();
}

}  // namespace
#else
namespace {
bool amx_ready() { return false; }
void amx_product(const float*, const torch::Tensor&, float*, int64_t, int64_t, int64_t, float) {}
}  // namespace
#endif

// Whether `amx_linear` runs here: the kernel was built for a CPU with AMX and the process may use the tiles.
bool amx_available() { return amx_ready(); }

// Whether a product of these sizes goes through the tiles: AMX here, the sizes whole blocks of channels and inputs.
static bool amx_fits(int64_t N, int64_t K) { return amx_ready() && N % kAmxColumns == 0 && K % kAmxDepth == 0; }

// Both float32 (the `bf16` ops read the weight's bfloat16 copy, made from the float32 weight); `op` names the op.
static void check_float(const char* op, const torch::Tensor& x, const torch::Tensor& weight, bool bf16) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "printpress_fast::", op,
              bf16 ? " takes float32 x and weight (it reads the weight's bfloat16 copy)" : " is float32 only");
}

// x (M, K) float32, weight (N, K) float32 -> (M, N); any strides in, contiguous out. More than `max_rows` rows
// (a graph compiled for any batch size meets them) go to ATen's linear, MKL's GEMM, which is faster there. With
// `bf16` the weight's bfloat16 copy streams past every row instead (meant for the few rows of an AR step).
static torch::Tensor linear_rows(const char* op, const torch::Tensor& x, const torch::Tensor& weight,
                                 int64_t max_rows, bool bf16, float cap = 0.f) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "printpress_fast::", op,
              " expects x (M, K) and weight (N, K)");
  check_float(op, x, weight, bf16);
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  if (!bf16 && M > max_rows) {
    auto y = at::linear(x, weight).contiguous();
    if (cap > 0.f) softcap_rows(y.data_ptr<float>(), N, M, N, cap);
    return y;
  }
  const auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (bf16) {
    rows_linear(xc.data_ptr<float>(), bf16_copy(weight).data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, N, K);
  } else {
    few_rows(xc.data_ptr<float>(), weight, y.data_ptr<float>(), M, cap);
  }
  return y;
}

torch::Tensor rows(const torch::Tensor& x, const torch::Tensor& weight, int64_t max_rows) {
  return linear_rows("rows_linear", x, weight, max_rows, false);
}

// The logits of a compiled pass: x @ weight^T, then cap tanh(. / cap) applied to each part of the product as it is
// made (`softcap_rows`), where inductor's graph ran the softcap as a pass of its own over the whole (M, vocab).
torch::Tensor rows_capped(const torch::Tensor& x, const torch::Tensor& weight, double cap, int64_t max_rows) {
  TORCH_CHECK(cap > 0, "printpress_fast::rows_linear_capped takes a positive cap, not ", cap);
  return linear_rows("rows_linear_capped", x, weight, max_rows, false, static_cast<float>(cap));
}

// x (M, K) @ weight^T through AMX tiles, both rounded to bfloat16, summed in float32 -> (M, N) float32, then
// cap tanh(. / cap) when cap > 0 (a pass's logits). weight (N, K) in any layout: a transposed view (E.t(), for
// probabilities @ E) has a copy of its own. N and K whole multiples of 32. Fewer than `kAmxMinRows` rows (a graph
// compiled for any number of rows meets them: a verification of a few tokens) take the float32 kernels instead,
// as `rows_linear` (or `rows_linear_capped`) would.
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& weight, double cap) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "printpress_fast::amx_linear expects x (M, K) and weight (N, K)");
  check_float("amx_linear", x, weight, true);
  TORCH_CHECK(amx_ready(), "printpress_fast::amx_linear needs a CPU with AMX (amx_bf16) that the kernel was built "
              "for, and Linux's permission to use the tiles");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  TORCH_CHECK(amx_fits(N, K), "printpress_fast::amx_linear takes whole multiples of 32 output channels and inputs, "
              "not ", N, " x ", K);
  TORCH_CHECK(cap >= 0, "printpress_fast::amx_linear takes a cap of 0 (none) or more, not ", cap);
  if (M < kAmxMinRows) return linear_rows("amx_linear", x, weight, kAmxMinRows, false, static_cast<float>(cap));
  const auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  amx_product(xc.data_ptr<float>(), weight, y.data_ptr<float>(), M, N, K, static_cast<float>(cap));
  return y;
}

torch::Tensor rows_bf16(const torch::Tensor& x, const torch::Tensor& weight) {
  return linear_rows("rows_linear_bf16", x, weight, 0, true);
}

// Row r of x (R, K) through expert index[r] of weight (E, N, K) -> (R, N): what a gather of the chosen experts'
// weights followed by a batched product computes (the compiled AR step's experts), without copying the weights
// (`bf16`: through the experts' bfloat16 copy).
template <typename W>
static void each_row_through_its_expert(const float* x, const W* w, const int64_t* chosen, float* y, int64_t R,
                                        int64_t E, int64_t N, int64_t K, const char* op) {
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(chosen[r] >= 0 && chosen[r] < E, "printpress_fast::", op, ": expert ", chosen[r], " is not in [0, ",
                E, ")");
    rows_linear(x + r * K, w + chosen[r] * N * K, y + r * N, 1, N, K);
  }
}

static torch::Tensor chosen_experts(const char* op, const torch::Tensor& x, const torch::Tensor& weight,
                                    const torch::Tensor& index, bool bf16) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && index.dim() == 1 && x.size(0) == index.size(0) &&
                  x.size(1) == weight.size(2),
              "printpress_fast::", op, " expects x (R, K), weight (E, N, K) and index (R,)");
  check_float(op, x, weight, bf16);
  const auto xc = x.contiguous();
  const auto ic = index.to(torch::kLong).contiguous();
  const int64_t R = x.size(0), E = weight.size(0), N = weight.size(1), K = weight.size(2);
  auto y = torch::empty({R, N}, x.options());
  if (bf16) {
    each_row_through_its_expert(xc.data_ptr<float>(), bf16_copy(weight).data_ptr<at::BFloat16>(),
                                ic.data_ptr<int64_t>(), y.data_ptr<float>(), R, E, N, K, op);
  } else {
    each_row_through_its_expert(xc.data_ptr<float>(), weight.contiguous().data_ptr<float>(), ic.data_ptr<int64_t>(),
                                y.data_ptr<float>(), R, E, N, K, op);
  }
  return y;
}

torch::Tensor expert_rows(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& index) {
  return chosen_experts("expert_rows", x, weight, index, false);
}

torch::Tensor expert_rows_bf16(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& index) {
  return chosen_experts("expert_rows_bf16", x, weight, index, true);
}

// hidden (P, I) = GELU(gate) * up for the rows of both (P, 2I) = [gate | up], GELU in its tanh form written through
// exp as the compiled graphs' fused kernels write it: x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
// One pass, 16 at a time, where ATen's GELU alone took 20 us on a canvas's 64 x 192. False (nothing written)
// where the CPU lacks AVX-512.
static bool gelu_tanh_times_up(const float* both, float* hidden, int64_t P, int64_t I) {
#if defined(__AVX512F__)
  const __m512 c1 = _mm512_set1_ps(-2.f * 0.7978845608f), c3 = _mm512_set1_ps(-2.f * 0.7978845608f * 0.044715f);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t place = 0; place < P; ++place) {
    const float* gate = both + place * 2 * I;
    const float* up = gate + I;
    float* out = hidden + place * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 lanes = I - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (I - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, gate + i);
      const __m512 minus_2u = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), c3, c1));
      const __m512 gelu = _mm512_mul_ps(x, reciprocal16(_mm512_add_ps(one, exp16(minus_2u))));
      _mm512_mask_storeu_ps(out + i, lanes, _mm512_mul_ps(gelu, _mm512_maskz_loadu_ps(lanes, up + i)));
    }
  }
  return true;
#else
  (void)both, (void)hidden, (void)P, (void)I;
  return false;
#endif
}

// y[first .. first + n) = x[first .. first + n) @ w^T for one expert's rows of x (P, K) and y (P, N), both row-major
// and contiguous: printpress's kernels up to `max_rows` rows of float32 (where they beat MKL's GEMM, as in `rows`),
// MKL's GEMM otherwise, and with `amx` an expert of `kAmxMinRows` rows or more through the tiles; nothing for an
// expert without rows.
static void expert_block(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y, int64_t first, int64_t n,
                         int64_t max_rows, bool amx = false) {
  if (n == 0) return;
  if (amx && x.scalar_type() == torch::kFloat && n >= kAmxMinRows && amx_fits(w.size(0), w.size(1))) {
    amx_product(x.data_ptr<float>() + first * x.size(1), w, y.data_ptr<float>() + first * y.size(1), n, w.size(0),
                w.size(1), 0.f);
  } else if (x.scalar_type() == torch::kFloat && n <= max_rows) {
    few_rows(x.data_ptr<float>() + first * x.size(1), w, y.data_ptr<float>() + first * y.size(1), n);
  } else {
    auto rows = y.narrow(0, first, n);
    at::mm_out(rows, x.narrow(0, first, n), w.t());
  }
}

// `routed_experts` in float32 with its bookkeeping in plain loops: the rows gathered by memcpy, the gate's
// activation times up and the weighted sum over each token's experts written out, where ATen's index_select, mul,
// zeros and index_add_ cost a verification of 8 tokens ~0.07 ms a layer in calls. The activation stays ATen's
// (vectorised). The general path's sums in its order (the weighted adds may round once, as fused multiply-adds).
static torch::Tensor routed_float(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& wg,
                                  const torch::Tensor& wd, const std::vector<int64_t>& first,
                                  const torch::Tensor& pair_index, const torch::Tensor& token_index,
                                  int64_t activation, int64_t max_rows, bool amx) {
  const int64_t T = x.size(0), H = x.size(1), E = wg.size(0), I = wd.size(2), P = pair_index.size(0);
  const int64_t* pair_at = pair_index.data_ptr<int64_t>();
  const int64_t* token_at = token_index.data_ptr<int64_t>();
  auto gathered = torch::empty({P, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* gp = gathered.data_ptr<float>();
  for (int64_t place = 0; place < P; ++place) std::memcpy(gp + place * H, xp + token_at[place] * H, H * sizeof(float));
  auto both = torch::empty({P, 2 * I}, x.options());
  for (int64_t e = 0; e < E; ++e) expert_block(gathered, wg[e], both, first[e], first[e + 1] - first[e], max_rows, amx);
  const auto gate = both.narrow(1, 0, I);
  auto hidden = torch::empty({P, I}, x.options());
  const float* bp = both.data_ptr<float>();
  float* hp = hidden.data_ptr<float>();
  if (!(activation == 0 && gelu_tanh_times_up(bp, hp, P, I))) {
    const auto act = (activation == 0 ? at::gelu(gate, "tanh") : activation == 1 ? at::gelu(gate) : at::silu(gate))
                         .contiguous();
    const float* ap = act.data_ptr<float>();
    for (int64_t place = 0; place < P; ++place)
      for (int64_t i = 0; i < I; ++i) hp[place * I + i] = ap[place * I + i] * bp[place * 2 * I + I + i];
  }
  auto products = torch::empty({P, H}, x.options());
  for (int64_t e = 0; e < E; ++e)
    expert_block(hidden, wd[e], products, first[e], first[e + 1] - first[e], max_rows, amx);
  auto out = torch::zeros({T, H}, x.options());
  const float* wp = weights.data_ptr<float>();
  const float* pp = products.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t place = 0; place < P; ++place) {  // in place order, as index_add_ adds
    const float scale = wp[pair_at[place]];
    float* row = op + token_at[place] * H;
    for (int64_t h = 0; h < H; ++h) row[h] += pp[place * H + h] * scale;
  }
  return out;
}

// A canvas's or a block's experts, each run only on the tokens routed to it (what the eager path's grouped GEMMs
// compute; a compiled graph, whose shapes cannot depend on the routing, would otherwise run every expert on every
// token). x (T, H), weights (T, k) and experts (T, k) from the router, gate_up (E, 2I, H), down (E, H, I);
// activation 0: GELU (tanh approximation), 1: GELU, 2: SiLU. Returns sum_j weights[t, j] *
// expert_{experts[t, j]}(x[t]), (T, H). The (token, slot) pairs are gathered once, grouped by expert; each
// expert's two products write into slices of one buffer, and the activation and the weighted sum run once over
// all pairs: a few ATen calls per layer instead of ten per expert, which is what a block of a few tokens (a
// speculative verification: 8) paid most for.
static torch::Tensor routed(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& experts,
                            const torch::Tensor& gate_up, const torch::Tensor& down, int64_t activation,
                            int64_t max_rows, bool amx) {
  TORCH_CHECK(x.dim() == 2 && weights.dim() == 2 && experts.sizes() == weights.sizes() &&
                  weights.size(0) == x.size(0) && gate_up.dim() == 3 && down.dim() == 3 &&
                  gate_up.size(2) == x.size(1) && down.size(0) == gate_up.size(0) && down.size(1) == x.size(1) &&
                  gate_up.size(1) == 2 * down.size(2),
              "printpress_fast::routed_experts expects x (T, H), weights and experts (T, k), gate_up (E, 2I, H) "
              "and down (E, H, I)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && gate_up.scalar_type() == dtype &&
                  down.scalar_type() == dtype &&
                  (weights.scalar_type() == torch::kFloat || weights.scalar_type() == dtype),
              "printpress_fast::routed_experts expects x, gate_up and down all float32 or all bfloat16 "
              "(weights float32 or their dtype)");
  TORCH_CHECK(activation >= 0 && activation <= 2, "printpress_fast::routed_experts: activation ", activation,
              " is not 0 (GELU, tanh), 1 (GELU) or 2 (SiLU)");
  const int64_t T = x.size(0), H = x.size(1), k = experts.size(1), E = gate_up.size(0), I = down.size(2);
  const int64_t P = T * k;
  const auto chosen = experts.to(torch::kLong).contiguous();
  const int64_t* e_of = chosen.data_ptr<int64_t>();
  // Pairs grouped by expert, in token order within an expert: first[e] .. first[e + 1].
  std::vector<int64_t> first(E + 1, 0);
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(e_of[i] >= 0 && e_of[i] < E, "printpress_fast::routed_experts: expert ", e_of[i], " is not in [0, ",
                E, ")");
    ++first[e_of[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  auto pair_index = torch::empty({P}, torch::TensorOptions().dtype(torch::kLong));  // the pair at each place
  auto token_index = torch::empty({P}, torch::TensorOptions().dtype(torch::kLong));  // its token
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    int64_t* pair_at = pair_index.data_ptr<int64_t>();
    int64_t* token_at = token_index.data_ptr<int64_t>();
    for (int64_t i = 0; i < P; ++i) {
      const int64_t place = next[e_of[i]]++;
      pair_at[place] = i;
      token_at[place] = i / k;
    }
  }
  const auto wg = gate_up.contiguous(), wd = down.contiguous();
  if (dtype == torch::kFloat && weights.scalar_type() == torch::kFloat)
    return routed_float(x.contiguous(), weights.contiguous(), wg, wd, first, pair_index, token_index, activation,
                        max_rows, amx);
  const auto gathered = x.index_select(0, token_index);  // (P, H), contiguous
  auto both = torch::empty({P, 2 * I}, x.options());
  for (int64_t e = 0; e < E; ++e) expert_block(gathered, wg[e], both, first[e], first[e + 1] - first[e], max_rows, amx);
  const auto gate = both.narrow(1, 0, I), up = both.narrow(1, I, I);
  const auto act = activation == 0 ? at::gelu(gate, "tanh") : activation == 1 ? at::gelu(gate) : at::silu(gate);
  const auto hidden = act * up;  // (P, I), contiguous
  auto products = torch::empty({P, H}, x.options());
  for (int64_t e = 0; e < E; ++e)
    expert_block(hidden, wd[e], products, first[e], first[e + 1] - first[e], max_rows, amx);
  // The weighted sum over a token's experts in float32 (as the dense path sums), then x's dtype.
  const auto scale = weights.to(torch::kFloat).reshape({P}).index_select(0, pair_index);
  auto out = torch::zeros({T, H}, x.options().dtype(torch::kFloat));
  out.index_add_(0, token_index, products.to(torch::kFloat) * scale.unsqueeze(1));
  return out.to(dtype);
}

torch::Tensor routed_experts(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& experts,
                             const torch::Tensor& gate_up, const torch::Tensor& down, int64_t activation,
                             int64_t max_rows) {
  return routed(x, weights, experts, gate_up, down, activation, max_rows, false);
}

// `routed_experts` with each float32 expert of `kAmxMinRows` tokens or more through AMX tiles (`amx_product`: its
// products' factors rounded to bfloat16, summed in float32): a compiled decoder pass with `weights="bfloat16"`.
torch::Tensor routed_experts_amx(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& experts,
                                 const torch::Tensor& gate_up, const torch::Tensor& down, int64_t activation,
                                 int64_t max_rows) {
  TORCH_CHECK(amx_ready(), "printpress_fast::routed_experts_amx needs a CPU with AMX (amx_bf16)");
  return routed(x, weights, experts, gate_up, down, activation, max_rows, true);
}

// -- attention of a few queries over a cached prefix (`small_attention`) ------------------------------------------
// softmax(scale q . k) v over two key segments read in place, a cached prefix (B, Hkv, P, D) and the block's own
// keys (B, Hkv, N, D); queries (B, T, Hq, D), query head h reading key head h / (Hq / Hkv) (grouped-query
// attention, as SDPA's enable_gqa). A bool mask broadcastable to (B, 1, T, P + N) says which keys each query sees;
// a query that sees none gets zeros. Returns (B * T, Hq * D), each query's heads side by side: what the output
// projection takes. The compiled passes' attentions are small (a canvas of 32 queries over ~100 keys, head_dim
// 64), and ATen's flash kernel spent most of its ~50 us a layer there around the arithmetic, with the keys joined
// into one tensor first. Here, on AVX-512, the queries that share a key head are taken 16 at a time, one per vector
// lane, so the scores, their softmax and the weighted sum of the values are vectorised across queries with no sums
// across lanes, and keys that every query of the 16 masks (an AR step's cache slots not yet written) are skipped.
// Elsewhere a plain loop computes the same.

namespace {

struct Segments {  // the keys or the values of one (batch, key head): the prefix's P rows, then the block's
  const float* past;
  int64_t past_stride;
  int64_t P;
  const float* block;
  int64_t block_stride;
  const float* row(int64_t j) const { return j < P ? past + j * past_stride : block + (j - P) * block_stride; }
};

Segments segments(const torch::Tensor& past, const torch::Tensor& block, int64_t b, int64_t g) {
  return {past.data_ptr<float>() + b * past.stride(0) + g * past.stride(1), past.stride(2), past.size(2),
          block.data_ptr<float>() + b * block.stride(0) + g * block.stride(1), block.stride(2)};
}

struct KeyMask {  // mask[b, 0, t, j] by the mask's strides (0 along a dimension it is broadcast in); none: all
  const bool* data = nullptr;
  int64_t b_stride = 0, t_stride = 0, j_stride = 0;
  bool sees(int64_t b, int64_t t, int64_t j) const {
    return data == nullptr || data[b * b_stride + t * t_stride + j * j_stride];
  }
};

// The first and one past the last key query t of batch b sees, of S (first == last: none).
std::pair<int64_t, int64_t> key_span(const KeyMask& mask, int64_t b, int64_t t, int64_t S) {
  int64_t first = 0, last = S;
  while (first < S && !mask.sees(b, t, first)) ++first;
  while (last > first && !mask.sees(b, t, last - 1)) --last;
  return {first, last};
}

#if defined(__AVX512F__)
// Scores of the 16 query lanes (transposed: qt[d * 16 + lane]) against NK keys from j: st[(j - lo) * 16 + lane].
template <int NK>
inline void lane_scores(const float* qt, const Segments& keys, int64_t j, int64_t lo, int64_t D, float* st) {
  __m512 acc[NK];
  const float* key[NK];
  for (int n = 0; n < NK; ++n) acc[n] = _mm512_setzero_ps(), key[n] = keys.row(j + n);
  for (int64_t d = 0; d < D; ++d) {
    const __m512 q = _mm512_loadu_ps(qt + d * 16);
    for (int n = 0; n < NK; ++n) acc[n] = _mm512_fmadd_ps(q, _mm512_set1_ps(key[n][d]), acc[n]);
  }
  for (int n = 0; n < NK; ++n) _mm512_storeu_ps(st + (j + n - lo) * 16, acc[n]);
}

// Lanes lane .. lane + RR - 1: out[lane + rr][d0 .. d0 + 16 NV) = inverse[lane + rr] sum_j pt[j][lane + rr] v_j[..].
template <int RR, int NV>
inline void lane_values(const float* pt, const Segments& values, int64_t lo, int64_t hi, int64_t lane, int64_t d0,
                        const float* inverse, float* const* out) {
  __m512 acc[RR][NV];
  for (int rr = 0; rr < RR; ++rr)
    for (int c = 0; c < NV; ++c) acc[rr][c] = _mm512_setzero_ps();
  for (int64_t j = lo; j < hi; ++j) {
    const float* v = values.row(j) + d0;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    const float* p = pt + (j - lo) * 16 + lane;
    for (int rr = 0; rr < RR; ++rr) {
      const __m512 pr = _mm512_set1_ps(p[rr]);
      for (int c = 0; c < NV; ++c) acc[rr][c] = _mm512_fmadd_ps(pr, vv[c], acc[rr][c]);
    }
  }
  for (int rr = 0; rr < RR; ++rr) {
    const __m512 scale = _mm512_set1_ps(inverse[lane + rr]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out[lane + rr] + d0 + 16 * c, _mm512_mul_ps(acc[rr][c], scale));
  }
}

template <int NV>
inline void values_for_lanes(const float* pt, const Segments& values, int64_t lo, int64_t hi, int64_t lanes,
                             int64_t d0, const float* inverse, float* const* out) {
  int64_t lane = 0;
  for (; lane + 4 <= lanes; lane += 4) lane_values<4, NV>(pt, values, lo, hi, lane, d0, inverse, out);
  switch (lanes - lane) {
    case 3: lane_values<3, NV>(pt, values, lo, hi, lane, d0, inverse, out); break;
    case 2: lane_values<2, NV>(pt, values, lo, hi, lane, d0, inverse, out); break;
    case 1: lane_values<1, NV>(pt, values, lo, hi, lane, d0, inverse, out); break;
    default: break;
  }
}

// Up to 16 queries of batch b that share one key head: query lane l is (time tq[l], head hq[l]), its row of q at
// query[l], its output at out[l] (D values each).
void attend_lanes(const float* const* query, const Segments& keys, const Segments& values, const KeyMask& mask,
                  int64_t b, const int64_t* tq, int64_t lanes, int64_t S, int64_t D, float scale, float* const* out,
                  std::vector<float>& buffer, std::vector<__mmask16>& seen) {
  int64_t lo = S, hi = 0;
  for (int64_t l = 0; l < lanes; ++l) {
    if (l > 0 && tq[l] == tq[l - 1]) continue;  // (the heads of one query time see the same keys)
    const auto [first, last] = key_span(mask, b, tq[l], S);
    if (first < last) lo = std::min(lo, first), hi = std::max(hi, last);
  }
  const int64_t span = std::max<int64_t>(hi - lo, 0);
  buffer.resize(16 * (D + span + 1));
  float* qt = buffer.data();
  float* st = qt + 16 * D;
  float* inverse = st + 16 * span;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t l = 0; l < 16; ++l) qt[d * 16 + l] = l < lanes ? query[l][d] * scale : 0.f;
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) lane_scores<8>(qt, keys, j, lo, D, st);
  for (; j < hi; ++j) lane_scores<1>(qt, keys, j, lo, D, st);
  // Masked keys to -inf, each lane's largest score (0 for a lane that sees nothing), then the exps and their sums.
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf;
  seen.assign(mask.data ? span : 0, 0);
  for (int64_t k = 0; k < span; ++k) {
    __m512 s = _mm512_loadu_ps(st + k * 16);
    if (mask.data) {
      __mmask16 bits = 0;
      for (int64_t l = 0; l < lanes; ++l) bits |= static_cast<__mmask16>(mask.sees(b, tq[l], lo + k)) << l;
      seen[k] = bits;
      s = _mm512_mask_blend_ps(bits, minus_inf, s);
    }
    top = _mm512_max_ps(top, s);
  }
  top = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(top, minus_inf, _CMP_EQ_OQ), top, _mm512_setzero_ps());
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < span; ++k) {
    __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(st + k * 16), top));
    if (mask.data) p = _mm512_maskz_mov_ps(seen[k], p);
    _mm512_storeu_ps(st + k * 16, p);
    sum = _mm512_add_ps(sum, p);
  }
  _mm512_storeu_ps(inverse, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                _mm512_set1_ps(1.f), sum));
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) values_for_lanes<4>(st, values, lo, hi, lanes, d0, inverse, out);
  for (; d0 < D; d0 += 16) values_for_lanes<1>(st, values, lo, hi, lanes, d0, inverse, out);
}
#endif

// One query (its row `query`, time t of batch b) over the keys it sees, in plain loops: out (D).
void attend_one(const float* query, const Segments& keys, const Segments& values, const KeyMask& mask, int64_t b,
                int64_t t, int64_t S, int64_t D, float scale, float* out, std::vector<float>& scores) {
  const auto [lo, hi] = key_span(mask, b, t, S);
  scores.assign(std::max<int64_t>(hi - lo, 0), 0.f);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j < hi; ++j) {
    if (!mask.sees(b, t, j)) continue;
    const float* key = keys.row(j);
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += query[d] * scale * key[d];
    scores[j - lo] = s;
    top = std::max(top, s);
  }
  float sum = 0.f;
  for (int64_t j = lo; j < hi; ++j) sum += scores[j - lo] = mask.sees(b, t, j) ? std::exp(scores[j - lo] - top) : 0.f;
  std::fill(out, out + D, 0.f);
  for (int64_t j = lo; j < hi; ++j) {
    const float* value = values.row(j);
    for (int64_t d = 0; d < D; ++d) out[d] += scores[j - lo] * value[d];
  }
  const float inverse = sum > 0.f ? 1.f / sum : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] *= inverse;
}

}  // namespace

torch::Tensor small_attention(const torch::Tensor& q, const torch::Tensor& past_k, const torch::Tensor& past_v,
                              const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& mask,
                              double scale) {
  TORCH_CHECK(q.dim() == 4 && past_k.dim() == 4 && past_v.sizes() == past_k.sizes() && k.dim() == 4 &&
                  v.sizes() == k.sizes() && past_k.size(0) == q.size(0) && k.size(0) == q.size(0) &&
                  past_k.size(1) == k.size(1) && past_k.size(3) == q.size(3) && k.size(3) == q.size(3) &&
                  k.size(1) > 0 && q.size(2) % k.size(1) == 0,
              "printpress_fast::small_attention expects q (B, T, Hq, D), past keys and values (B, Hkv, P, D) and "
              "the block's (B, Hkv, N, D), with Hq a multiple of Hkv");
  for (const auto* t : {&q, &past_k, &past_v, &k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->device().is_cpu(),
                "printpress_fast::small_attention is float32 on the CPU only");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1),
                S = past_k.size(2) + k.size(2), group = Hq / Hkv;
  KeyMask keymask;
  torch::Tensor mask_kept;
  if (mask.has_value() && mask->defined()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == torch::kBool && m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) &&
                    m.size(1) == 1 && (m.size(2) == 1 || m.size(2) == T) && m.size(3) == S,
                "printpress_fast::small_attention: a mask is bool and broadcasts to (B, 1, T, P + N) = (", B,
                ", 1, ", T, ", ", S, "), not ", m.sizes());
    mask_kept = m;
    keymask.data = m.data_ptr<bool>();
    keymask.b_stride = m.size(0) == 1 ? 0 : m.stride(0);
    keymask.t_stride = m.size(2) == 1 ? 0 : m.stride(2);
    keymask.j_stride = m.stride(3);
  }
  // Rows of D contiguous floats (their other strides are read as they are).
  const auto rows = [](const torch::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const auto qc = rows(q), pk = rows(past_k), pv = rows(past_v), kc = rows(k), vc = rows(v);
  auto out = torch::empty({B * T, Hq * D}, q.options());
  float* out_data = out.data_ptr<float>();
  const float* q_data = qc.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  std::vector<float> buffer;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g) {
      const Segments keys = segments(pk, kc, b, g), values = segments(pv, vc, b, g);
      // This key head's queries, time-major: (t, head g * group + i).
      const auto query_row = [&](int64_t t, int64_t h) {
        return q_data + b * qc.stride(0) + t * qc.stride(1) + h * qc.stride(2);
      };
      const auto out_row = [&](int64_t t, int64_t h) { return out_data + (b * T + t) * Hq * D + h * D; };
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        std::vector<__mmask16> seen;
        const float* query[16];
        float* outs[16];
        int64_t tq[16];
        for (int64_t first = 0; first < T * group; first += 16) {
          const int64_t lanes = std::min<int64_t>(16, T * group - first);
          for (int64_t l = 0; l < lanes; ++l) {
            const int64_t t = (first + l) / group, h = g * group + (first + l) % group;
            tq[l] = t, query[l] = query_row(t, h), outs[l] = out_row(t, h);
          }
          attend_lanes(query, keys, values, keymask, b, tq, lanes, S, D, scale_f, outs, buffer, seen);
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          attend_one(query_row(t, h), keys, values, keymask, b, t, S, D, scale_f, out_row(t, h), buffer);
    }
  return out;
}

// Each row's softmax and entropy, x (R, V) float32 -> probs (R, V) and entropy (R,) in nats: the row's maximum m,
// then e = exp(x - m) with the sums s = sum(e) and t = sum(e (x - m)) in the same pass, then probs = e / s and
// entropy = log(s) - t / s. What a diffusion step's sampler takes of a compiled pass's logits in one call, where the
// exact path makes them in ten ATen passes reproducing `torch.distributions.Categorical` (its bits: the reference's);
// another summation order and an own exp, so only a compiled decoder's steps use it
// (`canvas.probabilities_and_entropy`).
// A -inf (a banned token) has probability 0 and adds nothing to the entropy.
std::tuple<torch::Tensor, torch::Tensor> softmax_entropy(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) > 0,
              "printpress_fast::softmax_entropy expects float32 rows (R, V) with V > 0");
  const auto xc = x.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto probs = torch::empty({R, V}, x.options());
  auto entropy = torch::empty({R}, x.options());
  const float* in = xc.data_ptr<float>();
  float* out = probs.data_ptr<float>();
  float* h = entropy.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* z = in + r * V;
    float* p = out + r * V;
    const float m = z[argmax_of(z, V)];
    float s = 0.f, t = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m), floor = _mm512_set1_ps(-104.f);
    __m512 sv = _mm512_setzero_ps(), tv = _mm512_setzero_ps();
    for (; i + 16 <= V; i += 16) {
      const __m512 d = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(z + i), mv), floor);
      const __m512 e = exp16(d);
      _mm512_storeu_ps(p + i, e);
      sv = _mm512_add_ps(sv, e);
      tv = _mm512_fmadd_ps(e, d, tv);
    }
    s = _mm512_reduce_add_ps(sv);
    t = _mm512_reduce_add_ps(tv);
#endif
    for (; i < V; ++i) {
      const float d = std::max(z[i] - m, -104.f);
      const float e = std::exp(d);
      p[i] = e;
      s += e;
      t += e * d;
    }
    const float inverse = 1.f / s;
    for (int64_t j = 0; j < V; ++j) p[j] *= inverse;
    h[r] = std::log(s) - t * inverse;
  }
  return {probs, entropy};
}

// A number that changes when any of `tensors` changes its dtype, device or sizes (FNV-1a over them): what the compiled
// passes check of the model's parameters before each call (their graphs were made for those), in one call instead
// of three attribute reads per parameter from Python.
int64_t metadata_signature(at::TensorList tensors) {
  uint64_t hash = 1469598103934665603ull;
  const auto mix = [&hash](uint64_t value) { hash = (hash ^ value) * 1099511628211ull; };
  for (const auto& t : tensors) {
    mix(static_cast<uint64_t>(t.scalar_type()));
    mix(static_cast<uint64_t>(t.device().type()) << 8 | static_cast<uint8_t>(t.device().index()));
    mix(static_cast<uint64_t>(t.dim()));
    for (const auto size : t.sizes()) mix(static_cast<uint64_t>(size));
  }
  return static_cast<int64_t>(hash);
}

TORCH_LIBRARY(printpress_fast, m) {
  m.def("rows_linear(Tensor x, Tensor weight, int max_rows) -> Tensor");
  m.def("expert_rows(Tensor x, Tensor weight, Tensor index) -> Tensor");
  m.def("routed_experts(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, int activation, "
        "int max_rows) -> Tensor");
  m.def("rows_linear_capped(Tensor x, Tensor weight, float cap, int max_rows) -> Tensor");
  m.def("rows_linear_bf16(Tensor x, Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor weight, float cap) -> Tensor");
  m.def("routed_experts_amx(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, int activation, "
        "int max_rows) -> Tensor");
  m.def("amx_available", &amx_available);
  m.def("expert_rows_bf16(Tensor x, Tensor weight, Tensor index) -> Tensor");
  m.def("forget_weight_copies", &forget_weight_copies);
  m.def("packed_panels", &packed_panels);
  m.def("softmax_entropy(Tensor x) -> (Tensor, Tensor)");
  m.def("small_attention(Tensor q, Tensor past_k, Tensor past_v, Tensor k, Tensor v, Tensor? mask, float scale) "
        "-> Tensor");
  m.def("metadata_signature(Tensor[] tensors) -> int", &metadata_signature);
}

TORCH_LIBRARY_IMPL(printpress_fast, CPU, m) {
  m.impl("rows_linear", &rows);
  m.impl("expert_rows", &expert_rows);
  m.impl("routed_experts", &routed_experts);
  m.impl("rows_linear_capped", &rows_capped);
  m.impl("rows_linear_bf16", &rows_bf16);
  m.impl("amx_linear", &amx_linear);
  m.impl("routed_experts_amx", &routed_experts_amx);
  m.impl("expert_rows_bf16", &expert_rows_bf16);
  m.impl("softmax_entropy", &softmax_entropy);
  m.impl("small_attention", &small_attention);
}
