// ATen's float32 sums, in ATen's order (aten/src/ATen/native/cpu/SumKernel.cpp, `cascade_sum`), for printpress's
// kernels that must give ATen's bits (layers.cpp, softmax.cpp), and the numbers of their self-checks: each kernel
// checks the order against ATen itself on its first use and uses ATen's operators where it does not hold.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace printpress_sum {

// ATen's float sum over a contiguous last dimension (aten/src/ATen/native/cpu/SumKernel.cpp, `cascade_sum`): a row of
// n values is read as n / W vectors of W lanes (W: ATen's vector width on this CPU) plus a scalar tail. The vectors
// are summed lane by lane as four interleaved sequences (vector 4i + k into sequence k), each accumulated in levels of
// at least 16 (a cascade: every 16 additions pass up a level), the four then added in order 0 + 1 + 2 + 3; the tail
// is summed into a float from 0, then the W lanes of that vector added to it in order; the result is added to the
// zero ATen's output starts as. Rows shorter than W take the same four-sequence cascade over single values.
// All float additions, none fused into a multiply (the library is built with -ffp-contract=off), so the same bits.

inline int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// L float lanes added lane by lane (GCC's and Clang's vector extension: one vector instruction per addition, each
// lane an IEEE float addition); one lane is a float.
template <int L>
struct LaneType {
  typedef float type __attribute__((vector_size(sizeof(float) * L)));
};
template <>
struct LaneType<1> {
  using type = float;
};
template <int L>
using Lanes = typename LaneType<L>::type;

template <int L>
inline Lanes<L> load(const float* p) {
  Lanes<L> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The cascade over `size` groups of 4 interleaved elements of L lanes: element (i, k) starts at data + (4 i + k) L.
template <int L>
void four_sums(const float* data, int64_t size, Lanes<L> out[4]) {
  constexpr int kLevels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  Lanes<L> acc[kLevels][4] = {};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += load<L>(data + (4 * i + k) * L);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = Lanes<L>{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += load<L>(data + (4 * i + k) * L);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  for (int k = 0; k < 4; ++k) out[k] = acc[0][k];
}

// ATen's row_sum over `size` elements of L lanes: the four sequences, the elements after the last group of four
// into the first, then the four in order.
template <int L>
Lanes<L> row_sum(const float* data, int64_t size) {
  Lanes<L> sums[4];
  const int64_t groups = size / 4;
  four_sums<L>(data, groups, sums);
  for (int64_t i = groups * 4; i < size; ++i) sums[0] += load<L>(data + i * L);
  for (int k = 1; k < 4; ++k) sums[0] += sums[k];
  return sums[0];
}

template <int W>
float aten_row_sum(const float* row, int64_t n) {
  float total;
  if (n >= W) {
    const int64_t vectors = n / W;
    const Lanes<W> lanes = row_sum<W>(row, vectors);
    total = 0.0f;
    for (int64_t k = vectors * W; k < n; ++k) total += row[k];
    for (int l = 0; l < W; ++l) total += lanes[l];
  } else {
    total = row_sum<1>(row, n);
  }
  return 0.0f + total;
}

// ATen's sum of n contiguous floats, with its vector width (8 or 16 lanes).
inline float aten_sum(const float* x, int64_t n, int width) {
  return width == 16 ? aten_row_sum<16>(x, n) : aten_row_sum<8>(x, n);
}

// The numbers the kernels' self-checks feed ATen and themselves: a 64-bit linear congruential generator, so that no
// torch generator moves.
class CheckNumbers {
 public:
  explicit CheckNumbers(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return state_ >> 11;
  }
  double unit() { return static_cast<double>(next()) * (1.0 / 9007199254740992.0); }  // in [0, 1)

 private:
  uint64_t state_;
};

}  // namespace printpress_sum
