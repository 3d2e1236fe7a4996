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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

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

// N float32 lanes as a GCC/Clang vector type: written once, compiled to AVX-512, AVX2 or SSE after -march.
// Used where the auto-vectoriser gives up (GCC 12 will not vectorise a loop calling an exp written with
// conversions and selects). Without AVX-512, GCC lowers a 16-lane (64-byte) vector's compares and selects one lane
// at a time: a loop over such vectors runs several times slower than the same loop over 8 lanes, one AVX2 register
// (SiLU-and-mul in float32: minivllm/bench/OPTIMISATIONS.md, "Batch 1 on every thread"). kLanes is the width that
// maps onto one register of the CPU the kernels are built for; activation.cpp and the decode softmax in attention.cpp
// use it (the decode kernel's value sums too; its float32 scores use intrinsics, 16 or 8 keys at a time).
template <int N>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * N)));
  typedef int32_t i __attribute__((vector_size(4 * N)));
  typedef uint32_t u __attribute__((vector_size(4 * N)));
  typedef uint16_t h __attribute__((vector_size(2 * N)));
};
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

// One float32 vector register and the few operations the hand-blocked kernels (prefill attention's float32 build,
// packed_gemm) use, in intrinsics: their accumulators must stay in registers, which GCC's vector types do not
// guarantee once a loop is unrolled over an array of them. MINIVLLM_FMA_LANES: 16 with AVX-512, 8 with AVX2 and FMA,
// 0 where neither is compiled in (those kernels are then not built).
#if defined(__AVX512F__)
#define MINIVLLM_FMA_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define MINIVLLM_FMA_LANES 8
#else
#define MINIVLLM_FMA_LANES 0
#endif
#if MINIVLLM_FMA_LANES > 0
namespace reg {
#if MINIVLLM_FMA_LANES == 16
using Vec = __m512;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int L = MINIVLLM_FMA_LANES;
inline Vec zero() { return set1(0.f); }
}  // namespace reg
#endif

typedef Lanes<16>::f vfloat16;
typedef Lanes<16>::i vint16;
typedef Lanes<16>::u vuint16;
typedef Lanes<16>::h vhalf16;

template <typename S, int N = 16>
inline typename Lanes<N>::f loadn(const typename S::storage* p) {
  if constexpr (sizeof(typename S::storage) == 2) {
    typename Lanes<N>::h h;
    __builtin_memcpy(&h, p, sizeof(h));
    // bf16 -> f32 widening
    return reinterpret_cast<typename Lanes<N>::f>(__builtin_convertvector(h, typename Lanes<N>::u) << 16);
  } else {
    typename Lanes<N>::f f;
    __builtin_memcpy(&f, p, sizeof(f));
    return f;
  }
}

template <typename S>
inline vfloat16 load16(const typename S::storage* p) {
  return loadn<S, 16>(p);
}

// Rounds each lane to the nearest bfloat16 value (kept as a float32).
template <int N>
inline typename Lanes<N>::f round_to_bf16n(typename Lanes<N>::f f) {
  using U = typename Lanes<N>::u;
  const U u = reinterpret_cast<U>(f);
  const U rounded = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
  return reinterpret_cast<typename Lanes<N>::f>((u & 0x7FFFFFFFu) > 0x7F800000u ? u : rounded);
}

inline vfloat16 round_to_bf16(vfloat16 f) { return round_to_bf16n<16>(f); }

template <typename S, int N = 16>
inline void storen(typename S::storage* p, typename Lanes<N>::f f) {
  if constexpr (sizeof(typename S::storage) == 2) {
    using U = typename Lanes<N>::u;
    const U u = reinterpret_cast<U>(f);
    const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // BF16::store, lane by lane
    const U bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? U{} + 0x7FC0u : rounded;
    const typename Lanes<N>::h h = __builtin_convertvector(bits, typename Lanes<N>::h);
    __builtin_memcpy(p, &h, sizeof(h));
  } else {
    __builtin_memcpy(p, &f, sizeof(f));
  }
}

template <typename S>
inline void store16(typename S::storage* p, vfloat16 f) {
  storen<S, 16>(p, f);
}

// exp of N float32 values. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial,
// 2^n through the exponent bits. Relative error about 2e-7 (1-2 ulp), enough for a softmax or a SiLU.
template <int N>
inline typename Lanes<N>::f vexpn(typename Lanes<N>::f x) {
  using F = typename Lanes<N>::f;
  using I = typename Lanes<N>::i;
  x = x < -87.0f ? F{} - 87.0f : x;
  x = x > 88.0f ? F{} + 88.0f : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  I k = __builtin_convertvector(t, I);  // rounds toward zero ...
  k = __builtin_convertvector(k, F) > t ? k - 1 : k;  // ... so step down for negative t: floor(t)
  const F n = __builtin_convertvector(k, F);
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<F>((k + 127) << 23);
}

inline vfloat16 vexp16(vfloat16 x) { return vexpn<16>(x); }

// The same exp for one value (loop tails), one register wide.
inline float vexp(float x) {
  Lanes<kLanes>::f v = {};
  v[0] = x;
  return vexpn<kLanes>(v)[0];
}

}  // namespace minivllm
