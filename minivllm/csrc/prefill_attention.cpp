// Causal attention of prefill chunks over the paged KV cache, tiled as in FlashAttention (Dao et al. 2022) but
// with an exact two-pass softmax per tile (all of a tile's scores fit in the cache at these lengths); vLLM's CPU
// backend: csrc/cpu/attention.cpp and the SDPA-based prefill of vllm/v1/attention/backends/cpu_attn.py.
//
// Each work item is a tile of up to 32 query positions of one request, for the `group` query heads of one KV head.
// Keys and values are read block by block through the request's block table (a chunk's earlier context included),
// so nothing is gathered; only blocks at or before the tile's last position are visited, so the masked upper
// triangle is skipped (PyTorch's CPU flash kernel computes whole 512-key blocks). Two builds of the same loops:
// bfloat16, whose Q.K^T and P.V use the AVX512-BF16 dot-product instruction on pairs; float32, with fused
// multiply-adds one vector register wide (16 lanes with AVX-512, 8 with AVX2), scores of a block of keys at once
// from keys transposed into columns, and P.V straight from the cache's rows.

#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIVLLM_PREFILL_KERNEL 1
#else
#define MINIVLLM_PREFILL_KERNEL 0
#endif
namespace minivllm {

bool prefill_kernel_available(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) return MINIVLLM_PREFILL_KERNEL;
  if (dtype == at::kFloat) return MINIVLLM_FMA_LANES > 0;
  return false;
}

namespace {

constexpr int kTile = 32;  // query positions per work item

struct Item {
  int64_t req, kv_head, tile_start, tile_len;
};

// The work items of a step, most keys first: handed out one at a time, the longest tiles start early and the threads
// finish together. *max_keys: the most keys any request attends to.
std::vector<Item> make_items(const std::vector<int64_t>& q_len, const std::vector<int64_t>& ctx_len,
                             int64_t num_kv_heads, int64_t* max_keys) {
  std::vector<Item> items;
  *max_keys = 0;
  for (size_t r = 0; r < q_len.size(); ++r) {
    *max_keys = std::max(*max_keys, ctx_len[r] + q_len[r]);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t s = 0; s < q_len[r]; s += kTile)
        items.push_back({int64_t(r), h, s, std::min<int64_t>(kTile, q_len[r] - s)});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return ctx_len[a.req] + a.tile_start > ctx_len[b.req] + b.tile_start;
  });
  return items;
}

// The rows of one work item, row i = (position i / group, query head i % group): qpos[i], its position in the
// request, and qrow[i], its query vector (q_req: the request's first query row, head_dim D elements per head).
template <typename T>
void tile_rows(const Item& item, int64_t ctx, int64_t group, int64_t D, const T* q_req, int64_t q_row_stride,
               int64_t* qpos, const T** qrow) {
  for (int64_t i = 0; i < item.tile_len * group; ++i) {
    const int64_t t = item.tile_start + i / group;
    qpos[i] = ctx + t;
    qrow[i] = q_req + t * q_row_stride + (item.kv_head * group + i % group) * D;
  }
}

}  // namespace

#if MINIVLLM_PREFILL_KERNEL
namespace {

constexpr int kKeys = 16;       // keys per block of the score computation: one 512-bit vector of scores
constexpr int kRowsAtOnce = 8;  // query rows whose Q.K^T runs interleaved (independent dependency chains)
constexpr int kPvRows = 4;      // query rows whose P.V runs together (4 x D/16 accumulators: 16 registers at D=64)

inline uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// D: head_dim (a multiple of 32). Two passes per tile, as the decode kernel: all scores of the tile's rows, then
// softmax, then P.V with P rounded to bfloat16 (as PyTorch's bf16 flash attention does for its second matmul).
template <int D>
void prefill_bf16(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const std::vector<int64_t>& q_start, const std::vector<int64_t>& q_len,
                  const std::vector<int64_t>& ctx_len, float scale) {
  const int64_t num_heads = query.size(1);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t value_offset = num_blocks * block_size * token_stride;
  const int64_t q_row_stride = query.stride(0), out_row_stride = out.stride(0), bt_stride = block_table.stride(0);
  const uint16_t* q_ptr = ptr<BF16>(query);
  const uint16_t* kv_ptr = ptr<BF16>(kv_cache);
  uint16_t* out_ptr = ptr<BF16>(out);
  const int64_t* bt_ptr = block_table.data_ptr<int64_t>();

  int64_t max_keys;
  const std::vector<Item> items = make_items(q_len, ctx_len, num_kv_heads, &max_keys);
  const int64_t keys_cap = (max_keys + kKeys - 1) / kKeys * kKeys;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  parallel_for_dynamic(int64_t(items.size()), [&](auto next_item) {
    const int64_t max_rows = kTile * group;
    std::vector<float> scores(max_rows * keys_cap);
    std::vector<uint16_t> probs(max_rows * keys_cap);  // bf16, two keys per 32-bit word
    std::vector<int64_t> qpos(max_rows);
    std::vector<const uint16_t*> qrow(max_rows);
    std::vector<float> inv_sum(max_rows);
    alignas(64) uint32_t kt[D / 2][kKeys];     // keys as bf16 pairs: kt[p][k] = (K[k][2p], K[k][2p+1])
    alignas(64) uint32_t vt[kKeys / 2][D];     // values as key pairs: vt[j][d] = (V[2j][d], V[2j+1][d])
    const uint16_t* krow[kKeys];
    for (int64_t it = next_item(); it >= 0; it = next_item()) {
      const Item& item = items[it];
      const int64_t ctx = ctx_len[item.req];
      const int64_t* blocks = bt_ptr + item.req * bt_stride;
      const int64_t n_rows = item.tile_len * group;
      tile_rows(item, ctx, group, D, q_ptr + q_start[item.req] * q_row_stride, q_row_stride, qpos.data(), qrow.data());
      const int64_t n_keys = ctx + item.tile_start + item.tile_len;  // keys 0 .. the tile's last position
      const int64_t n_keys_padded = (n_keys + kKeys - 1) / kKeys * kKeys;
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

      // Pass 1: scores[i][k] = scale * q_i . k_k, -inf where k is in row i's future.
      for (int64_t k0 = 0; k0 < n_keys; k0 += kKeys) {
        const int64_t nk = std::min<int64_t>(kKeys, n_keys - k0);
        for (int64_t k = 0; k < nk; ++k) {
          const int64_t pos = k0 + k;
          krow[k] = kv_ptr + (blocks[pos / block_size] * block_size + pos % block_size) * token_stride +
                    item.kv_head * D;
        }
        for (int p = 0; p < D / 2; ++p)
          for (int64_t k = 0; k < kKeys; ++k) kt[p][k] = k < nk ? pair(krow[k][2 * p], krow[k][2 * p + 1]) : 0u;
        const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(int32_t(k0)), lane);
        for (int64_t i0 = 0; i0 < n_rows; i0 += kRowsAtOnce) {
          const int64_t nr = std::min<int64_t>(kRowsAtOnce, n_rows - i0);
          // Rows past the tile repeat its last row (results dropped): no branch in the loop, so the
          // accumulators stay in registers.
          const uint16_t* qr[kRowsAtOnce];
          #pragma GCC unroll 32
          for (int r = 0; r < kRowsAtOnce; ++r) qr[r] = qrow[i0 + std::min<int64_t>(r, nr - 1)];
          __m512 s[kRowsAtOnce];
          #pragma GCC unroll 32
          for (int r = 0; r < kRowsAtOnce; ++r) s[r] = _mm512_setzero_ps();
          #pragma GCC unroll 32
          for (int p = 0; p < D / 2; ++p) {
            const __m512bh kv = (__m512bh)_mm512_load_si512(kt[p]);
            #pragma GCC unroll 32
            for (int r = 0; r < kRowsAtOnce; ++r) {
              uint32_t w;
              __builtin_memcpy(&w, qr[r] + 2 * p, 4);
              s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(int32_t(w)), kv);
            }
          }
          for (int r = 0; r < nr; ++r) {
            const int64_t i = i0 + r;
            const __mmask16 valid = _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(int32_t(qpos[i])));
            _mm512_storeu_ps(scores.data() + i * keys_cap + k0,
                             _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), valid,
                                                _mm512_mul_ps(s[r], _mm512_set1_ps(scale))));
          }
        }
      }
      // Softmax per row (float32), probabilities rounded to bf16; keys past the row's position get 0.
      for (int64_t i = 0; i < n_rows; ++i) {
        float* sr = scores.data() + i * keys_cap;
        __m512 mx = _mm512_set1_ps(neg_inf);
        for (int64_t k = 0; k < n_keys_padded; k += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + k));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));  // finite: key 0 is always visible
        __m512 sum = _mm512_setzero_ps();
        uint16_t* pr = probs.data() + i * keys_cap;
        for (int64_t k = 0; k < n_keys_padded; k += 16) {
          const __m512 x = _mm512_loadu_ps(sr + k);
          const __mmask16 visible = _mm512_cmp_ps_mask(x, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
          const __m512 e = _mm512_maskz_mov_ps(visible, (__m512)vexp16((vfloat16)_mm512_sub_ps(x, m)));
          const __m512 eb = (__m512)round_to_bf16((vfloat16)e);  // sum what P.V will use
          sum = _mm512_add_ps(sum, eb);
          store16<BF16>(pr + k, (vfloat16)eb);
        }
        inv_sum[i] = 1.f / _mm512_reduce_add_ps(sum);
      }
      // Pass 2: out_i = sum_k p_ik v_k / sum_k p_ik, kPvRows rows at a time with dpbf16 over key pairs.
      for (int64_t i0 = 0; i0 < n_rows; i0 += kPvRows) {
        const int64_t nr = std::min<int64_t>(kPvRows, n_rows - i0);
        __m512 acc[kPvRows][D / 16];
        #pragma GCC unroll 32
        for (int r = 0; r < kPvRows; ++r)
          #pragma GCC unroll 32
          for (int c = 0; c < D / 16; ++c) acc[r][c] = _mm512_setzero_ps();
        // Only keys up to the last row's position matter (rows of one tile grow by one position each).
        const int64_t last = qpos[i0 + nr - 1] + 1;
        for (int64_t k0 = 0; k0 < last; k0 += kKeys) {
          const int64_t nk = std::min<int64_t>(kKeys, n_keys - k0);
          for (int64_t k = 0; k < kKeys; ++k) {
            if (k < nk) {
              const int64_t pos = k0 + k;
              krow[k] = kv_ptr + value_offset +
                        (blocks[pos / block_size] * block_size + pos % block_size) * token_stride + item.kv_head * D;
            } else {
              krow[k] = nullptr;
            }
          }
          for (int j = 0; j < kKeys / 2; ++j) {
            const uint16_t* a = krow[2 * j];
            const uint16_t* b = krow[2 * j + 1];
            for (int d = 0; d < D; ++d) vt[j][d] = pair(a ? a[d] : 0, b ? b[d] : 0);
          }
          const uint16_t* pr[kPvRows];  // rows past the tile repeat its last row, as in pass 1
          #pragma GCC unroll 32
          for (int r = 0; r < kPvRows; ++r) pr[r] = probs.data() + (i0 + std::min<int64_t>(r, nr - 1)) * keys_cap + k0;
          #pragma GCC unroll 32
          for (int j = 0; j < kKeys / 2; ++j) {
            __m512bh pb[kPvRows];
            #pragma GCC unroll 32
            for (int r = 0; r < kPvRows; ++r) {
              uint32_t w;
              __builtin_memcpy(&w, pr[r] + 2 * j, 4);
              pb[r] = (__m512bh)_mm512_set1_epi32(int32_t(w));
            }
            #pragma GCC unroll 32
            for (int c = 0; c < D / 16; ++c) {
              const __m512bh v = (__m512bh)_mm512_load_si512(&vt[j][16 * c]);
              #pragma GCC unroll 32
              for (int r = 0; r < kPvRows; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb[r], v);
            }
          }
        }
        for (int r = 0; r < nr; ++r) {
          const int64_t i = i0 + r;
          const int64_t t = item.tile_start + i / group;
          uint16_t* dst = out_ptr + (q_start[item.req] + t) * out_row_stride + (item.kv_head * group + i % group) * D;
          #pragma GCC unroll 32
          for (int c = 0; c < D / 16; ++c)
            store16<BF16>(dst + 16 * c, (vfloat16)_mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv_sum[i])));
        }
      }
    }
  });
}

}  // namespace
#endif

#if MINIVLLM_FMA_LANES > 0
namespace {

using reg::L;
using reg::Vec;

// Q.K^T: kF32Rows rows against the L keys of one block at a time, one accumulator register per row (independent chains)
// fed by one column of keys and kF32Rows broadcast query elements per step of d. P.V: kF32PvRows rows by kF32PvCols
// column vectors of accumulators per pass over the keys: 16 registers with AVX-512 (4 rows x 4), 12 with AVX2 (3 x 4,
// which with the 4 value vectors fills its 16 registers, so GCC reloads a value vector or the broadcast from L1 where
// it runs out). Chosen by timing SmolLM2's first prefill step (OPTIMISATIONS.md): 6 rows with AVX-512 and 2 with AVX2
// were slower.
constexpr int kF32Rows = 8;
constexpr int kF32PvRows = L == 16 ? 4 : 3;
constexpr int kF32PvCols = 4;

// D: head_dim (a multiple of 4 L). Two passes per tile, as the bfloat16 kernel: scores of the tile's rows, softmax
// (float32 throughout; the sum is of the probabilities P.V uses), then P.V, normalised at the end.
template <int D>
void prefill_f32(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                 const std::vector<int64_t>& q_start, const std::vector<int64_t>& q_len,
                 const std::vector<int64_t>& ctx_len, float scale) {
  static_assert(D % (kF32PvCols * L) == 0, "head_dim must be a multiple of 4 vector registers");
  const int64_t num_heads = query.size(1);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t value_offset = num_blocks * block_size * token_stride;
  const int64_t q_row_stride = query.stride(0), out_row_stride = out.stride(0), bt_stride = block_table.stride(0);
  const float* q_ptr = query.data_ptr<float>();
  const float* kv_ptr = kv_cache.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t* bt_ptr = block_table.data_ptr<int64_t>();

  int64_t max_keys;
  const std::vector<Item> items = make_items(q_len, ctx_len, num_kv_heads, &max_keys);
  const int64_t keys_cap = (max_keys + L - 1) / L * L;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  parallel_for_dynamic(int64_t(items.size()), [&](auto next_item) {
    const int64_t max_rows = kTile * group;
    std::vector<float> probs(max_rows * keys_cap);  // scores, then (in place) unnormalised probabilities
    std::vector<int64_t> qpos(max_rows);
    std::vector<const float*> qrow(max_rows);
    std::vector<float> inv_sum(max_rows);
    alignas(64) float kt[D][L];  // one block of keys as columns: kt[d][k] = K[k][d]
    for (int64_t it = next_item(); it >= 0; it = next_item()) {
      const Item& item = items[it];
      const int64_t ctx = ctx_len[item.req];
      const int64_t* blocks = bt_ptr + item.req * bt_stride;
      const int64_t n_rows = item.tile_len * group;
      tile_rows(item, ctx, group, D, q_ptr + q_start[item.req] * q_row_stride, q_row_stride, qpos.data(), qrow.data());
      const int64_t n_keys = ctx + item.tile_start + item.tile_len;  // keys 0 .. the tile's last position
      const int64_t n_keys_padded = (n_keys + L - 1) / L * L;
      auto key_row = [&](int64_t pos) {  // key `pos`'s head_dim values of this KV head (values: + value_offset)
        return kv_ptr + (blocks[pos / block_size] * block_size + pos % block_size) * token_stride + item.kv_head * D;
      };

      // Pass 1: probs[i][k] = scale * q_i . k_k, -inf where k is in row i's future (and in the last block's padding).
      using VL = Lanes<L>::f;  // the same register as Vec, with GCC's vector operators
      VL iota;
      for (int k = 0; k < L; ++k) iota[k] = float(k);
      for (int64_t k0 = 0; k0 < n_keys; k0 += L) {
        const int64_t nk = std::min<int64_t>(L, n_keys - k0);
        for (int64_t k = 0; k < L; ++k) {
          const float* kr = key_row(k0 + std::min(k, nk - 1));  // past the keys: the last one again (masked below)
          for (int d = 0; d < D; ++d) kt[d][k] = kr[d];
        }
        for (int64_t i0 = 0; i0 < n_rows; i0 += kF32Rows) {
          const int64_t nr = std::min<int64_t>(kF32Rows, n_rows - i0);
          if (k0 > qpos[i0 + nr - 1]) {  // the whole block is in these rows' future
            for (int64_t r = 0; r < nr; ++r) reg::store(probs.data() + (i0 + r) * keys_cap + k0, reg::set1(neg_inf));
            continue;
          }
          // Rows past the tile repeat its last row (results dropped): no branch in the loop, so the accumulators
          // stay in registers.
          const float* qr[kF32Rows];
          #pragma GCC unroll 8
          for (int r = 0; r < kF32Rows; ++r) qr[r] = qrow[i0 + std::min<int64_t>(r, nr - 1)];
          Vec s[kF32Rows];
          #pragma GCC unroll 8
          for (int r = 0; r < kF32Rows; ++r) s[r] = reg::zero();
          #pragma GCC unroll 4
          for (int d = 0; d < D; ++d) {
            const Vec kd = reg::load(kt[d]);
            #pragma GCC unroll 8
            for (int r = 0; r < kF32Rows; ++r) s[r] = reg::fma(reg::set1(qr[r][d]), kd, s[r]);
          }
          // Through memory with constant indices: indexing s by the run-time row count would keep the
          // accumulators on the stack for the whole loop.
          alignas(64) float sres[kF32Rows][L];
          #pragma GCC unroll 8
          for (int r = 0; r < kF32Rows; ++r) reg::store(sres[r], s[r]);
          for (int64_t r = 0; r < nr; ++r) {
            const VL visible = VL{} + float(std::min<int64_t>(qpos[i0 + r] - k0 + 1, nk));  // keys k0 .. k0 + it - 1
            const VL x = loadn<F32, L>(sres[r]) * scale;
            storen<F32, L>(probs.data() + (i0 + r) * keys_cap + k0, iota < visible ? x : VL{} + neg_inf);
          }
        }
      }
      // Softmax per row (float32), one register wide (cpu_utils.h's exp); keys past the row's position get 0.
      for (int64_t i = 0; i < n_rows; ++i) {
        float* pr = probs.data() + i * keys_cap;
        VL mx = VL{} + neg_inf;
        for (int64_t k = 0; k < n_keys_padded; k += L) {
          const VL x = loadn<F32, L>(pr + k);
          mx = x > mx ? x : mx;
        }
        float m = neg_inf;
        for (int j = 0; j < L; ++j) m = std::max(m, mx[j]);  // finite: key 0 is always visible
        VL sum = {};
        for (int64_t k = 0; k < n_keys_padded; k += L) {
          const VL x = loadn<F32, L>(pr + k);
          const VL e = x == neg_inf ? VL{} : vexpn<L>(x - m);
          sum += e;
          storen<F32, L>(pr + k, e);
        }
        float total = 0.f;
        for (int j = 0; j < L; ++j) total += sum[j];
        inv_sum[i] = 1.f / total;
      }
      // Pass 2: out_i = sum_k p_ik v_k / sum_k p_ik, kF32PvRows rows by kF32PvCols column vectors per pass over the
      // keys, each value row read in place from its block.
      for (int64_t i0 = 0; i0 < n_rows; i0 += kF32PvRows) {
        const int64_t nr = std::min<int64_t>(kF32PvRows, n_rows - i0);
        const float* pr[kF32PvRows];  // rows past the tile repeat its last row, as in pass 1
        #pragma GCC unroll 4
        for (int r = 0; r < kF32PvRows; ++r) pr[r] = probs.data() + (i0 + std::min<int64_t>(r, nr - 1)) * keys_cap;
        // Only keys up to the last row's position matter (rows of one tile grow by one position each).
        const int64_t last = qpos[i0 + nr - 1] + 1;
        for (int c0 = 0; c0 < D; c0 += kF32PvCols * L) {
          Vec acc[kF32PvRows][kF32PvCols];
          #pragma GCC unroll 4
          for (int r = 0; r < kF32PvRows; ++r)
            #pragma GCC unroll 4
            for (int c = 0; c < kF32PvCols; ++c) acc[r][c] = reg::zero();
          for (int64_t b0 = 0; b0 < last; b0 += block_size) {  // one block of the request at a time
            const float* vb = kv_ptr + value_offset + blocks[b0 / block_size] * block_size * token_stride +
                              item.kv_head * D + c0;
            const int64_t nb = std::min(block_size, last - b0);
            for (int64_t t = 0; t < nb; ++t) {
              const float* v = vb + t * token_stride;
              Vec vv[kF32PvCols];
              #pragma GCC unroll 4
              for (int c = 0; c < kF32PvCols; ++c) vv[c] = reg::load(v + c * L);
              #pragma GCC unroll 4
              for (int r = 0; r < kF32PvRows; ++r) {
                const Vec p = reg::set1(pr[r][b0 + t]);
                #pragma GCC unroll 4
                for (int c = 0; c < kF32PvCols; ++c) acc[r][c] = reg::fma(p, vv[c], acc[r][c]);
              }
            }
          }
          alignas(64) float ares[kF32PvRows][kF32PvCols * L];  // as sres in pass 1
          #pragma GCC unroll 4
          for (int r = 0; r < kF32PvRows; ++r)
            #pragma GCC unroll 4
            for (int c = 0; c < kF32PvCols; ++c) reg::store(ares[r] + c * L, acc[r][c]);
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t i = i0 + r;
            const int64_t t = item.tile_start + i / group;
            float* dst =
                out_ptr + (q_start[item.req] + t) * out_row_stride + (item.kv_head * group + i % group) * D + c0;
            for (int c = 0; c < kF32PvCols; ++c)
              storen<F32, L>(dst + c * L, loadn<F32, L>(ares[r] + c * L) * inv_sum[i]);
          }
        }
      }
    }
  });
}

}  // namespace
#endif

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_lens,
                             const at::Tensor& context_lens, double scale) {
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && kv_cache.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "paged_attention_prefill: query, out and kv_cache must be all bfloat16 or all float32");
  TORCH_CHECK(prefill_kernel_available(dtype), "paged_attention_prefill: this build has no ", dtype,
              " kernel (bfloat16 needs AVX512-BF16, float32 AVX2 and FMA; check "
              "custom_ops.prefill_kernel_available(dtype) first)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_attention_prefill: query must be [tokens, num_heads, head_dim] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2) &&
                  out.stride(0) >= out.size(1) * out.size(2),
              "paged_attention_prefill: out must have query's shape with contiguous heads and rows that do not "
              "overlap");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() && kv_cache.size(2) > 0 &&
                  kv_cache.size(3) > 0 && kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "paged_attention_prefill: kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_dim] "
              "matching query");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128, "paged_attention_prefill: head_dim must be 64 or 128, got ",
              query.size(2));
  const int64_t n = query_lens.numel();
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) == n,
              "paged_attention_prefill: block_table must be int64 [num_reqs, max_blocks] with contiguous rows");
  for (const at::Tensor* t : {&query_start, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "paged_attention_prefill: query_start, query_lens and context_lens need one int64 per request");
  std::vector<int64_t> qs(query_start.data_ptr<int64_t>(), query_start.data_ptr<int64_t>() + n);
  std::vector<int64_t> ql(query_lens.data_ptr<int64_t>(), query_lens.data_ptr<int64_t>() + n);
  std::vector<int64_t> cl(context_lens.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>() + n);
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(1);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t r = 0; r < n; ++r) ranges.push_back({qs[r], qs[r] + ql[r]});
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)  // two requests writing one row would race
    TORCH_CHECK(ranges[i].first >= ranges[i - 1].second, "paged_attention_prefill: query rows of two requests overlap at row ",
                ranges[i].first);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(ql[r] >= 1 && cl[r] >= 0 && qs[r] >= 0 && qs[r] + ql[r] <= query.size(0),
                "paged_attention_prefill: request ", r, " has query rows ", qs[r], "..", qs[r] + ql[r] - 1,
                " outside 0..", query.size(0) - 1, " or a negative context");
    const int64_t nblk = (cl[r] + ql[r] + block_size - 1) / block_size;
    TORCH_CHECK(nblk <= block_table.size(1), "paged_attention_prefill: request ", r, " needs ", nblk,
                " blocks, block_table has ", block_table.size(1));
    for (int64_t j = 0; j < nblk; ++j) {
      const int64_t b = block_table.data_ptr<int64_t>()[r * block_table.stride(0) + j];
      TORCH_CHECK(b >= 0 && b < num_blocks, "paged_attention_prefill: block_table[", r, ", ", j, "] = ", b,
                  " is outside 0..", num_blocks - 1);
    }
  }
#if MINIVLLM_PREFILL_KERNEL
  if (dtype == at::kBFloat16) {
    if (query.size(2) == 64)
      prefill_bf16<64>(out, query, kv_cache, block_table, qs, ql, cl, static_cast<float>(scale));
    else
      prefill_bf16<128>(out, query, kv_cache, block_table, qs, ql, cl, static_cast<float>(scale));
  }
#endif
#if MINIVLLM_FMA_LANES > 0
  if (dtype == at::kFloat) {
    if (query.size(2) == 64)
      prefill_f32<64>(out, query, kv_cache, block_table, qs, ql, cl, static_cast<float>(scale));
    else
      prefill_f32<128>(out, query, kv_cache, block_table, qs, ql, cl, static_cast<float>(scale));
  }
#endif
}

}  // namespace minivllm
