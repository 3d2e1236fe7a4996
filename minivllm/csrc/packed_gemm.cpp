// A float32 linear layer, y = x W^T, for one row of activations and more, on a weight packed once into column panels:
// the blocked outer-product scheme of BLIS and GotoBLAS (Goto and van de Geijn, "Anatomy of high-performance matrix
// multiplication", TOMS 2008, section 5), one register tile of MR rows by NR output columns. vLLM 0.32's CPU build
// multiplies float32 with oneDNN on a weight packed at load time (dispatch_cpu_unquantized_gemm,
// vllm/model_executor/layers/utils.py L470), which minivllm did too until this kernel: at the 8-32 rows of a decode
// step this loop takes 0.64-0.83x oneDNN's time for SmolLM2's projections on two Zen 4 cores (0.81-0.92x built for
// AVX2), and is level with it up to 2048 rows (minivllm/bench/OPTIMISATIONS.md, "Float32 prefill attention and a
// packed GEMM").
//
// Layout: panel j holds output columns j*NR .. j*NR+NR-1 as [K][NR] (zeros past the last column), so the inner loop
// reads NR consecutive floats per k. A work item is a run of panels by a block of up to 128 rows (all rows of a
// decode step), each panel multiplied by the block's rows before the next: the panel comes from memory once (decode
// steps stream the weights) and from the L2 cache for the other row tiles. The items go to run_items (thread_pool.h):
// with a CPU busy, a helper thread that the OS deschedules in the middle of one does not hold up the call. Per k, a
// tile loads NR / L vectors of the panel, broadcasts MR activations and makes MR * NR / L fused multiply-adds into
// MR * NR / L accumulator registers: 24 with AVX-512 (12 x 32), 12 with AVX2 (6 x 16, of its 16).
// One row (a batch-1 decode step) takes two panels at a time: on a 2-core Zen 4, SmolLM2's 30 layers and LM head
// (random weights) took 0.83-0.99x skinny_gemm's time that way (AVX-512 and AVX2 builds, one and two threads),
// 0.86-1.07x one panel at a time; on the loaded weights, both on huge pages, 0.91-1.06x (minivllm/bench/
// OPTIMISATIONS.md, "The float32 weights held once"). So the [out, in] weight can be freed.

#include "ops.h"
#include "thread_pool.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace minivllm {

#if MINIVLLM_FMA_LANES > 0
namespace {

using reg::L;
using reg::Vec;
constexpr int NR = 2 * L;               // output columns per panel: two registers
constexpr int MR = L == 16 ? 12 : 6;    // activation rows per register tile

// y[r][0 .. ncols-1] = sum_k x[r][k] * panel[k][.] for the R <= MR rows of one tile; with `next`, also asks for
// the next panel's lines, one per k, into the L2 cache (prefetch_next_panel).
template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy, int64_t ncols,
                 const float* next) {
  Vec acc[R][2];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = reg::zero();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (L == 8) {  // the AVX2 build only (prefetch_next_panel): there a k's NR = 16 floats are one line
      if (next) __builtin_prefetch(next + k * NR, 0, 2);
    }
    const Vec b0 = reg::load(panel + k * NR), b1 = reg::load(panel + k * NR + L);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a = reg::set1(x[r * ldx + k]);
      acc[r][0] = reg::fma(a, b0, acc[r][0]);
      acc[r][1] = reg::fma(a, b1, acc[r][1]);
    }
  }
  if (ncols == NR) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      reg::store(y + r * ldy, acc[r][0]);
      reg::store(y + r * ldy + L, acc[r][1]);
    }
    return;
  }
  // The last panel of a weight whose rows are not a multiple of NR: through memory, constant indices only (an
  // index known at run time would keep the accumulators on the stack for the whole loop above).
  alignas(64) float part[R][NR];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    reg::store(part[r], acc[r][0]);
    reg::store(part[r] + L, acc[r][1]);
  }
  for (int r = 0; r < R; ++r) std::copy(part[r], part[r] + ncols, y + r * ldy);
}

// One row by two panels (j and j + 1, both full): four accumulator chains where tile<1> has two, so that a batch-1
// step's multiply-adds do not wait on each other's latency. Each column still sums over k in order, as in tile<R>:
// the row's result is the same bits as inside a batch.
inline void row_by_two_panels(const float* x, const float* panel, int64_t K, float* y) {
  Vec acc[2][2] = {{reg::zero(), reg::zero()}, {reg::zero(), reg::zero()}};
  const float* next = panel + K * NR;
  for (int64_t k = 0; k < K; ++k) {
    const Vec a = reg::set1(x[k]);
    acc[0][0] = reg::fma(a, reg::load(panel + k * NR), acc[0][0]);
    acc[0][1] = reg::fma(a, reg::load(panel + k * NR + L), acc[0][1]);
    acc[1][0] = reg::fma(a, reg::load(next + k * NR), acc[1][0]);
    acc[1][1] = reg::fma(a, reg::load(next + k * NR + L), acc[1][1]);
  }
  reg::store(y, acc[0][0]);
  reg::store(y + L, acc[0][1]);
  reg::store(y + NR, acc[1][0]);
  reg::store(y + NR + L, acc[1][1]);
}

// Whether the first tile of a panel asks for the next panel ahead (tile's `next`): in the AVX2 build only, and only
// where more tiles follow on the same panel. The first tile reads the panel from memory; the others read it from
// the cache. An AVX2 tile makes up to 12 multiply-adds per 64-byte line (12 accumulators of its 16 registers: 6 rows
// by 2 x 8 lanes), about 6 cycles, so its reads apparently outrun what the hardware prefetcher brings and it waits on
// memory, where an AVX-512 tile (up to 24 on 128 bytes, about 24 cycles double-pumped on Zen 4) does not. Asked for
// one panel ahead, the line has arrived by the time the next panel's first tile reads it, while the later tiles
// compute. On a 2-core Zen 4 built for AVX2
// (SmolLM2's 30 layers and LM head, random weights on huge pages; medians of three alternating runs), 8-32 rows took
// 0.79-0.93x the time at one thread and 0.75-0.91x at two. A single tile (up to 6 rows) gained nothing at 4 rows
// and lost at 2 (1.2x); the AVX-512 build lost with it at 2-32 rows (1.04-1.27x). Source:
// minivllm/bench/OPTIMISATIONS.md, "The AVX2 build asks for the next panel ahead".
constexpr bool prefetch_next_panel(int64_t t, int64_t tiles) { return L == 8 && t == 0 && tiles > 1; }

// tile<rows> for a height known at run time, 1 <= rows <= MR.
template <int... R>
inline void tile_of(int rows, const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy,
                    int64_t ncols, const float* next, std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? tile<R + 1>(x, ldx, panel, K, y, ldy, ncols, next) : void()), ...);
}

}  // namespace
#endif

namespace {

// An uninitialised float32 tensor of `sizes` in memory of its own, asked to be backed by 2 MiB pages (Linux's
// transparent huge pages, in their default "madvise" mode): a batch-1 decode step streams every panel from memory,
// and with 4 KiB pages the hardware prefetcher stops at each page's end and the TLB misses every 4 KiB. Measured
// (minivllm/bench/OPTIMISATIONS.md, "The float32 weights held once"): with panels from PyTorch's allocator (4 KiB
// pages there) a batch-1 run decoded 28.6 tok/s at one thread, twice, against 32.1-34.6 with skinny_gemm on the
// loader's weights, which numpy had allocated on huge pages (numpy asks for them for every array of 4 MiB and more).
// A fresh mapping, advised before it is first written, gets them at the first touch; where the kernel refuses, it
// stays an ordinary mapping.
at::Tensor empty_on_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t(2) << 20;
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = size_t(numel) * sizeof(float);
  if (bytes >= kHuge) {
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    const size_t len = rounded + kHuge;  // room to start at a 2 MiB boundary
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      auto* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1));
      // Only the whole 2 MiB pages the tensor fills: a huge page under its last bytes would be resident in full.
      // A refusal (THP "never") leaves 4 KiB pages: still correct.
      madvise(start, bytes / kHuge * kHuge, MADV_HUGEPAGE);
      return at::from_blob(start, sizes, [base, len](void*) { munmap(base, len); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace

bool packed_gemm_available() { return MINIVLLM_FMA_LANES > 0; }

int64_t packed_gemm_panel_width() { return MINIVLLM_FMA_LANES * 2; }

at::Tensor pack_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(packed_gemm_available(), "pack_gemm_weight: this build has no packed GEMM (it needs AVX2 and FMA)");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous(),
              "pack_gemm_weight: weight must be a contiguous float32 [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1), nr = packed_gemm_panel_width();
  const int64_t panels = (N + nr - 1) / nr;
  at::Tensor packed = empty_on_huge_pages({panels, K, nr}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < nr; ++c) {
          const int64_t n = j * nr + c;
          p[(j * K + k) * nr + c] = n < N ? w[n * K + k] : 0.f;
        }
  });
  return packed;
}

void packed_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed_gemm_available(), "packed_gemm: this build has no packed GEMM (it needs AVX2 and FMA)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_gemm: x, out and packed must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_gemm: x must be [rows, in_features] with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == packed_gemm_panel_width(),
              "packed_gemm: packed must come from pack_gemm_weight in this build (panels of ",
              packed_gemm_panel_width(), " columns)");
  TORCH_CHECK(out.dim() == 2, "packed_gemm: out must be [rows, out_features], got ", out.dim(), " dimensions");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), nr = packed.size(2);
  TORCH_CHECK(packed.size(1) == K, "packed_gemm: x has ", K, " in_features, the packed weight ", packed.size(1));
  TORCH_CHECK(out.size(0) == M && out.stride(1) == 1 && out.stride(0) >= N && (N + nr - 1) / nr == packed.size(0),
              "packed_gemm: out must be [", M, ", out_features] with contiguous rows that do not overlap, "
              "out_features matching the packed weight's ", packed.size(0), " panels of ", nr);
  // Threads write disjoint columns of out while reading all of x: out sharing x's memory would race. Checked on the
  // address ranges (so two disjoint column slices of one buffer are refused too).
  const auto* out_begin = out.data_ptr<float>();
  const auto* x_begin = x.data_ptr<float>();
  const auto* out_end = out_begin + (M > 0 ? (M - 1) * out.stride(0) + N : 0);
  const auto* x_end = x_begin + (M > 0 ? (M - 1) * x.stride(0) + K : 0);
  TORCH_CHECK(out_end <= x_begin || x_end <= out_begin, "packed_gemm: out must not share memory with x");
#if MINIVLLM_FMA_LANES > 0
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = out.stride(0);
  const int64_t panels = packed.size(0);
  // Work items: a run of panels by a block of rows, about 30 us each (at 100 GFLOP/s, or 15 GB/s for the panels of
  // one row), so that an item redone because its helper lost the CPU costs little (run_items, thread_pool.h).
  const int64_t rb = M >= 256 ? 128 : std::max<int64_t>(M, 1);
  const double panel_ns = std::max(2.0 * rb * K * NR / 100.0, K * NR * 4.0 / 15.0);
  // And four items per thread at least, so that no thread is left with a larger share of a small weight.
  const int64_t threads = items_threads();
  int64_t ppi = std::max<int64_t>(1, std::min<int64_t>(int64_t(30000.0 / panel_ns), panels / (4 * threads)));
  if (M == 1) ppi = (ppi + 1) / 2 * 2;  // whole pairs for row_by_two_panels
  const int64_t chunks = (panels + ppi - 1) / ppi, row_blocks = (M + rb - 1) / rb;
  auto items = std::make_shared<RedoableItems>();
  items->n = M > 0 ? chunks * row_blocks : 0;
  items->scratch_floats = rb * ppi * NR;
  items->keep = {x, packed, out};
  // y: where column j0 * NR of row r0 goes, rows ldy apart.
  auto run = [=](int64_t i, float* y, int64_t ldy_) {
    const int64_t r0 = i / chunks * rb, rows_here = std::min(rb, M - r0);
    int64_t begin = i % chunks * ppi;
    const int64_t j0 = begin, end = std::min(panels, begin + ppi);
    const float* xb = xp + r0 * ldx;
    if (rows_here == 1) {  // one row (a batch-1 decode step): two full panels at a time, the rest as below
      for (; begin + 2 <= end && (begin + 2) * NR <= N; begin += 2)
        row_by_two_panels(xb, pp + begin * K * NR, K, y + (begin - j0) * NR);
    }
    for (int64_t j = begin; j < end; ++j) {
      const float* panel = pp + j * K * NR;
      const int64_t ncols = std::min<int64_t>(NR, N - j * NR);
      // ceil(rows / MR) tiles of as equal a height as possible (8 rows with AVX2: 4 + 4, not 6 + 2): a short tile
      // has too few independent accumulator chains to cover the multiply-add latency.
      const int64_t tiles = (rows_here + MR - 1) / MR;
      for (int64_t t = 0, r = 0; t < tiles; ++t) {
        const int rows = int(rows_here / tiles + (t < rows_here % tiles));
        tile_of(rows, xb + r * ldx, ldx, panel, K, y + r * ldy_ + (j - j0) * NR, ldy_, ncols,
                prefetch_next_panel(t, tiles) && j + 1 < end ? panel + K * NR : nullptr,
                std::make_integer_sequence<int, MR>{});
        r += rows;
      }
    }
  };
  items->compute = [=](int64_t i, float* scratch) {
    if (scratch) return run(i, scratch, ppi * NR);
    run(i, yp + i / chunks * rb * ldy + i % chunks * ppi * NR, ldy);
  };
  items->commit = [=](int64_t i, const float* scratch) {
    const int64_t r0 = i / chunks * rb, rows_here = std::min(rb, M - r0);
    const int64_t c0 = i % chunks * ppi * NR, cols = std::min(N, c0 + ppi * NR) - c0;
    for (int64_t r = 0; r < rows_here; ++r)
      std::copy(scratch + r * ppi * NR, scratch + r * ppi * NR + cols, yp + (r0 + r) * ldy + c0);
  };
  run_items(std::move(items));
#endif
}

}  // namespace minivllm
