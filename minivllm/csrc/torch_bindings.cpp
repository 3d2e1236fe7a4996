// Registers the kernels as PyTorch operators: torch.ops.minivllm_cpu.<name> (vLLM: csrc/cpu/torch_bindings.cpp).
// The "Tensor(a!)" annotations tell PyTorch which arguments an operator writes.

#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

TORCH_LIBRARY(minivllm_cpu, m) {
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_rows, float scale) -> ()");
  m.impl("paged_attention_decode", c10::DispatchKey::CPU, &minivllm::paged_attention_decode);
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor query_start, Tensor query_lens, Tensor context_lens, float scale) -> ()");
  m.impl("paged_attention_prefill", c10::DispatchKey::CPU, &minivllm::paged_attention_prefill);
  m.def("prefill_kernel_available(ScalarType dtype) -> bool", &minivllm::prefill_kernel_available);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &minivllm::rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &minivllm::fused_add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &minivllm::silu_and_mul);
  m.def("skinny_gemm(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.impl("skinny_gemm", c10::DispatchKey::CPU, &minivllm::skinny_gemm);
  m.def("pack_gemm_weight(Tensor weight) -> Tensor");
  m.impl("pack_gemm_weight", c10::DispatchKey::CPU, &minivllm::pack_gemm_weight);
  m.def("packed_gemm(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.impl("packed_gemm", c10::DispatchKey::CPU, &minivllm::packed_gemm);
  m.def("packed_gemm_available() -> bool", &minivllm::packed_gemm_available);
  m.def("set_redoable_threads(int n) -> ()", &minivllm::set_redoable_threads);
  m.def("redoable_threads() -> int", &minivllm::redoable_threads);
  m.def("redone_items() -> int", &minivllm::redone_items);
  m.def("helped_items() -> int", &minivllm::helped_items);
  m.def("set_helper_cpus(int[] cpus) -> ()", [](std::vector<int64_t> cpus) { minivllm::set_helper_cpus(cpus); });
  m.def("helper_cpus() -> int[]", &minivllm::helper_cpus);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) qk, int num_rotated, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &minivllm::rotary_embedding);
}
