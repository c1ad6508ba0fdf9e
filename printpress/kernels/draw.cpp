// The exact path's sampling kernels (printpress/sampling.py): ATen's results, bit for bit, with less work.
//
// `multinomial_one(probs, generator)` draws what torch.multinomial(probs, 1, generator=generator) draws, and leaves
// the generator where it would. For one sample ATen takes each row's argmax of probs / q, with q ~ Exp(1) from
// `exponential_`: a double uniform u from two 32-bit words of the generator, then the float of -log1p(-u) with
// libm's scalar log1p, one element at a time under the generator's lock; then a division and an argmax, each a
// pass over memory (2.3 ms for a 32 x 4096 canvas on one thread). Here a row at a time, in cache: the generator's
// words come out in vectorised runs (`Twister`), and the logarithm is taken, with the same scalar log1p, only for
// the few elements that could hold the row's largest ratio (`draw_row`).
//
// The parts, each its own operator for the tests: `uniform(n, generator)` (what `uniform_` of n doubles makes),
// `multinomial_from_uniforms(probs, u)` (the draws from given uniforms), `row_argmax(x)` (torch.max(x, -1).indices:
// the first of equal maxima; a NaN counts as the largest), `capped_row_argmax(raw, cap)` (row_argmax of the logits'
// softcap, cap * tanh(raw / cap), with the tanh taken only where it could decide the answer). And two pieces of AR
// sampling and speculative sampling around ATen's operators: `top_k_probs(logits, temperature, k)` (the top-k cut
// between ATen's division and softmax) and `speculative_accept(draft, q, p, uniforms, generator)` (the acceptance
// rule's loop, its draws `multinomial_one`'s).
//
// Only torch/library.h and ATen's headers, not torch/extension.h: this library is built on a machine's first draw
// (printpress/native.py), in about 6 s instead of 25.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/div.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "argmax.h"

namespace {

inline float exponential_scalar(double u) { return static_cast<float>(-std::log1p(-u)); }

// -- torch's CPU generator, many numbers at a time -------------------------------------------------------------
//
// A CPU torch.Generator is a 32-bit Mersenne Twister (at::mt19937): 624 words of state, regenerated all at once
// (the "twist") when used up, each word tempered as it is handed out. ATen hands them out one call at a time under
// the generator's lock; `Twister` copies the engine's state out, hands out whole runs of words (the twist and the
// tempering in loops the compiler vectorises), and writes the state back: the same words, the same state after.

constexpr int kN = at::MERSENNE_STATE_N, kM = at::MERSENNE_STATE_M;

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

inline uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  return y ^ (y >> 18);
}

class Twister {
 public:
  explicit Twister(at::CPUGeneratorImpl* generator)
      : generator_(generator), lock_(generator->mutex_), engine_(generator->engine()), data_(engine_.data()) {}
  ~Twister() {
    engine_.set_data(data_);
    generator_->set_engine(engine_);
  }

  // The next n words of the stream, as n calls of the engine would return them.
  void words(uint32_t* out, int64_t n) {
    uint32_t* state = data_.state_.data();
    while (n > 0) {
      // The engine counts `left_` down before each word and twists when it reaches 0, then hands out word 0.
      if (data_.left_ == 1) {
        twist_all(state);
        data_.left_ = kN + 1;
        data_.next_ = 0;
      }
      const int64_t k = std::min<int64_t>(n, data_.left_ - 1);
      const uint32_t* from = state + data_.next_;
      for (int64_t i = 0; i < k; ++i) out[i] = temper(from[i]);
      out += k;
      n -= k;
      data_.next_ += static_cast<uint32_t>(k);
      data_.left_ -= static_cast<int>(k);
    }
  }

  // The next n doubles of `uniform_(0, 1)`: 53 bits of two words each, the first word the high half.
  void uniforms(double* out, int64_t n, std::vector<uint32_t>& words_buffer) {
    words_buffer.resize(2 * n);
    uint32_t* w = words_buffer.data();
    words(w, 2 * n);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t bits = (static_cast<uint64_t>(w[2 * i]) << 32) | w[2 * i + 1];
      out[i] = static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) * 0x1p-53;
    }
  }

 private:
  static void twist_all(uint32_t* p) {
    int i = 0;
    for (; i < kN - kM; ++i) p[i] = p[i + kM] ^ twist(p[i], p[i + 1]);
    for (; i < kN - 1; ++i) p[i] = p[i + kM - kN] ^ twist(p[i], p[i + 1]);
    p[kN - 1] = p[kM - 1] ^ twist(p[kN - 1], p[0]);
  }

  at::CPUGeneratorImpl* generator_;
  std::lock_guard<std::mutex> lock_;
  at::mt19937 engine_;
  at::mt19937_data_pod data_;
};

at::CPUGeneratorImpl* cpu_generator(const std::optional<at::Generator>& generator) {
  return at::check_generator<at::CPUGeneratorImpl>(generator);
}

// The index torch.multinomial draws for one row of probabilities p[0 .. V) from the row's uniforms u[0 .. V): the
// argmax (the first of equal maxima, a NaN first of all) of the ratios r = p / q, q = float(-log1p(-u)) from
// libm's scalar log1p, as `exponential_` makes it. Since -log1p(-u) >= u, each ratio is at most e = p / float(u)
// (up to a few float roundings: e >= r (1 - 2**-21)), and e costs a division where q costs a log1p. So: e for the
// whole row; r exactly at e's largest, m; then r exactly only where e >= r_m (1 - 2**-20), which every element whose
// ratio reaches r_m passes; the first largest of those is the row's draw. Few pass (those whose u is small for
// their p), so few logarithms are taken. A NaN ratio (u = 0 and p = 0: 0 / 0) is exactly a NaN e, and is the draw;
// where the largest e is infinite, the bound says nothing, and every ratio is computed.
int64_t draw_row(const float* p, const double* u, int64_t V, float* e) {
  for (int64_t i = 0; i < V; ++i) e[i] = p[i] / static_cast<float>(u[i]);
  const int64_t m = argmax_of(e, V);
  if (std::isnan(e[m])) return m;
  if (std::isinf(e[m])) {  // a zero u under p > 0 (one draw in 2**53), or weights past float's range: every ratio
    for (int64_t i = 0; i < V; ++i) e[i] = p[i] / exponential_scalar(u[i]);
    return argmax_of(e, V);
  }
  float best = p[m] / exponential_scalar(u[m]);
  const float threshold = best * (1.0f - 0x1p-20f);
  int64_t index = m;
  for (int64_t i = 0; i < V; ++i) {
    if (e[i] >= threshold && i != m) {
      const float r = p[i] / exponential_scalar(u[i]);
      if (r > best || (r == best && i < index)) {
        best = r;
        index = i;
      }
    }
  }
  return index;
}

// An operator's float32 input taken as rows of its last dimension, with the index tensor its rows fill.
struct Rows {
  at::Tensor data;  // contiguous
  int64_t V, count;
  at::Tensor index;  // (...,) int64: the input's shape without its last dimension
};

Rows float_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "printpress_draw::", what,
              " expects a float32 tensor whose last dimension is not empty");
  auto data = x.contiguous();
  const int64_t V = x.size(-1);
  return {data, V, data.numel() / V, at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong))};
}

at::Tensor row_argmax(const at::Tensor& x) {
  const Rows rows = float_rows(x, "row_argmax");
  const float* data = rows.data.data_ptr<float>();
  int64_t* index = rows.index.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.count; ++r) index[r] = argmax_of(data + r * rows.V, rows.V);
  return rows.index;
}

// row_argmax(raw.div(cap).tanh().mul(cap)), the final softcap of a whole (rows, V) tensor of raw logits followed by
// its argmax, with the tanh (~3 ns an element: a verification's 8 rows of 4096 in ~0.1 ms) taken only where it could
// decide the argmax. The softcap is monotone up to its rounding: with y = raw / cap rounded, ATen's vectorised tanh
// (Sleef's, within 1 ulp) and a rounded product, each computed value lies within cap * 2^-22 of cap * tanh(raw / cap),
// well inside slack = cap * 2^-20. So an element whose exact capped value is more than 2 * slack below the row's
// largest raw element's cannot be its argmax: only the elements at or above the raw threshold
// cap * atanh(tanh(best / cap) - 2 * slack / cap) are
// softcapped, with the same ATen operators on a buffer of them (each lane of a vectorised tanh is computed alone, so
// an element gets the bits it gets in the whole tensor), and the first largest of those is the row's answer.
//
// The whole tensor is softcapped instead (the plain path, the same bits by construction) where that argument does
// not hold: rows whose largest element is infinite, rows with more than kCapCandidates candidates (saturated logits
// tie), or a tensor whose elementwise loop would not give every element the vectorised tanh (ATen computes the last
// V % 2 * width elements of a loop, and the ends of chunks split between threads, with the scalar std::tanh): V a
// multiple of 64 and the tensor no larger than one chunk (at::internal::GRAIN_SIZE) or run on one thread.
constexpr int64_t kCapCandidates = 256;
constexpr int64_t kCapGrain = 32768;  // at::internal::GRAIN_SIZE

at::Tensor capped_row_argmax(const at::Tensor& raw, double cap) {
  const Rows rows = float_rows(raw, "capped_row_argmax");
  TORCH_CHECK(cap > 0.0 && std::isfinite(cap), "printpress_draw::capped_row_argmax expects a finite cap > 0");
  const int64_t V = rows.V;
  const float* data = rows.data.data_ptr<float>();
  int64_t* index = rows.index.data_ptr<int64_t>();
  const auto plain = [&]() {
    const at::Tensor capped = rows.data.clone().div_(cap).tanh_().mul_(cap);
    const float* c = capped.data_ptr<float>();
    for (int64_t r = 0; r < rows.count; ++r) index[r] = argmax_of(c + r * V, V);
    return rows.index;
  };
  if (V % 64 != 0 || (rows.data.numel() > kCapGrain && at::get_num_threads() > 1)) return plain();
  const double slack = std::ldexp(cap, -20);
  std::vector<int64_t> candidates;  // flat indices, row after row, each row's in ascending order
  std::vector<int64_t> first(rows.count + 1, 0);  // row r's candidates: candidates[first[r] .. first[r + 1])
  for (int64_t r = 0; r < rows.count; ++r) {
    const float* row = data + r * V;
    const int64_t top = argmax_of(row, V);
    const float best = row[top];
    first[r] = static_cast<int64_t>(candidates.size());
    if (std::isnan(best)) {  // the softcap keeps a NaN where it is: the first NaN either way
      index[r] = top;
      continue;
    }
    if (std::isinf(best)) return plain();
    const double level = std::tanh(static_cast<double>(best) / cap) - 2.0 * slack / cap;
    if (level <= -1.0) return plain();
    const double threshold = cap * std::atanh(level);
    float low = static_cast<float>(threshold);  // the largest float not above it: a float at or above it is >= low
    if (static_cast<double>(low) > threshold) low = std::nextafter(low, -std::numeric_limits<float>::infinity());
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 bound = _mm512_set1_ps(low);
    for (; i + 16 <= V; i += 16)
      for (__mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), bound, _CMP_GE_OQ); hit; hit &= hit - 1)
        candidates.push_back(r * V + i + __builtin_ctz(hit));
#elif defined(__AVX2__)
    const __m256 bound = _mm256_set1_ps(low);
    for (; i + 8 <= V; i += 8)
      for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), bound, _CMP_GE_OQ)); hit;
           hit &= hit - 1)
        candidates.push_back(r * V + i + __builtin_ctz(hit));
#endif
    for (; i < V; ++i)
      if (row[i] >= low) candidates.push_back(r * V + i);
    const int64_t found = static_cast<int64_t>(candidates.size()) - first[r];  // >= 1: the threshold is below best
    if (found < 1 || found > kCapCandidates) return plain();
  }
  first[rows.count] = static_cast<int64_t>(candidates.size());
  const int64_t n = static_cast<int64_t>(candidates.size());
  at::Tensor buffer = at::zeros({(n + 63) / 64 * 64}, rows.data.options());  // whole vectors: every lane Sleef's
  float* b = buffer.data_ptr<float>();
  for (int64_t k = 0; k < n; ++k) b[k] = data[candidates[k]];
  buffer.div_(cap).tanh_().mul_(cap);
  for (int64_t r = 0; r < rows.count; ++r) {
    if (first[r] == first[r + 1]) continue;  // a NaN row, answered above (every other row has a candidate)
    int64_t best = first[r];
    for (int64_t k = first[r] + 1; k < first[r + 1]; ++k)
      if (b[k] > b[best]) best = k;
    index[r] = candidates[best] - r * V;
  }
  return rows.index;
}

// The k-th largest of v[0 .. V) counting repeats (torch.topk's k-th value; no NaN in v). Bisection on the values'
// range narrows it to at most a few times k elements (a vectorised counting pass each: a row of 4096 logits and
// k = 50 takes 2-5 passes of 0.2 us), then selection among those; rows with infinities, or that do not narrow (many
// equal values), select among all of them. ~3 us a row where ATen's topk and the cut take ~20.
inline float kth_largest(const float* v, int64_t V, int64_t k, std::vector<float>& buffer) {
  float low = v[0], high = v[0];
  int64_t i = 0;
#if defined(__AVX512F__)
  if (V >= 16) {
    __m512 lows = _mm512_loadu_ps(v), highs = lows;
    for (i = 16; i + 16 <= V; i += 16) {
      const __m512 x = _mm512_loadu_ps(v + i);
      lows = _mm512_min_ps(lows, x);
      highs = _mm512_max_ps(highs, x);
    }
    low = _mm512_reduce_min_ps(lows);
    high = _mm512_reduce_max_ps(highs);
  }
#elif defined(__AVX2__)
  if (V >= 8) {
    __m256 lows = _mm256_loadu_ps(v), highs = lows;
    for (i = 8; i + 8 <= V; i += 8) {
      const __m256 x = _mm256_loadu_ps(v + i);
      lows = _mm256_min_ps(lows, x);
      highs = _mm256_max_ps(highs, x);
    }
    alignas(32) float lane_lows[8], lane_highs[8];
    _mm256_store_ps(lane_lows, lows);
    _mm256_store_ps(lane_highs, highs);
    low = *std::min_element(lane_lows, lane_lows + 8);
    high = *std::max_element(lane_highs, lane_highs + 8);
  }
#endif
  for (; i < V; ++i) {
    low = std::min(low, v[i]);
    high = std::max(high, v[i]);
  }
  const auto at_least = [&](float t, bool keep) {  // how many are >= t; with `keep`, those values into `buffer`
    int64_t n = 0, j = 0;
#if defined(__AVX512F__)
    const __m512 bound = _mm512_set1_ps(t);
    for (; j + 16 <= V; j += 16) {
      __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + j), bound, _CMP_GE_OQ);
      n += __builtin_popcount(hit);
      for (; keep && hit; hit &= hit - 1) buffer.push_back(v[j + __builtin_ctz(hit)]);
    }
#elif defined(__AVX2__)
    const __m256 bound = _mm256_set1_ps(t);
    for (; j + 8 <= V; j += 8) {
      int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + j), bound, _CMP_GE_OQ));
      n += __builtin_popcount(hit);
      for (; keep && hit; hit &= hit - 1) buffer.push_back(v[j + __builtin_ctz(hit)]);
    }
#endif
    for (; j < V; ++j)
      if (v[j] >= t) {
        ++n;
        if (keep) buffer.push_back(v[j]);
      }
    return n;
  };
  if (std::isfinite(low) && std::isfinite(high)) {
    for (int64_t above = V, pass = 0; above > 4 * k && pass < 40; ++pass) {  // count(>= low) = above >= k
      const float middle = low + (high - low) / 2;
      if (!(middle > low && middle < high)) break;  // the range is down to neighbouring floats
      const int64_t n = at_least(middle, false);
      (n >= k ? low : high) = middle;
      if (n >= k) above = n;
    }
  } else {
    low = -std::numeric_limits<float>::infinity();
  }
  buffer.clear();
  at_least(low, true);
  std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
  return buffer[k - 1];
}

// AR sampling's next-token probabilities with a top-k cut (printpress.sampling.next_token_probs):
// softmax(top_k_only(logits / temperature, k)), the same bits: the division and the softmax are ATen's own operators,
// called from here; only the cut is done here, a row at a time: each row's k-th largest value (with repeats, as
// torch.topk's k-th value: `kth_largest`), and every value below it set to -inf in place. Rows holding a NaN
// (whose order torch.topk defines and selection does not) make it return an undefined tensor: the caller then runs
// ATen's operators.
at::Tensor top_k_probs(const at::Tensor& logits, double temperature, int64_t k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() >= 1 && k >= 1 && k < logits.size(-1),
              "printpress_draw::top_k_probs expects float32 logits and 1 <= k < their last dimension");
  at::Tensor scaled = at::div(logits, temperature).contiguous();
  const int64_t V = scaled.size(-1), count = scaled.numel() / V;
  float* data = scaled.data_ptr<float>();
  std::vector<float> buffer;
  for (int64_t r = 0; r < count; ++r) {
    float* row = data + r * V;
    int nan = 0;
    for (int64_t i = 0; i < V; ++i) nan |= row[i] != row[i];  // (a comparison: the loop vectorises)
    if (nan) return at::Tensor();
    const float kth = kth_largest(row, V, k, buffer);
    const float cut = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < V; ++i) row[i] = row[i] < kth ? cut : row[i];
  }
  return at::softmax(scaled, -1, at::kFloat);
}

at::Tensor multinomial_from_uniforms(const at::Tensor& probs, const at::Tensor& uniform) {
  const Rows rows = float_rows(probs, "multinomial_from_uniforms");
  TORCH_CHECK(uniform.scalar_type() == at::kDouble && uniform.numel() == probs.numel(),
              "printpress_draw::multinomial_from_uniforms expects one float64 uniform per probability");
  const auto uc = uniform.contiguous();
  const float* p = rows.data.data_ptr<float>();
  const double* u = uc.data_ptr<double>();
  int64_t* index = rows.index.data_ptr<int64_t>();
  std::vector<float> e(rows.V);
  for (int64_t r = 0; r < rows.count; ++r) index[r] = draw_row(p + r * rows.V, u + r * rows.V, rows.V, e.data());
  return rows.index;
}

at::Tensor uniform(int64_t n, const std::optional<at::Generator>& generator) {
  TORCH_CHECK(n >= 0, "printpress_draw::uniform expects a count >= 0");
  auto out = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  std::vector<uint32_t> words;
  Twister(cpu_generator(generator)).uniforms(out.data_ptr<double>(), n, words);
  return out;
}

at::Tensor multinomial_one(const at::Tensor& probs, const std::optional<at::Generator>& generator) {
  const Rows rows = float_rows(probs, "multinomial_one");
  const int64_t V = rows.V;
  const float* p = rows.data.data_ptr<float>();
  int64_t* index = rows.index.data_ptr<int64_t>();
  // What torch.multinomial accepts (every weight finite and >= 0, each row with one above 0), checked before the
  // generator moves; anything else is refused for the caller to hand to torch.multinomial, which says what is wrong.
  for (int64_t r = 0; r < rows.count; ++r) {
    const float* row = p + r * V;
    int bad = 0, positive = 0;
    for (int64_t i = 0; i < V; ++i) {  // counts, so that the loop vectorises
      bad += !(row[i] >= 0.0f) | (row[i] > std::numeric_limits<float>::max());  // a NaN fails the first
      positive += row[i] > 0.0f;
    }
    TORCH_CHECK(bad == 0 && positive > 0, "printpress_draw::multinomial_one: probabilities torch.multinomial refuses");
  }
  std::vector<double> u(V);  // a row's words, uniforms and bounds stay in cache (4096 tokens: 80 KiB)
  std::vector<float> e(V);
  std::vector<uint32_t> words;
  Twister twister(cpu_generator(generator));
  for (int64_t r = 0; r < rows.count; ++r) {
    twister.uniforms(u.data(), V, words);
    index[r] = draw_row(p + r * V, u.data(), V, e.data());
  }
  return rows.index;
}

// Speculative sampling's decision (printpress.speculative.sampled_accept, whose Python loop this is, the same
// tokens and generator state): draft i (drawn from q[i]) is kept while uniforms[i] * q[i, d_i] < p[i, d_i] (in
// double, as Python compares them); at the first rejection a draw from max(0, p[i] - q[i]) (p[i] itself where that is
// all zero), or, every draft kept, a bonus draw from p[m]; each draw is `multinomial_one`'s. Returns the kept drafts
// and the token drawn after them (int64).
at::Tensor speculative_accept(const at::Tensor& draft, const at::Tensor& q, const at::Tensor& p,
                              const at::Tensor& uniforms, const std::optional<at::Generator>& generator) {
  const int64_t m = draft.numel();
  TORCH_CHECK(draft.scalar_type() == at::kLong && q.scalar_type() == at::kFloat && p.scalar_type() == at::kFloat &&
                  uniforms.scalar_type() == at::kFloat && q.dim() == 2 && p.dim() == 2 && q.size(0) == m &&
                  p.size(0) == m + 1 && uniforms.numel() == m && (m == 0 || q.size(1) == p.size(1)),
              "printpress_draw::speculative_accept expects m int64 drafts, q (m, V) and p (m + 1, V) float32, and m "
              "float32 uniforms");
  const auto d = draft.contiguous();
  const auto u = uniforms.contiguous();
  const auto qc = q.contiguous();
  const auto pc = p.contiguous();
  const int64_t* tokens = d.data_ptr<int64_t>();
  const float* us = u.data_ptr<float>();
  const int64_t V = pc.size(1);
  std::vector<int64_t> out(tokens, tokens + m);
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < V, "printpress_draw::speculative_accept: a draft token outside the "
                "vocabulary");
    const double drafted_q = qc.data_ptr<float>()[i * V + tokens[i]], drafted_p = pc.data_ptr<float>()[i * V + tokens[i]];
    if (static_cast<double>(us[i]) * drafted_q < drafted_p) continue;
    at::Tensor residual = at::sub(pc[i], qc[i]).clamp_min_(0);
    if (!(residual.sum().item<float>() > 0)) residual = pc[i];  // p == q up to rounding: a draw from p
    out.resize(i);
    out.push_back(multinomial_one(residual, generator).item<int64_t>());
    return at::tensor(out, at::TensorOptions().dtype(at::kLong));
  }
  out.push_back(multinomial_one(pc[m], generator).item<int64_t>());
  return at::tensor(out, at::TensorOptions().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY(printpress_draw, m) {
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("capped_row_argmax(Tensor raw, float cap) -> Tensor");
  m.def("top_k_probs(Tensor logits, float temperature, int k) -> Tensor");
  m.def("multinomial_from_uniforms(Tensor probs, Tensor uniform) -> Tensor");
  m.def("uniform(int n, Generator? generator) -> Tensor", &uniform);  // no tensor to dispatch on: one kernel
  m.def("multinomial_one(Tensor probs, Generator? generator) -> Tensor");
  m.def("speculative_accept(Tensor draft, Tensor q, Tensor p, Tensor uniforms, Generator? generator) -> Tensor");
}

TORCH_LIBRARY_IMPL(printpress_draw, CPU, m) {
  m.impl("row_argmax", &row_argmax);
  m.impl("capped_row_argmax", &capped_row_argmax);
  m.impl("top_k_probs", &top_k_probs);
  m.impl("multinomial_from_uniforms", &multinomial_from_uniforms);
  m.impl("multinomial_one", &multinomial_one);
  m.impl("speculative_accept", &speculative_accept);
}
