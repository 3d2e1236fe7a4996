// Decode attention that reads the paged KV cache in place (vLLM: csrc/cpu/attention.cpp, paged_attention_v1;
// PagedAttention, Kwon et al., SOSP 2023, section 4.1).
//
// The PyTorch fast path (minivllm/attention/paged_attention.py) must first copy every decode request's keys and
// values out of their blocks into a padded batch, because a PyTorch matmul cannot follow a block table. Here each
// request walks its own block table: no copy, no padding, no mask.

#include "ops.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIVLLM_AVX512_BF16 1
#else
#define MINIVLLM_AVX512_BF16 0
#endif
// The float32 scores of a block of keys, one vector register per key then one transposing reduction: 16 keys with
// AVX-512, 8 with AVX2 (the width of one register); 0 where neither is compiled in.
#if defined(__AVX512F__)
#define MINIVLLM_F32_KEYS 16
#elif defined(__AVX2__) && defined(__FMA__)
#define MINIVLLM_F32_KEYS 8
#else
#define MINIVLLM_F32_KEYS 0
#endif

namespace minivllm {
namespace {

// q . k over one head: 16 running sums, one per vector lane, added up at the end. With HD a compile-time
// constant the loop unrolls into a few vector multiply-adds.
template <typename S, int HD>
inline float dot(const float* __restrict q, const typename S::storage* __restrict k, int64_t head_dim) {
  const int64_t D = HD > 0 ? HD : head_dim;
  if (HD > 0) {
    float acc[16] = {};
    for (int64_t d = 0; d < D; d += 16)
      for (int j = 0; j < 16; ++j) acc[j] += q[d + j] * S::load(k[d + j]);
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += acc[j];
    return s;
  }
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * S::load(k[d]);
  return s;
}

// krow[k] = the token row (all KV heads) of key k0 + k, for the KB keys a vector kernel reads at once; past the last
// key (k >= nk) the last one again, so that the kernel reads no row outside the request's blocks.
template <int KB, typename T>
inline void key_rows(const T* kv, const int64_t* blocks, int64_t block_size, int64_t token_stride, int64_t k0,
                     int64_t nk, const T** krow) {
  if (block_size % KB == 0) {  // the keys lie in one block
    const T* first = kv + (blocks[k0 / block_size] * block_size + k0 % block_size) * token_stride;
    for (int k = 0; k < KB; ++k) krow[k] = first + std::min<int64_t>(k, nk - 1) * token_stride;
    return;
  }
  for (int k = 0; k < KB; ++k) {
    const int64_t pos = k0 + std::min<int64_t>(k, nk - 1);
    krow[k] = kv + (blocks[pos / block_size] * block_size + pos % block_size) * token_stride;
  }
}

// Asks for n rows of a block, token_stride elements apart, to come into the L2 cache while the rows before them are
// computed on: one prefetch at each row's start (prefetcht1), the hardware prefetcher brings the rest of the row.
// Each request's blocks lie anywhere in the cache, and without this a block's first rows wait on memory: float32
// decode attention over 32 requests of 100-430 tokens in 30 layers, one thread, took 0.83-0.92x the time with this
// (blocks in order or shuffled), 0.96-0.97x in the engine's profile (minivllm/bench/OPTIMISATIONS.md, "Decode
// attention's next block asked for ahead"). A prefetch of every 64-byte line took 1.3-1.5x the time of none (blocks
// in order); one every 4 lines, or into L1 (prefetcht0), was slower than one per row.
template <typename T>
inline void prefetch_rows(const T* first, int64_t n, int64_t token_stride) {
  for (int64_t t = 0; t < n; ++t) __builtin_prefetch(first + t * token_stride, 0, 2);
}

// prefetch_rows for the rows of a request's block j that hold its first len tokens (none when the block is past
// them); kv points at the columns wanted of block 0's first row (keys or values, an item's KV heads).
template <typename T>
inline void prefetch_block(const T* kv, const int64_t* blocks, int64_t j, int64_t block_size, int64_t len,
                           int64_t token_stride) {
  if (j * block_size < len)
    prefetch_rows(kv + blocks[j] * block_size * token_stride, std::min(block_size, len - j * block_size),
                  token_stride);
}

// prefetch_rows for the KB keys after keys k0 .. k0 + KB - 1 (those below len), col elements into each token row.
template <int KB, typename T>
inline void prefetch_next_keys(const T* kv, const int64_t* blocks, int64_t block_size, int64_t token_stride,
                               int64_t k0, int64_t len, int64_t col) {
  if (k0 + KB >= len) return;
  const int64_t nn = std::min<int64_t>(KB, len - k0 - KB);
  const T* next[KB];
  key_rows<KB>(kv, blocks, block_size, token_stride, k0 + KB, nn, next);
  for (int64_t k = 0; k < nn; ++k) prefetch_rows(next[k] + col, 1, token_stride);
}

#if defined(__AVX512F__)
// v[k] -> the sum of v[k]'s 16 lanes, as lane k of the result: a transposing tree of 45 shuffles and adds instead
// of 16 horizontal reductions of about 10 operations each.
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's partial sums of v[4i .. 4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#endif

#if MINIVLLM_F32_KEYS == 8
// v[k] -> the sum of v[k]'s 8 lanes, as lane k of the result: three rounds of pairwise adds and one swap of the
// 128-bit halves, instead of 8 horizontal reductions.
inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per half: v[0..3] | v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if MINIVLLM_F32_KEYS > 0
// logits[qh][k0 + k] = q[qh] . key k for the keys k < nk <= MINIVLLM_F32_KEYS of one block and the query heads of one
// work item; q already scaled. The keys are read in memory order, row after row (so the hardware prefetcher
// streams the block), each (query head, key) product left as one register of partial sums in `part` (in L1 at
// this size: 9 query heads need 9 KiB with AVX-512, 32 would need 32); one transposing reduction per query head
// then turns a block's registers into its scores, instead of one horizontal reduction per score. krow[k]: key k's
// token row (all KV heads); a query head reads its KV head's columns.
template <int HD>
inline void scores_f32(const float* q, const float* const* krow, int64_t nk, int64_t qh_per_item, int64_t group,
                       int64_t h0, float* logits, int64_t max_len, int64_t k0, float* part) {
  constexpr int KB = MINIVLLM_F32_KEYS;
#if MINIVLLM_F32_KEYS == 16
  using V = __m512;
  auto load = [](const float* p) { return _mm512_loadu_ps(p); };
  auto mul = [](V a, V b) { return _mm512_mul_ps(a, b); };
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  auto store = [](float* p, V v) { _mm512_storeu_ps(p, v); };
#else
  using V = __m256;
  auto load = [](const float* p) { return _mm256_loadu_ps(p); };
  auto mul = [](V a, V b) { return _mm256_mul_ps(a, b); };
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  auto store = [](float* p, V v) { _mm256_storeu_ps(p, v); };
#endif
  for (int64_t k = 0; k < nk; ++k) {
    for (int64_t qh = 0; qh < qh_per_item; ++qh) {
      const float* kv = krow[k] + (h0 + qh / group) * HD;
      const float* qq = q + qh * HD;
      V acc = mul(load(qq), load(kv));
      for (int c = 1; c < HD / KB; ++c) acc = fma(load(qq + KB * c), load(kv + KB * c), acc);
      store(part + (qh * KB + k) * KB, acc);
    }
  }
  for (int64_t qh = 0; qh < qh_per_item; ++qh) {
    V v[KB];
    for (int k = 0; k < KB; ++k) v[k] = k < nk ? load(part + (qh * KB + k) * KB) : V{};
#if MINIVLLM_F32_KEYS == 16
    const __mmask16 keep = static_cast<__mmask16>(nk == 16 ? 0xFFFFu : (1u << nk) - 1u);
    _mm512_mask_storeu_ps(logits + qh * max_len + k0, keep, reduce16(v));
#else
    alignas(32) float sums[8];
    _mm256_store_ps(sums, reduce8(v));
    for (int64_t k = 0; k < nk; ++k) logits[qh * max_len + k0 + k] = sums[k];
#endif
  }
}
#endif

#if MINIVLLM_AVX512_BF16
// acc_out[g] = sum over keys 0 .. len-1 of p[g][key] * v[key] for the G query heads of one KV head, G and HD
// compile-time so that the G x HD / 16 accumulators can live in registers (up to 32: G <= 8 at HD 64, G <= 4 at
// HD 128; beyond that the compiler spills some), each value row widened to float32 once.
template <int HD, int G>
void values_bf16(const uint16_t* kv_values, const int64_t* blocks, int64_t block_size, int64_t token_stride,
                 const float* p, int64_t p_stride, int64_t len, float* acc_out) {
  __m512 acc[G][HD / 16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < HD / 16; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t pos = 0; pos < len; pos += block_size) {
    const uint16_t* vb = kv_values + blocks[pos / block_size] * block_size * token_stride;
    const int64_t n = std::min(block_size, len - pos);
    prefetch_block(kv_values, blocks, pos / block_size + 1, block_size, len, token_stride);
    for (int64_t t = 0; t < n; ++t) {
      __m512 v[HD / 16];
      for (int c = 0; c < HD / 16; ++c)
        v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vb + t * token_stride + 16 * c))), 16));
      for (int g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * p_stride + pos + t]);
        for (int c = 0; c < HD / 16; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(acc_out + g * HD + 16 * c, acc[g][c]);
}

// values_bf16 with the group size as a template argument; false when the group size has no instance.
template <int HD>
bool values_bf16_dispatch(int64_t group, const uint16_t* kv_values, const int64_t* blocks, int64_t block_size,
                          int64_t token_stride, const float* p, int64_t p_stride, int64_t len, float* acc_out) {
  switch (group) {
    case 1: values_bf16<HD, 1>(kv_values, blocks, block_size, token_stride, p, p_stride, len, acc_out); return true;
    case 2: values_bf16<HD, 2>(kv_values, blocks, block_size, token_stride, p, p_stride, len, acc_out); return true;
    case 3: values_bf16<HD, 3>(kv_values, blocks, block_size, token_stride, p, p_stride, len, acc_out); return true;
    case 4: values_bf16<HD, 4>(kv_values, blocks, block_size, token_stride, p, p_stride, len, acc_out); return true;
    case 8: values_bf16<HD, 8>(kv_values, blocks, block_size, token_stride, p, p_stride, len, acc_out); return true;
    default: return false;
  }
}
#endif

template <typename S, int HD>
inline void axpy(float* __restrict a, float p, const typename S::storage* __restrict v, int64_t head_dim) {
  const int64_t D = HD > 0 ? HD : head_dim;
  for (int64_t d = 0; d < D; ++d) a[d] += p * S::load(v[d]);
}

// HD: head_dim as a compile-time constant (a multiple of 16), or 0 for any head_dim.
template <typename S, int HD>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_rows,
                           double scale) {
  using T = typename S::storage;
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = query.stride(0), out_row_stride = out.stride(0);
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive tokens of one block
  const int64_t value_offset = num_blocks * block_size * token_stride;  // kv_cache[1] after kv_cache[0]
  const int64_t max_blocks = block_table.size(1), bt_stride = block_table.stride(0);

  const T* q_ptr = ptr<S>(query);
  const T* kv_ptr = ptr<S>(kv_cache);
  T* out_ptr = ptr<S>(out);
  const int64_t* bt_ptr = block_table.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  const int64_t* row_ptr = query_rows.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(len_ptr[r] >= 1 && len_ptr[r] <= max_blocks * block_size, "paged_attention_decode: seq_lens[", r,
                "] = ", len_ptr[r], " is outside 1..", max_blocks * block_size, " (block_table columns x block_size)");
    const int64_t* blocks = bt_ptr + r * bt_stride;
    for (int64_t j = 0; j < (len_ptr[r] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(blocks[j] >= 0 && blocks[j] < num_blocks, "paged_attention_decode: block_table[", r, ", ", j,
                  "] = ", blocks[j], " is outside 0..", num_blocks - 1);
    max_len = std::max(max_len, len_ptr[r]);
  }
  const float fscale = static_cast<float>(scale);

  // One work item = one request, or one (request, KV head) when there are too few requests to keep every thread
  // busy (batch 1). A whole request reads each block front to back: all KV heads of a token are adjacent. An item
  // writes its query heads' output once, at its end, so a helper can compute it aside and the items go to
  // run_items (thread_pool.h): with a CPU busy, a helper that the OS deschedules does not hold up the step.
  const int64_t threads = items_threads();
  const int64_t heads_per_item = num_reqs >= 4 * threads ? num_kv_heads : 1;
  const int64_t items_per_req = num_kv_heads / heads_per_item;
  const int64_t qh_per_item = heads_per_item * group;  // query heads of one item
  // One register wide (kLanes): a 16-lane GCC vector under AVX2 goes through the stack in 16-byte pieces.
  using VL = Lanes<kLanes>::f;
  const int64_t num_items = num_reqs * items_per_req;
  // On the helpers, the lengths, rows and block ids this call checked are owned by the items: a helper that finishes
  // after the call has returned must not read a block table the caller has since rewritten. On OpenMP's threads every
  // item is done before the call returns, and they read the tensors.
  std::shared_ptr<std::vector<int64_t>> own;
  int64_t bt_row = bt_stride;
  if (items_on_helpers(num_items)) {
    own = std::make_shared<std::vector<int64_t>>();
    own->reserve(num_reqs * (2 + max_blocks));
    own->insert(own->end(), len_ptr, len_ptr + num_reqs);
    own->insert(own->end(), row_ptr, row_ptr + num_reqs);
    for (int64_t r = 0; r < num_reqs; ++r)
      own->insert(own->end(), bt_ptr + r * bt_stride, bt_ptr + r * bt_stride + max_blocks);
    len_ptr = own->data();
    row_ptr = own->data() + num_reqs;
    bt_ptr = own->data() + 2 * num_reqs;
    bt_row = max_blocks;
  }
  auto items = std::make_shared<RedoableItems>();
  items->n = num_items;
  items->scratch_floats = (qh_per_item * head_dim * int64_t(sizeof(T)) + 3) / 4;  // one item's output, as T
  items->keep = {out, query, kv_cache, block_table, seq_lens, query_rows};
  items->commit = [=, own = own](int64_t item, const float* scratch) {
    const int64_t r = item / items_per_req, h0 = (item % items_per_req) * heads_per_item;
    const T* src = reinterpret_cast<const T*>(scratch);
    std::copy(src, src + qh_per_item * head_dim, out_ptr + row_ptr[r] * out_row_stride + h0 * group * head_dim);
  };
  items->compute = [=, own = own](int64_t item, float* scratch) {
    // Each thread's working memory, kept from one item to the next.
    thread_local std::vector<float> q, acc, logits, part;
    thread_local std::vector<VL> accl;
    q.resize(qh_per_item * head_dim);
    acc.resize(qh_per_item * head_dim);
    logits.resize(qh_per_item * max_len);
    accl.resize(HD > 0 ? qh_per_item * HD / kLanes : 0);
    part.resize(MINIVLLM_F32_KEYS > 0 ? qh_per_item * MINIVLLM_F32_KEYS * MINIVLLM_F32_KEYS : 0);
    {
      const int64_t r = item / items_per_req, h0 = (item % items_per_req) * heads_per_item;
      const int64_t len = len_ptr[r];
      const int64_t row = row_ptr[r];
      const int64_t* blocks = bt_ptr + r * bt_row;
      // This item's query heads are h0 * group .. (h0 + heads_per_item) * group - 1: adjacent in the query row.
      const T* q_raw = q_ptr + row * q_row_stride + h0 * group * head_dim;
      // Scores q . k for every key 0 .. len-1, block by block: logits[query head, pos].
#if MINIVLLM_AVX512_BF16
      if constexpr (std::is_same_v<S, BF16> && HD > 0 && HD % 32 == 0) {
        // 16 keys at a time: one vector of partial products per key (dpbf16), then one tree reduction.
        for (int64_t k0 = 0; k0 < len; k0 += 16) {
          const int64_t nk = std::min<int64_t>(16, len - k0);
          const T* krow[16];
          key_rows<16>(kv_ptr, blocks, block_size, token_stride, k0, nk, krow);
          prefetch_next_keys<16>(kv_ptr, blocks, block_size, token_stride, k0, len, h0 * HD);
          const __mmask16 keep = static_cast<__mmask16>(nk == 16 ? 0xFFFFu : (1u << nk) - 1u);
          for (int64_t qh = 0; qh < qh_per_item; ++qh) {
            const int64_t off = (h0 + qh / group) * HD;
            __m512bh qv[HD / 32];
            for (int c = 0; c < HD / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q_raw + qh * HD + 32 * c);
            __m512 acc[16];
#pragma GCC unroll 16
            for (int k = 0; k < 16; ++k) {
              acc[k] = _mm512_setzero_ps();
              for (int c = 0; c < HD / 32; ++c)
                acc[k] = _mm512_dpbf16_ps(acc[k], qv[c], (__m512bh)_mm512_loadu_si512(krow[k] + off + 32 * c));
            }
            _mm512_mask_storeu_ps(logits.data() + qh * max_len + k0, keep,
                                  _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(fscale)));
          }
        }
      } else
#endif
#if MINIVLLM_F32_KEYS > 0
      if constexpr (std::is_same_v<S, F32> && HD > 0 && HD % MINIVLLM_F32_KEYS == 0) {
        constexpr int KB = MINIVLLM_F32_KEYS;
        for (int64_t i = 0; i < qh_per_item * head_dim; ++i) q[i] = q_raw[i] * fscale;
        for (int64_t k0 = 0; k0 < len; k0 += KB) {
          const int64_t nk = std::min<int64_t>(KB, len - k0);
          const float* krow[KB];
          key_rows<KB>(kv_ptr, blocks, block_size, token_stride, k0, nk, krow);
          prefetch_next_keys<KB>(kv_ptr, blocks, block_size, token_stride, k0, len, h0 * HD);
          if (k0 + KB >= len)  // the last keys: the first value block next
            prefetch_block(kv_ptr + value_offset + h0 * head_dim, blocks, 0, block_size, len, token_stride);
          scores_f32<HD>(q.data(), krow, nk, qh_per_item, group, h0, logits.data(), max_len, k0, part.data());
        }
      } else
#endif
      {
        for (int64_t i = 0; i < qh_per_item * head_dim; ++i) q[i] = S::load(q_raw[i]) * fscale;
        for (int64_t pos = 0; pos < len; pos += block_size) {
          const T* k_block = kv_ptr + blocks[pos / block_size] * block_size * token_stride + h0 * head_dim;
          const int64_t n = std::min(block_size, len - pos);
          for (int64_t t = 0; t < n; ++t) {
            const T* k_tok = k_block + t * token_stride;
            for (int64_t qh = 0; qh < qh_per_item; ++qh) {
              const T* k = k_tok + (qh / group) * head_dim;
              logits[qh * max_len + pos + t] = dot<S, HD>(q.data() + qh * head_dim, k, head_dim);
            }
          }
        }
      }
      // Softmax per query head, in float32.
      for (int64_t qh = 0; qh < qh_per_item; ++qh) {
        float* l = logits.data() + qh * max_len;
        float m = l[0];
#pragma omp simd reduction(max : m)
        for (int64_t i = 1; i < len; ++i) m = m > l[i] ? m : l[i];
        // One register wide (kLanes, cpu_utils.h): without AVX-512 a 16-lane exp is lowered lane by lane.
        Lanes<kLanes>::f sumv = {};
        int64_t i = 0;
        for (; i + kLanes <= len; i += kLanes) {
          const Lanes<kLanes>::f e = vexpn<kLanes>(loadn<F32, kLanes>(l + i) - m);
          storen<F32, kLanes>(l + i, e);
          sumv += e;
        }
        float sum = 0.f;
        for (int j = 0; j < kLanes; ++j) sum += sumv[j];
        for (; i < len; ++i) {
          l[i] = vexp(l[i] - m);
          sum += l[i];
        }
        const float inv = 1.f / sum;
        for (i = 0; i < len; ++i) l[i] *= inv;
      }
      // Output = sum over keys of p * v, block by block.
      bool done = false;  // acc holds the output
#if MINIVLLM_AVX512_BF16
      if constexpr (std::is_same_v<S, BF16> && HD > 0 && HD % 32 == 0) {
        done = true;  // unless the group size has no compiled instance
        for (int64_t kh = 0; kh < heads_per_item && done; ++kh)
          done = values_bf16_dispatch<HD>(group, kv_ptr + value_offset + (h0 + kh) * HD, blocks, block_size,
                                          token_stride, logits.data() + kh * group * max_len, max_len, len,
                                          acc.data() + kh * group * HD);
      }
#endif
      if (!done) {
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(accl.begin(), accl.end(), VL{});
        for (int64_t pos = 0; pos < len; pos += block_size) {
          const T* v_block =
              kv_ptr + value_offset + blocks[pos / block_size] * block_size * token_stride + h0 * head_dim;
          const int64_t n = std::min(block_size, len - pos);
          prefetch_block(kv_ptr + value_offset + h0 * head_dim, blocks, pos / block_size + 1, block_size, len,
                         token_stride);
          for (int64_t t = 0; t < n; ++t) {
            for (int64_t kh = 0; kh < heads_per_item; ++kh) {
              const T* v_row = v_block + t * token_stride + kh * head_dim;
              if constexpr (HD > 0) {
                // The value row is widened to float32 once and used by every query head of the group.
                VL v[HD / kLanes];
                for (int c = 0; c < HD / kLanes; ++c) v[c] = loadn<S, kLanes>(v_row + kLanes * c);
                for (int64_t g = 0; g < group; ++g) {
                  const int64_t qh = kh * group + g;
                  const float p = logits[qh * max_len + pos + t];
                  for (int c = 0; c < HD / kLanes; ++c) accl[qh * (HD / kLanes) + c] += p * v[c];
                }
              } else {
                for (int64_t g = 0; g < group; ++g) {
                  const int64_t qh = kh * group + g;
                  axpy<S, HD>(acc.data() + qh * head_dim, logits[qh * max_len + pos + t], v_row, head_dim);
                }
              }
            }
          }
        }
        if constexpr (HD > 0)
          for (int64_t i = 0; i < qh_per_item * (HD / kLanes); ++i)
            for (int j = 0; j < kLanes; ++j) acc[i * kLanes + j] = accl[i][j];
      }
      T* dst = scratch ? reinterpret_cast<T*>(scratch) : out_ptr + row * out_row_stride + h0 * group * head_dim;
      for (int64_t i = 0; i < qh_per_item * head_dim; ++i) dst[i] = S::store(acc[i]);
    }
  };
  run_items(std::move(items));
}

}  // namespace

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_rows,
                            double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_attention_decode: query must be [tokens, num_heads, head_dim] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "paged_attention_decode: out must have query's shape with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention_decode: kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "paged_attention_decode: head_dim of query (", query.size(2),
              ") and kv_cache (", kv_cache.size(4), ") differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "paged_attention_decode: num_heads (", query.size(1),
              ") must be a multiple of num_kv_heads (", kv_cache.size(3), ")");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention_decode: query, out and kv_cache must share one dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.stride(1) == 1,
              "paged_attention_decode: block_table must be int64 [num_reqs, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.dim() == 1,
              "paged_attention_decode: seq_lens must be a contiguous int64 vector");
  TORCH_CHECK(query_rows.scalar_type() == at::kLong && query_rows.is_contiguous() &&
                  query_rows.numel() == seq_lens.numel() && block_table.size(0) == seq_lens.numel(),
              "paged_attention_decode: query_rows, seq_lens and block_table need one entry per request");
  std::vector<bool> taken(query.size(0), false);  // two requests writing one row would race
  for (int64_t i = 0; i < query_rows.numel(); ++i) {
    const int64_t row = query_rows.data_ptr<int64_t>()[i];
    TORCH_CHECK(row >= 0 && row < query.size(0), "paged_attention_decode: query_rows[", i, "] = ", row,
                " is outside 0..", query.size(0) - 1);
    TORCH_CHECK(!taken[row], "paged_attention_decode: query_rows[", i, "] = ", row, " appears twice");
    taken[row] = true;
  }
  dispatch_float_types("paged_attention_decode", query.scalar_type(), [&]<typename S>() {
    switch (query.size(2)) {
      case 64:
        decode_attention_impl<S, 64>(out, query, kv_cache, block_table, seq_lens, query_rows, scale);
        break;
      case 128:
        decode_attention_impl<S, 128>(out, query, kv_cache, block_table, seq_lens, query_rows, scale);
        break;
      default:
        decode_attention_impl<S, 0>(out, query, kv_cache, block_table, seq_lens, query_rows, scale);
    }
  });
}

}  // namespace minivllm
