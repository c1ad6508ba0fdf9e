// ATen's softmax over a last dimension, one row at a time, from ATen's vector headers (include aten_vec.h first):
// `_vec_softmax_lastdim`'s vec::reduce_all for the maximum, vec::map of exp(x - max), vec::reduce_all for the sum and a
// product with its reciprocal. Which exp it takes (Sleef's or ATen's exp_u20) depends on torch's build, so each user
// checks the forms against at::softmax once per process (softmax.cpp: the sampler's numbers; layers.cpp: the router).
#pragma once

#ifdef PRINTPRESS_VEC
#include <ATen/cpu/vec/functional.h>

#include <cstdint>

namespace printpress_softmax_row {

using Vec = at::vec::Vectorized<float>;

// The two exps ATen's softmax has used: Sleef's (`exp`) and ATen's own faster one (`exp_u20`).
enum class Exp { sleef, u20 };

template <Exp E>
inline Vec vec_exp(const Vec& x) {
  if constexpr (E == Exp::u20) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// ATen's _vec_softmax_lastdim for one row of n floats.
template <Exp E>
inline void softmax_row(const float* in, float* out, int64_t n) {
  const float max_input =
      at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, in, n);
  at::vec::map([max_input](Vec x) { return vec_exp<E>(x - Vec(max_input)); }, out, in, n);
  float sum = at::vec::reduce_all<float>([](Vec x, Vec y) { return x + y; }, out, n);
  sum = 1 / sum;
  at::vec::map([sum](Vec x) { return x * Vec(sum); }, out, out, n);
}

// softmax_row with the exp a form code names: 2 ATen's exp_u20, anything else Sleef's.
inline void softmax_row(int exp_code, const float* in, float* out, int64_t n) {
  if (exp_code == 2)
    softmax_row<Exp::u20>(in, out, n);
  else
    softmax_row<Exp::sleef>(in, out, n);
}

}  // namespace printpress_softmax_row
#endif
