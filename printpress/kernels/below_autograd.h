// `BelowAutograd` and `Below<F>::op`, shared by the kernels whose operators are registered without a dispatch key
// (layers.cpp, softmax.cpp): such an operator's ATen calls would each pass through autograd's kernel and the views-and-in-place
// one before their own. While gradients are off (the model calls these operators only so), the guard sends them
// below those keys: one dispatch each, and views made inside carry no autograd metadata (docs/benchmarks.md §6, "Below
// autograd's dispatch keys"). The same kernels, so the same numbers; tensors written in place inside (a cache's keys
// and values, fresh outputs) keep their version counters where they were, which nothing reads. With gradients on,
// everything dispatches as usual, so autograd records what it can.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>

#include <optional>

struct BelowAutograd {
  std::optional<at::AutoDispatchBelowADInplaceOrView> guard;
  BelowAutograd() {
    if (!at::GradMode::is_enabled()) guard.emplace();
  }
};

// The registered form of an operator F: F under one BelowAutograd, opened once per call from Python however many of
// the file's functions F calls (`m.def(schema, &Below<&f>::op)`).
template <auto F>
struct Below;
template <typename R, typename... Args, R (*F)(Args...)>
struct Below<F> {
  static R op(Args... args) {
    const BelowAutograd below;
    return F(args...);
  }
};
