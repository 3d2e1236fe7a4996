// RMSNorm, alone and fused with the residual add before it (vLLM: csrc/cpu/layernorm.cpp, rms_norm and
// fused_add_rms_norm). The fused form reads and writes each row once instead of the six passes (add, cast, square,
// mean, scale, cast) of the PyTorch expression.

#include "ops.h"

// No fused multiply-adds in this file: each product and sum rounds as in PyTorch's separate operators.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace minivllm {
namespace {

// One row: out = x * rsqrt(mean(x^2) + eps) * w, the products in float32 like RMSNorm.forward.
template <typename S>
inline void norm_row(typename S::storage* out, const typename S::storage* x, const typename S::storage* w,
                     int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = S::load(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = S::store((S::load(x[i]) * r) * S::load(w[i]));
}

void check(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [tokens, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), op,
              ": weight must be a contiguous [hidden] vector with hidden = ", x.size(1));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight and x must share one dtype");
}

template <typename S>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, float eps) {
  using T = typename S::storage;
  const int64_t n = x.size(1);
  const T* xp = ptr<S>(x);
  const T* wp = ptr<S>(weight);
  T* op = ptr<S>(out);
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row<S>(op + t * os, xp + t * xs, wp, n, eps);
  });
}

template <typename S>
void fused_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps) {
  using T = typename S::storage;
  const int64_t n = x.size(1);
  T* xp = ptr<S>(x);
  T* rp = ptr<S>(residual);
  const T* wp = ptr<S>(weight);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* xr = xp + t * xs;
      T* rr = rp + t * rs;
      for (int64_t i = 0; i < n; ++i) rr[i] = S::store(S::load(rr[i]) + S::load(xr[i]));
      norm_row<S>(xr, rr, wp, n, eps);
    }
  });
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check("rms_norm", x, weight);
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1 && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must have x's shape and dtype");
  dispatch_float_types("rms_norm", x.scalar_type(),
                       [&]<typename S>() { rms_norm_impl<S>(out, x, weight, static_cast<float>(eps)); });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check("fused_add_rms_norm", x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must have x's shape and dtype");
  dispatch_float_types("fused_add_rms_norm", x.scalar_type(),
                       [&]<typename S>() { fused_impl<S>(x, residual, weight, static_cast<float>(eps)); });
}

}  // namespace minivllm
