// Small helpers shared by the CPU kernels of minivllm (the role of vLLM's csrc/cpu/cpu_types.hpp).
//
// The kernels are plain loops that the compiler vectorises (-O3 -march=native); they work on the raw storage
// (uint16_t for bfloat16) because the vectoriser gives up on c10::BFloat16's class methods.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>

#include <cmath>
#include <cstdint>

namespace minivllm {

// Type punning through a union (defined behaviour in GCC): GCC 12 vectorises loops over it, but not over
// std::bit_cast or memcpy.
union Bits {
  uint32_t u;
  float f;
};

// bfloat16 is the top half of a float32.
struct BF16 {
  using storage = uint16_t;
  static inline float load(uint16_t x) {
    Bits b;
    b.u = static_cast<uint32_t>(x) << 16;
    return b.f;
  }
  // Round to nearest even, NaN kept a NaN: what c10::BFloat16(float) and every PyTorch kernel do.
  static inline uint16_t store(float f) {
    Bits b;
    b.f = f;
    const uint32_t u = b.u;
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
  }
};

struct F32 {
  using storage = float;
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};

// Work items of uneven size (requests of different lengths) handed out one at a time to at::get_num_threads()
// workers: f(next) runs once per worker with its own scratch, and next() returns the next item, or -1 when none is
// left. at::parallel_for alone splits a range into equal contiguous chunks, so one thread could get all the long
// requests while the other idles.
template <typename F>
inline void parallel_for_dynamic(int64_t n, const F& f) {
  std::atomic<int64_t> counter{0};
  auto next = [&counter, n]() -> int64_t {
    const int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { f(next); });
}

template <typename S>
inline typename S::storage* ptr(const at::Tensor& t) {
  return reinterpret_cast<typename S::storage*>(t.data_ptr());
}

// Calls body.template operator()<S>() with S = BF16 or F32 after the tensor's dtype; raises for other dtypes.
template <typename Body>
inline void dispatch_float_types(const char* op, at::ScalarType dtype, Body&& body) {
  if (dtype == at::kBFloat16) {
    body.template operator()<BF16>();
  } else if (dtype == at::kFloat) {
    body.template operator()<F32>();
  } else {
    TORCH_CHECK(false, op, ": dtype must be bfloat16 or float32, got ", dtype);
  }
}

// 16 float32 lanes as a GCC/Clang vector type: written once, compiled to AVX-512, AVX2 or SSE after -march.
// Used where the auto-vectoriser gives up (GCC 12 will not vectorise a loop calling an exp written with
// conversions and selects).
typedef float vfloat16 __attribute__((vector_size(64)));
typedef int32_t vint16 __attribute__((vector_size(64)));
typedef uint32_t vuint16 __attribute__((vector_size(64)));
typedef uint16_t vhalf16 __attribute__((vector_size(32)));

template <typename S>
inline vfloat16 load16(const typename S::storage* p) {
  if constexpr (sizeof(typename S::storage) == 2) {
    vhalf16 h;
    __builtin_memcpy(&h, p, sizeof(h));
    return reinterpret_cast<vfloat16>(__builtin_convertvector(h, vuint16) << 16);  // bf16 -> f32 widening
  } else {
    vfloat16 f;
    __builtin_memcpy(&f, p, sizeof(f));
    return f;
  }
}

// Rounds each lane to the nearest bfloat16 value (kept as a float32).
inline vfloat16 round_to_bf16(vfloat16 f) {
  const vuint16 u = reinterpret_cast<vuint16>(f);
  const vuint16 rounded = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
  return reinterpret_cast<vfloat16>((u & 0x7FFFFFFFu) > 0x7F800000u ? u : rounded);
}

template <typename S>
inline void store16(typename S::storage* p, vfloat16 f) {
  if constexpr (sizeof(typename S::storage) == 2) {
    const vuint16 u = reinterpret_cast<vuint16>(f);
    const vuint16 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // BF16::store, lane by lane
    const vuint16 bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? vuint16{} + 0x7FC0u : rounded;
    const vhalf16 h = __builtin_convertvector(bits, vhalf16);
    __builtin_memcpy(p, &h, sizeof(h));
  } else {
    __builtin_memcpy(p, &f, sizeof(f));
  }
}

// exp of 16 float32 values. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial,
// 2^n through the exponent bits. Relative error about 2e-7 (1-2 ulp), enough for a softmax or a SiLU.
inline vfloat16 vexp16(vfloat16 x) {
  x = x < -87.0f ? vfloat16{} - 87.0f : x;
  x = x > 88.0f ? vfloat16{} + 88.0f : x;
  const vfloat16 t = x * 1.44269504088896341f + 0.5f;
  vint16 k = __builtin_convertvector(t, vint16);  // rounds toward zero ...
  k = __builtin_convertvector(k, vfloat16) > t ? k - 1 : k;  // ... so step down for negative t: floor(t)
  const vfloat16 n = __builtin_convertvector(k, vfloat16);
  vfloat16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vfloat16 p = vfloat16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<vfloat16>((k + 127) << 23);
}

// The same exp for one value (loop tails).
inline float vexp(float x) {
  vfloat16 v = {};
  v[0] = x;
  return vexp16(v)[0];
}

}  // namespace minivllm
