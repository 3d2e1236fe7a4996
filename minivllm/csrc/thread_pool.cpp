// The kernels' threads (thread_pool.h). One region runs at a time, of one of two kinds.
//
// run_on_pool: the whole state of the region is one 64-bit word, so that joining, taking an item and leaving are
// each one atomic operation on it:
//   bits  0-35  items left        (the next item is n - left)
//   bits 36-43  workers in the region (the caller counts as one from the start)
//   bits 44-51  the most workers the region takes (its thread count)
//   bits 52-63  the region's number, so that every region's first word differs from the last one's
// A helper joins only while items are left and the region has room, and the caller returns once no item is left and
// no worker is in the region: a helper that wakes late finds nothing left and goes back to waiting.
//
// run_redoable: each item has a state (free, taken by a helper, being committed, done, the caller's); the region is
// shared (std::shared_ptr) with the helpers working in it, so that one that finishes after the caller has returned
// still holds valid memory, and finds its item redone.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace minivllm {
namespace {

constexpr uint64_t kLeftMask = (uint64_t(1) << 36) - 1;
constexpr int kActiveShift = 36, kLimitShift = 44, kGenShift = 52;
constexpr uint64_t kActiveOne = uint64_t(1) << kActiveShift;
constexpr int64_t kMaxThreads = 255;

// How long a helper spins for the next region before it sleeps. A step's regions follow each other within tens of
// microseconds, and waking a sleeping thread costs about as much again; with a busy second core, 200 us gave the
// helper more of the items than 30 or 0 (SmolLM2's products at 20 rows: 39 ms against 42-45 and 48).
constexpr auto kSpin = std::chrono::microseconds(200);

using Clock = std::chrono::steady_clock;

inline uint64_t left_of(uint64_t s) { return s & kLeftMask; }
inline uint64_t active_of(uint64_t s) { return (s >> kActiveShift) & 0xFF; }
inline uint64_t limit_of(uint64_t s) { return (s >> kLimitShift) & 0xFF; }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

enum : uint8_t { kFree, kTaken, kCommitting, kDone, kCallers };

struct RedoRegion {
  std::shared_ptr<RedoableItems> items;
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  std::atomic<int64_t> next{0};  // hands out items; the state decides who computes one
};

struct Pool {
  std::atomic<uint64_t> state{0};  // run_on_pool's region (header comment)
  std::atomic<uint32_t> epoch{0};  // bumped when a region starts; sleeping helpers wait on it
  std::atomic<int> sleepers{0};
  // run_on_pool's region: written before its first word is published, read by a helper only once it has joined
  // (the region cannot end while it is in).
  int64_t n = 0;
  const std::function<void(const NextItem&)>* worker = nullptr;
  std::mutex redo_mutex;
  std::shared_ptr<RedoRegion> redo;  // run_redoable's region while it runs, else null
  std::mutex caller;  // one region at a time
  std::mutex start;
  int helpers = 0;
};

std::atomic<Pool*> the_pool{nullptr};
std::atomic<int64_t> redoable_override{0};
std::atomic<int64_t> redone{0};  // items the caller took from a helper (redone_items)
thread_local bool in_region = false;

// The child of a fork has none of the parent's helpers, and a lock of the old pool may be held: a fresh pool (the
// old one is leaked).
void reset_after_fork() { the_pool.store(new Pool(), std::memory_order_relaxed); }

// Never destroyed: at exit, helpers may still be waiting on it.
Pool& pool() {
  static const bool registered = [] {
    the_pool.store(new Pool(), std::memory_order_relaxed);
    pthread_atfork(nullptr, nullptr, reset_after_fork);
    return true;
  }();
  (void)registered;
  return *the_pool.load(std::memory_order_relaxed);
}

int64_t take_item(Pool& p) {
  uint64_t s = p.state.load(std::memory_order_relaxed);
  while (left_of(s) > 0) {
    if (p.state.compare_exchange_weak(s, s - 1, std::memory_order_relaxed)) return p.n - int64_t(left_of(s));
  }
  return -1;
}

void work_in_region(Pool& p) {
  in_region = true;
  (*p.worker)([&p] { return take_item(p); });
  in_region = false;
  // Release: the region's results are visible to the caller once it sees this worker gone.
  p.state.fetch_sub(kActiveOne, std::memory_order_release);
}

bool join(Pool& p) {
  uint64_t s = p.state.load(std::memory_order_relaxed);
  while (left_of(s) > 0 && active_of(s) < limit_of(s)) {
    // Acquire: pairs with the caller's publishing store, so n and worker are this region's.
    if (p.state.compare_exchange_weak(s, s + kActiveOne, std::memory_order_acquire, std::memory_order_relaxed))
      return true;
  }
  return false;
}

void help_redoable(RedoRegion& r) {
  thread_local std::vector<float> scratch;
  const RedoableItems& it = *r.items;
  in_region = true;
  for (int64_t i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < it.n;) {
    uint8_t s = kFree;
    if (!r.state[i].compare_exchange_strong(s, kTaken, std::memory_order_acq_rel)) continue;
    if (scratch.size() < size_t(it.scratch_floats)) scratch.resize(it.scratch_floats);
    it.compute(i, scratch.data());
    s = kTaken;
    if (r.state[i].compare_exchange_strong(s, kCommitting, std::memory_order_acq_rel)) {
      it.commit(i, scratch.data());
      r.state[i].store(kDone, std::memory_order_release);
    }
  }
  in_region = false;
}

void helper_main(Pool* pp) {
  Pool& p = *pp;
  uint32_t seen = p.epoch.load(std::memory_order_acquire);
  for (;;) {
    const auto t0 = Clock::now();
    for (uint32_t k = 0;; ++k) {
      const uint32_t e = p.epoch.load(std::memory_order_acquire);
      if (e != seen) {
        seen = e;
        break;
      }
      if ((k & 63) == 63 && Clock::now() - t0 >= kSpin) {
        // Sequentially consistent with the caller's bump-then-read of sleepers: one of the two sees the other.
        p.sleepers.fetch_add(1);
        p.epoch.wait(seen);
        p.sleepers.fetch_sub(1);
      }
      cpu_relax();
    }
    std::shared_ptr<RedoRegion> r;
    {
      std::lock_guard<std::mutex> lock(p.redo_mutex);
      r = p.redo;
    }
    if (r)
      help_redoable(*r);
    else if (join(p))
      work_in_region(p);
  }
}

void start_helpers(Pool& p, int64_t wanted) {
  std::lock_guard<std::mutex> lock(p.start);
  for (; p.helpers < wanted; ++p.helpers) std::thread(helper_main, &p).detach();
}

void wake_helpers(Pool& p) {
  p.epoch.fetch_add(1);
  if (p.sleepers.load() > 0) p.epoch.notify_all();
}

}  // namespace

void run_on_pool(int64_t n, int64_t threads, const std::function<void(const NextItem&)>& worker) {
  TORCH_CHECK(n >= 0 && uint64_t(n) <= kLeftMask, "run_on_pool: n must be in [0, 2^36), got ", n);
  threads = std::min(threads, kMaxThreads);
  auto alone = [&] {
    int64_t i = 0;
    worker([&i, n]() -> int64_t { return i < n ? i++ : -1; });
  };
  if (threads <= 1 || n <= 1 || in_region) return alone();
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.caller, std::try_to_lock);
  if (!lock.owns_lock()) return alone();
  if (p.helpers < threads - 1) start_helpers(p, threads - 1);
  p.n = n;
  p.worker = &worker;
  const uint64_t gen = (p.state.load(std::memory_order_relaxed) >> kGenShift) + 1;
  p.state.store((gen << kGenShift) | (uint64_t(threads) << kLimitShift) | kActiveOne | uint64_t(n),
                std::memory_order_release);
  wake_helpers(p);
  work_in_region(p);
  // Every item is handed out; wait for the helpers still working on theirs.
  while (active_of(p.state.load(std::memory_order_acquire)) != 0) cpu_relax();
}

void run_redoable(std::shared_ptr<RedoableItems> items, int64_t threads) {
  const int64_t n = items->n;
  threads = std::min(threads, kMaxThreads);
  auto alone = [&] {
    for (int64_t i = 0; i < n; ++i) items->compute(i, nullptr);
  };
  if (threads <= 1 || n <= 1 || in_region) return alone();
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.caller, std::try_to_lock);
  if (!lock.owns_lock()) return alone();
  if (p.helpers < threads - 1) start_helpers(p, threads - 1);
  auto r = std::make_shared<RedoRegion>();
  r->items = std::move(items);
  r->state.reset(new std::atomic<uint8_t>[n]);
  for (int64_t i = 0; i < n; ++i) r->state[i].store(kFree, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> l(p.redo_mutex);
    p.redo = r;
  }
  wake_helpers(p);
  const RedoableItems& it = *r->items;
  int64_t own = 0;
  Clock::duration own_time{0};
  auto compute_here = [&](int64_t i) {
    const auto t0 = Clock::now();
    it.compute(i, nullptr);
    own_time += Clock::now() - t0;
    ++own;
    r->state[i].store(kDone, std::memory_order_relaxed);
  };
  in_region = true;
  for (int64_t i; (i = r->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
    uint8_t s = kFree;
    if (r->state[i].compare_exchange_strong(s, kCallers, std::memory_order_acq_rel)) compute_here(i);
  }
  // The items left are a helper's. One that runs finishes an item in about the caller's time per item (at least 20
  // us; 200 us when the caller has done none): after twice that, the item is redone here.
  const auto patience = std::max<Clock::duration>(
      std::chrono::microseconds(20), own ? 2 * own_time / own : Clock::duration(std::chrono::microseconds(200)));
  for (int64_t i = 0; i < n; ++i) {
    const auto since = Clock::now();
    for (uint8_t s; (s = r->state[i].load(std::memory_order_acquire)) != kDone;) {
      // kFree: a helper was handed the item but has not taken it yet; kCommitting: a copy of a few KiB, waited for.
      if ((s == kFree || (s == kTaken && Clock::now() - since > patience)) &&
          r->state[i].compare_exchange_strong(s, kCallers, std::memory_order_acq_rel)) {
        if (s == kTaken) redone.fetch_add(1, std::memory_order_relaxed);
        compute_here(i);
        break;
      }
      cpu_relax();
    }
  }
  in_region = false;
  std::lock_guard<std::mutex> l(p.redo_mutex);
  p.redo.reset();
}

int64_t redone_items() { return redone.load(std::memory_order_relaxed); }

int64_t pool_threads() { return at::get_num_threads(); }

int64_t redoable_threads() {
  const int64_t n = redoable_override.load(std::memory_order_relaxed);
  return n > 0 ? n : pool_threads();
}

void set_redoable_threads(int64_t n) {
  TORCH_CHECK(n >= 0, "set_redoable_threads: n must be >= 0 (0: follow torch.set_num_threads), got ", n);
  redoable_override.store(n, std::memory_order_relaxed);
}

}  // namespace minivllm
