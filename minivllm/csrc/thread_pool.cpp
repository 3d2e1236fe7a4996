// Redoable work items (thread_pool.h). Each item has a state: free, taken by a helper, being committed, done, or the
// caller's. The region is shared (std::shared_ptr) with the helpers working in it, so that one that finishes after
// the caller has returned still holds valid memory, and finds its item redone.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sched.h>

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

constexpr int64_t kMaxThreads = 256;

// How long a helper spins for the next region before it sleeps. A step's regions follow each other within tens of
// microseconds, and waking a sleeping thread costs about as much again; with a busy second core, 200 us gave the
// helper more of the items than 30 or 0 (SmolLM2's products at 20 rows: 39 ms against 42-45 and 48).
constexpr auto kSpin = std::chrono::microseconds(200);

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

enum : uint8_t { kFree, kTaken, kCommitting, kDone, kCallers };

struct Region {
  std::shared_ptr<RedoableItems> items;
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  std::atomic<int64_t> next{0};  // hands out items; the state decides who computes one
  std::atomic<int64_t> seats{0};  // helpers the region still takes (its thread count less the caller)
};

struct Pool {
  std::atomic<uint32_t> epoch{0};  // bumped when a region starts; sleeping helpers wait on it
  std::atomic<int> sleepers{0};
  std::mutex region_mutex;
  std::shared_ptr<Region> region;  // the running region, else null
  std::mutex caller;               // one region at a time
  std::mutex start;
  int helpers = 0;
};

std::atomic<Pool*> the_pool{nullptr};
std::atomic<int64_t> redoable_override{0};
std::atomic<int64_t> redone{0};
std::atomic<int64_t> helped{0};
thread_local bool in_region = false;

// set_helper_cpus: the list and its version; each helper applies a version it has not seen when it wakes for a
// region. Never destroyed, as the pool: at exit, a helper may still read it. A forked child gets an empty one (its
// helpers are new, and the old one's mutex may be held at the fork).
struct HelperCpus {
  std::mutex mutex;
  std::vector<int64_t> list;
  std::atomic<uint64_t> version{0};
};
std::atomic<HelperCpus*> the_cpus{new HelperCpus()};
HelperCpus& helper_cpu_list() { return *the_cpus.load(std::memory_order_acquire); }

void apply_helper_cpus(uint64_t& seen) {
  HelperCpus& h = helper_cpu_list();
  if (h.version.load(std::memory_order_acquire) == seen) return;
  std::vector<int64_t> cpus;
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    cpus = h.list;
    seen = h.version.load(std::memory_order_relaxed);
  }
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int64_t c : cpus) CPU_SET(static_cast<int>(c), &set);
  // Fails, leaving the mask as it was, only when none of the CPUs is one this thread may run on.
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// The child of a fork has none of the parent's helpers, and a lock of the old pool may be held: a fresh pool (the
// old one is leaked).
void reset_after_fork() {
  the_pool.store(new Pool(), std::memory_order_relaxed);
  the_cpus.store(new HelperCpus(), std::memory_order_release);
}

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

void help(Region& r) {
  thread_local std::vector<float> scratch;
  const RedoableItems& it = *r.items;
  if (r.seats.fetch_sub(1, std::memory_order_relaxed) <= 0) return;  // more helpers started than this region takes
  in_region = true;
  for (int64_t i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < it.n;) {
    uint8_t s = kFree;
    if (!r.state[i].compare_exchange_strong(s, kTaken, std::memory_order_acq_rel)) continue;
    const size_t want = size_t(std::max<int64_t>(it.scratch_floats, 1));
    if (scratch.size() < want) scratch.resize(want);
    it.compute(i, scratch.data());
    s = kTaken;
    if (r.state[i].compare_exchange_strong(s, kCommitting, std::memory_order_acq_rel)) {
      it.commit(i, scratch.data());
      r.state[i].store(kDone, std::memory_order_release);  // the caller reads the output after seeing this
      helped.fetch_add(1, std::memory_order_relaxed);
    }
  }
  in_region = false;
}

void helper_main(Pool* pp) {
  Pool& p = *pp;
  uint32_t seen = p.epoch.load(std::memory_order_acquire);
  pthread_setname_np(pthread_self(), "minivllm-helper");  // as `top -H` and /proc/<pid>/task/<tid>/comm show it
  uint64_t cpus_seen = 0;
  apply_helper_cpus(cpus_seen);
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
    std::shared_ptr<Region> r;
    {
      std::lock_guard<std::mutex> lock(p.region_mutex);
      r = p.region;
    }
    apply_helper_cpus(cpus_seen);
    if (r) help(*r);
  }
}

void start_helpers(Pool& p, int64_t wanted) {
  std::lock_guard<std::mutex> lock(p.start);
  for (; p.helpers < wanted; ++p.helpers) std::thread(helper_main, &p).detach();
}

void run_redoable(std::shared_ptr<RedoableItems> items, int64_t threads) {
  const int64_t n = items->n;
  auto alone = [&] {
    for (int64_t i = 0; i < n; ++i) items->compute(i, nullptr);
  };
  if (in_region) return alone();  // called from an item: the lock below is this thread's already
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.caller, std::try_to_lock);
  if (!lock.owns_lock()) return alone();  // another thread's region is running: this one on the calling thread
  if (p.helpers < threads - 1) start_helpers(p, threads - 1);
  auto r = std::make_shared<Region>();
  r->items = std::move(items);
  r->state.reset(new std::atomic<uint8_t>[n]);
  r->seats.store(threads - 1, std::memory_order_relaxed);
  for (int64_t i = 0; i < n; ++i) r->state[i].store(kFree, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> l(p.region_mutex);
    p.region = r;
  }
  p.epoch.fetch_add(1);
  if (p.sleepers.load() > 0) p.epoch.notify_all();
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
  std::lock_guard<std::mutex> l(p.region_mutex);
  p.region.reset();
}

}  // namespace

bool items_on_helpers(int64_t n) {
  const int64_t threads = std::min(redoable_threads(), kMaxThreads);
  return threads > at::get_num_threads() && threads > 1 && n > 1;
}

int64_t items_threads() { return std::max<int64_t>(redoable_threads(), at::get_num_threads()); }

void run_items(std::shared_ptr<RedoableItems> items) {
  const int64_t n = items->n, torch_threads = at::get_num_threads();
  if (items_on_helpers(n)) return run_redoable(std::move(items), std::min(redoable_threads(), kMaxThreads));
  // Handed out one at a time, as parallel_for_dynamic (cpu_utils.h): items differ in size (requests' lengths).
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(torch_threads, n), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) items->compute(i, nullptr);
  });
}

int64_t redoable_threads() {
  const int64_t n = redoable_override.load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

void set_redoable_threads(int64_t n) {
  TORCH_CHECK(n >= 0, "set_redoable_threads: n must be >= 0 (0: follow torch.set_num_threads), got ", n);
  redoable_override.store(n, std::memory_order_relaxed);
}

void set_helper_cpus(const std::vector<int64_t>& cpus) {
  for (int64_t c : cpus)
    TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "set_helper_cpus: cpus must be within 0..", CPU_SETSIZE - 1, ", got ", c);
  (void)pool();  // registers the fork handler that empties the list in a child
  HelperCpus& h = helper_cpu_list();
  std::lock_guard<std::mutex> lock(h.mutex);
  h.list = cpus;
  h.version.fetch_add(1, std::memory_order_release);
}

std::vector<int64_t> helper_cpus() {
  HelperCpus& h = helper_cpu_list();
  std::lock_guard<std::mutex> lock(h.mutex);
  return h.list;
}

int64_t redone_items() { return redone.load(std::memory_order_relaxed); }

int64_t helped_items() { return helped.load(std::memory_order_relaxed); }

}  // namespace minivllm
