// The threads minivllm's kernels split their work over, in place of OpenMP's: the calling thread and helper threads
// that join a region only while items of it are left. minivllm only: vLLM 0.32's CPU kernels run in OpenMP regions
// (`#pragma omp parallel for`, csrc/cpu/*.cpp), whose closing barrier waits for every thread of the team, so a region
// waits for a thread that the OS has not scheduled because another process holds its CPU. Measured on a 2-core Zen 4
// (minivllm/bench/OPTIMISATIONS.md, "Kernels that do not wait for a descheduled thread"): with a busy second core,
// SmolLM2's 30 layers of products at 20 rows took 96 ms on two OpenMP threads, 52 on one, 39-47 on two here.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace minivllm {

// Hands out the items of one region, each once: next() returns the next item, or -1 when none is left.
using NextItem = std::function<int64_t()>;

// Runs worker(next) on the calling thread and on up to threads - 1 helpers, each of which calls it once if it
// joins while items of [0, n) are left; returns when every item has been handed out and every worker that joined
// has returned. Items go out in order 0, 1, ..., n - 1. With threads <= 1 or n <= 1, from inside a region, or while
// another thread runs a region, worker(next) runs on the calling thread alone. A worker must not throw.
void run_on_pool(int64_t n, int64_t threads, const std::function<void(const NextItem&)>& worker);

// Items whose results a helper computes aside and then commits, so that the caller, once no item is left to hand
// out, redoes an item a helper has held for more than twice the caller's own time per item (a helper the OS took
// the CPU from in the middle of it) instead of waiting for that helper to be scheduled again: the backup tasks of
// MapReduce (Dean and Ghemawat, OSDI 2004, section 3.6), at the scale of one kernel call. A helper's result for an
// item the caller redid is dropped.
//   compute(i, scratch): item i into the output when scratch is null, else into scratch (scratch_floats floats).
//   commit(i, scratch): copies what compute(i, scratch) left in scratch to the output.
// A helper that lost its CPU finishes its item after the call has returned, so compute and commit must capture by
// value, and `keep` holds the tensors they read and write. compute must not throw.
struct RedoableItems {
  int64_t n = 0;
  int64_t scratch_floats = 0;
  std::function<void(int64_t, float*)> compute;
  std::function<void(int64_t, const float*)> commit;
  std::vector<at::Tensor> keep;
};
void run_redoable(std::shared_ptr<RedoableItems> items, int64_t threads);
// How many items callers have redone since the process started (their helper still held them).
int64_t redone_items();

// The thread count the kernels give run_on_pool: at::get_num_threads(), which torch.set_num_threads (and minivllm's
// thread governor, minivllm/worker/cpu_threads.py) sets.
int64_t pool_threads();

// The thread count the kernels give run_redoable: set_redoable_threads(n) with n >= 1 (the governor: every CPU of
// the process, as a busy CPU no longer holds these regions back), else (0, the default) pool_threads().
int64_t redoable_threads();
void set_redoable_threads(int64_t n);

}  // namespace minivllm
