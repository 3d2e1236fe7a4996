// A float32 or bfloat16 linear layer for one row of activations, y = W x, streaming the weight once. The role of
// vLLM 0.32's "skinny GEMMs" for a handful of activation rows, on ROCm only (wvSplitK in csrc/rocm/skinny_gemms.cu,
// chosen by rocm_unquantized_gemm_impl when VLLM_ROCM_USE_SKINNY_GEMM is set:
// https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/layers/utils.py#L288); vLLM's CPU build
// calls oneDNN for every row count instead (dispatch_cpu_unquantized_gemm, same file, L470), for SmolLM2's layers
// on this project's machines: its other paths there are zentorch's linear, where that package is installed, and
// SGL's packed kernel for small weights on CPUs with AMX.
//
// Where packed_gemm is built (AVX2 and FMA) one row goes to its panels instead, which stream the weight as fast and
// let the [out, in] weight be freed (minivllm/model/packed_linear.py, Linear.remove_weight); this kernel serves one
// row where packed_gemm is not built, or packing is switched off (MINIVLLM_ONEDNN_PACKING=0). In bfloat16 it takes
// every one-row product (minivllm/model/packed_linear.py, PackedWeight.set_kernels): oneDNN's bfloat16 matmul on the
// packed weight read SmolLM2's weights with one row at about 21 GB/s on two Zen 4 cores, this loop at 32-34, the
// machine's copy bandwidth (OPTIMISATIONS.md, "bfloat16 at batch 1").
//
// At batch 1 a decode step is a chain of matrix-vector products whose time is reading the weights from memory.
// MKL's sgemm with one row read them at about 12 GB/s with one thread or two, where the machine copies at 30
// (minivllm/bench/OPTIMISATIONS.md, "Batch 1 on every thread"); here the output rows are split across the threads
// and each thread reads its rows one after another, front to back: one sequential stream per thread, which the
// hardware prefetcher follows. Four rows read side by side (this kernel's first form) ran at half that speed on a
// 2-core AMD EPYC (Zen 4), 11-17 against 24-27 GB/s at one thread, with or without software prefetch
// (OPTIMISATIONS.md, "One stream per thread").

#include "ops.h"

#include <algorithm>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace minivllm {
namespace {

// 8 float32 lanes (cpu_utils.h): one AVX2 register; a whole AVX-512 register would buy nothing, as the loop waits
// on memory, not on arithmetic.
using vfloat8 = Lanes<8>::f;

constexpr int64_t kRows = 4;  // output rows per work item of parallel_for
constexpr int64_t kAcc = 4;   // independent accumulators per row, so that the adds do not wait on each other

// y = w . x for one row of k values (float32, or bfloat16 widened to float32), read front to back, summed in
// float32.
template <typename S>
inline float row_dot_lanes(const typename S::storage* __restrict w, const typename S::storage* __restrict x,
                           int64_t k) {
  vfloat8 a[kAcc];
  for (int64_t q = 0; q < kAcc; ++q) a[q] = vfloat8{};
  int64_t i = 0;
  for (; i + 8 * kAcc <= k; i += 8 * kAcc)
    for (int64_t q = 0; q < kAcc; ++q) a[q] += loadn<S, 8>(w + i + 8 * q) * loadn<S, 8>(x + i + 8 * q);
  for (; i + 8 <= k; i += 8) a[0] += loadn<S, 8>(w + i) * loadn<S, 8>(x + i);
  static_assert(kAcc == 4, "the sum below adds four accumulators");
  const vfloat8 s = (a[0] + a[1]) + (a[2] + a[3]);
  float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < k; ++i) sum += S::load(w[i]) * S::load(x[i]);
  return sum;
}

inline float row_dot(const float* __restrict w, const float* __restrict x, int64_t k) {
  return row_dot_lanes<F32>(w, x, k);
}

// bfloat16 weights and activations: products summed in float32, the result rounded to bfloat16 once (by the
// caller). With AVX512-BF16 each instruction multiplies 32 pairs and adds them pairwise into 16 float32 sums
// (vdpbf16ps, as the bfloat16 decode attention's scores); elsewhere row_dot_lanes widens them to float32.
inline float row_dot(const uint16_t* __restrict w, const uint16_t* __restrict x, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 a[kAcc];
  for (int64_t q = 0; q < kAcc; ++q) a[q] = _mm512_setzero_ps();
  auto pairs = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t i = 0;
  for (; i + 32 * kAcc <= k; i += 32 * kAcc)
    for (int64_t q = 0; q < kAcc; ++q) a[q] = _mm512_dpbf16_ps(a[q], pairs(w + i + 32 * q), pairs(x + i + 32 * q));
  for (; i + 32 <= k; i += 32) a[0] = _mm512_dpbf16_ps(a[0], pairs(w + i), pairs(x + i));
  if (i < k) {  // the last k % 32 values, the lanes past them zero
    const __mmask32 m = static_cast<__mmask32>((uint64_t(1) << (k - i)) - 1);
    a[1] = _mm512_dpbf16_ps(a[1], (__m512bh)_mm512_maskz_loadu_epi16(m, w + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(m, x + i));
  }
  static_assert(kAcc == 4, "the sum below adds four accumulators");
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
#else
  return row_dot_lanes<BF16>(w, x, k);
#endif
}

}  // namespace

void skinny_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "skinny_gemm: x, weight and out must be all float32 or all bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "skinny_gemm: weight must be a contiguous [out, in]");
  const int64_t k = weight.size(1), n_out = weight.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == k && x.stride(1) == 1,
              "skinny_gemm: x must be [1, in] with in = weight.size(1) = ", k, " and a contiguous row");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == 1 && out.size(1) == n_out && out.stride(1) == 1,
              "skinny_gemm: out must be [1, out] with out = weight.size(0) = ", n_out, " and a contiguous row");
  dispatch_float_types("skinny_gemm", dtype, [&]<typename S>() {
    const auto* w = ptr<S>(weight);
    const auto* xp = ptr<S>(x);
    auto* y = ptr<S>(out);
    const int64_t blocks = (n_out + kRows - 1) / kRows;
    // 64 rows at least per thread: below that a thread's start-up costs more than the rows it reads.
    at::parallel_for(0, blocks, 64 / kRows, [&](int64_t b, int64_t e) {
      const int64_t end = std::min(e * kRows, n_out);
      for (int64_t o = b * kRows; o < end; ++o) y[o] = S::store(row_dot(w + o * k, xp, k));
    });
  });
}

}  // namespace minivllm
