// Rotary position embedding applied in place to the q and k heads of the fused qkv output (vLLM:
// csrc/cpu/pos_encoding.cpp, rotary_embedding). Same arithmetic as minivllm.model.llama._rotate:
// x * cos + rotate_half(x) * sin in float32 with the sign of rotate_half folded into the sine table, rounded
// once to the dtype (compiled without FMA contraction, so the two products round as PyTorch's do).

#include "ops.h"

// No fused multiply-adds in this file: each product and sum rounds as in PyTorch's separate operators.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

namespace minivllm {
namespace {

template <typename S>
void rotary_impl(const at::Tensor& positions, at::Tensor& qk, int64_t num_rotated, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t dim = qk.size(2), half = dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  using T = typename S::storage;
  T* xp = ptr<S>(qk);
  const int64_t ts = qk.stride(0);
  at::parallel_for(0, qk.size(0), 16, [&](int64_t b, int64_t e) {
    std::vector<float> x(dim);
    for (int64_t t = b; t < e; ++t) {
      const int64_t p = pos[t];
      const float* c = cp + p * dim;
      const float* s = sp + p * dim;
      for (int64_t h = 0; h < num_rotated; ++h) {
        T* row = xp + t * ts + h * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] = S::load(row[i]);
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i] * c[i];
          const float b2 = x[i + half] * s[i];
          row[i] = S::store(a + b2);
        }
        for (int64_t i = half; i < dim; ++i) {
          const float a = x[i] * c[i];
          const float b2 = x[i - half] * s[i];
          row[i] = S::store(a + b2);
        }
      }
    }
  });
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& qk, int64_t num_rotated, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "rotary_embedding: qk must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(qk.size(2) % 2 == 0, "rotary_embedding: head_dim must be even, got ", qk.size(2));
  TORCH_CHECK(num_rotated >= 0 && num_rotated <= qk.size(1), "rotary_embedding: num_rotated (", num_rotated,
              ") must be in 0..", qk.size(1));
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == qk.size(0),
              "rotary_embedding: positions must be a contiguous int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == qk.size(2) && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos and sin must be contiguous float32 [max_position, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)  // all positions checked before anything is rotated
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: position ", pos[t], " is outside 0..",
                cos.size(0) - 1);
  dispatch_float_types("rotary_embedding", qk.scalar_type(),
                       [&]<typename S>() { rotary_impl<S>(positions, qk, num_rotated, cos, sin); });
}

}  // namespace minivllm
