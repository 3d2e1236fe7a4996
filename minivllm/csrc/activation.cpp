// SwiGLU's activation in one pass: silu(gate) * up (vLLM: csrc/cpu/activation.cpp, silu_and_mul). PyTorch runs it
// as two kernels and a temporary ([tokens, intermediate] for silu, then the product).

#include "ops.h"

// No fused multiply-adds in this file: each product and sum rounds as in PyTorch's separate operators.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace minivllm {
namespace {

// One row of d outputs; a plain function of raw pointers so that the loop vectorises.
template <typename S>
inline float silu_mul_one(float g, float u) {
  // Rounded to the dtype before the product, as F.silu(gate) * up rounds its intermediate.
  const float s = S::load(S::store(g / (1.f + vexp(-g))));
  return s * u;
}

// One row of d outputs, kLanes at a time (one register: 16 lanes with AVX-512, 8 with AVX2, see cpu_utils.h).
template <typename S>
void silu_and_mul_row(typename S::storage* __restrict out, const typename S::storage* __restrict gate,
                      const typename S::storage* __restrict up, int64_t d) {
  using V = Lanes<kLanes>::f;
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const V g = loadn<S, kLanes>(gate + i);
    V s = g / (1.f + vexpn<kLanes>(-g));
    if constexpr (sizeof(typename S::storage) == 2) s = round_to_bf16n<kLanes>(s);  // as the bf16 F.silu output is
    storen<S, kLanes>(out + i, s * loadn<S, kLanes>(up + i));
  }
  for (; i < d; ++i) out[i] = S::store(silu_mul_one<S>(S::load(gate[i]), S::load(up[i])));
}

template <typename S>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  using T = typename S::storage;
  const int64_t d = out.size(1);
  const T* xp = ptr<S>(x);
  T* op = ptr<S>(out);
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, x.size(0), 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_and_mul_row<S>(op + t * os, xp + t * xs, xp + t * xs + d, d);
  });
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [tokens, 2 * d] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1),
              "silu_and_mul: out must be [tokens, d] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: out and x must share one dtype");
  dispatch_float_types("silu_and_mul", x.scalar_type(), [&]<typename S>() { silu_and_mul_impl<S>(out, x); });
}

}  // namespace minivllm
