// The CPU kernels of minivllm, registered as torch.ops.minivllm_cpu.* by torch_bindings.cpp.
// Each has the contract of the vLLM custom op of the same name (vLLM: csrc/cpu/*.cpp, csrc/ops.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu_utils.h"

namespace minivllm {

// out[query_rows[i]] = attention of query[query_rows[i]] over keys 0 .. seq_lens[i]-1 of request i, read through
// block_table[i]. query/out [tokens, num_heads, head_dim]; kv_cache [2, num_blocks, block_size, kv_heads, head_dim].
void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_rows,
                            double scale);

// Causal attention of prefill chunks: rows query_start[i] .. query_start[i] + query_lens[i] - 1 of request i, at
// positions context_lens[i] + 0, 1, ..., attend to keys 0 .. their own position, read through block_table[i].
// bfloat16 (builds with AVX512-BF16) or float32 (AVX2 and FMA, or AVX-512), head_dim 64 or 128
// (prefill_kernel_available(dtype)).
void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_lens,
                             const at::Tensor& context_lens, double scale);
bool prefill_kernel_available(c10::ScalarType dtype);

// out = x / sqrt(mean(x^2) + eps) * weight, per row of x [tokens, hidden].
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

// residual += x (rounded to the dtype, as a PyTorch add is), then x = rms_norm(residual), in place.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);

// out[t, i] = silu(x[t, i]) * x[t, d + i] for x [tokens, 2 d], out [tokens, d].
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// out [1, out_features] = x [1, in_features] @ weight [out_features, in_features]^T, all float32 or all bfloat16
// (batch-1 decode; bfloat16 summed in float32, rounded once).
void skinny_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight);

// out [rows, out_features] = x [rows, in_features] @ W^T, float32, W packed by pack_gemm_weight into panels of
// packed_gemm_panel_width() output columns ([panels, in_features, width]). Builds with AVX2 and FMA or AVX-512
// (packed_gemm_available()).
at::Tensor pack_gemm_weight(const at::Tensor& weight);
void packed_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed);
bool packed_gemm_available();
int64_t packed_gemm_panel_width();

// Rotates the first num_rotated heads of every row of qk [tokens, heads, head_dim] in place by the angles of
// positions [tokens], with full-width float32 tables cos/sin [max_position, head_dim] (NeoX half split).
void rotary_embedding(const at::Tensor& positions, at::Tensor& qk, int64_t num_rotated, const at::Tensor& cos,
                      const at::Tensor& sin);

}  // namespace minivllm
