// Work items that do not wait for a descheduled thread, for the kernels that take most of a step's time (packed_gemm,
// paged_attention_decode). An OpenMP region ends at a barrier that waits for every thread of the team, so when another
// process holds one of the CPUs, every region waits for the thread that shares that CPU: minivllm's thread governor
// (minivllm/worker/cpu_threads.py) then lowers torch's count to the CPUs left. These kernels can use the CPU time the
// other process leaves: their items run on the calling thread and on helper threads of their own, and the caller, once
// no item is left to hand out, redoes an item a helper still holds twice the caller's time per item after the caller
// comes to it (a helper the OS took the CPU from in the middle of it) instead of waiting for that helper to be
// scheduled again: the backup tasks of MapReduce (Dean and Ghemawat, OSDI 2004, section 3.6), at the scale of one
// kernel call. A helper computes its item aside and commits it only if the caller has not redone it. minivllm only:
// vLLM 0.32's CPU kernels run in OpenMP regions (`#pragma omp parallel for`, csrc/cpu/*.cpp).
//
// run_items takes this path only while set_redoable_threads(n) asks for more threads than torch's count (the governor
// does so when it has lowered that count); otherwise the items go to at::parallel_for as every other kernel's work:
// on an idle 2-core Zen 4 the helpers, spinning between regions beside OpenMP's threads, cost 10 % of a 32-request run
// (minivllm/bench/OPTIMISATIONS.md, "Kernels that do not wait for a descheduled thread").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace minivllm {

// The items of one call.
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

// Every item computed once into the output by the time it returns: on redoable_threads() threads, helpers that may
// be descheduled included, when that is more than at::get_num_threads(); else on at::parallel_for.
void run_items(std::shared_ptr<RedoableItems> items);

// The threads run_items uses: set_redoable_threads(n) with n >= 1, else (0, the default) at::get_num_threads().
int64_t redoable_threads();
void set_redoable_threads(int64_t n);

// Whether run_items gives n items to the helpers (redoable_threads() above at::get_num_threads(), n > 1), and the
// threads it spreads items over either way (the larger count): what a kernel sizes its items by.
bool items_on_helpers(int64_t n);
int64_t items_threads();

// The CPUs the helper threads may run on (sched affinity), applied by each helper when it next wakes for a call; an
// empty list, the default (and in a forked child), leaves their affinity alone (at a helper's start, its creator's).
// minivllm's thread governor keeps the helpers off the CPU of the thread that runs the step while torch's count is
// one: a helper that the OS moves onto that CPU takes the step's thread's time instead of a busy CPU's
// (minivllm/worker/cpu_threads.py).
// Raises (TORCH_CHECK) on a CPU outside 0 .. CPU_SETSIZE - 1.
void set_helper_cpus(const std::vector<int64_t>& cpus);
std::vector<int64_t> helper_cpus();

// How many items callers have redone since the process started (their helper still held them), and how many
// helpers have committed.
int64_t redone_items();
int64_t helped_items();

}  // namespace minivllm
