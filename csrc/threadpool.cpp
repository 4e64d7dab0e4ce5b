// A small persistent thread pool for tq::parallel_for.
//
// Workers wait on a generation counter: they spin for the job's spin_us (0 by default) and then
// sleep on a condition variable. One call runs at a time;
// a call that finds the pool busy (another Python thread) runs its whole range inline.
// After fork() the child starts a fresh pool (the parent's threads do not exist there).
#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace tq {
namespace {


struct Pool {
  std::mutex call_mu;  // one parallel_for at a time
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> remaining{0};
  int workers = 0;
  // The current job (written before generation is bumped, read after it is seen).
  RangeFn fn = nullptr;
  void* ctx = nullptr;
  std::vector<int64_t> bounds;  // range i is [bounds[i], bounds[i+1])
  int parts = 0;
  std::atomic<int> spin_us{0};  // how long workers spin after this job before sleeping

  // `seen`: the generation when the worker was created (before the job that created it was
  // published), so a worker that starts late still runs that job.
  void worker_loop(int index, uint64_t seen) {
    for (;;) {
      uint64_t now = generation.load(std::memory_order_acquire);
      const int spin = spin_us.load(std::memory_order_relaxed);
      if (now == seen && spin > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
        for (int i = 1; now == seen; ++i) {
          _mm_pause();
          now = generation.load(std::memory_order_acquire);
          if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) break;
        }
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return generation.load(std::memory_order_acquire) != seen; });
        now = generation.load(std::memory_order_acquire);
      }
      seen = now;
      if (index < parts) {
        fn(ctx, bounds[index], bounds[index + 1]);
        remaining.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  void grow(int wanted) {
    while (workers < wanted) {
      int index = ++workers;  // worker i runs range i; range 0 is the caller's
      const uint64_t seen = generation.load(std::memory_order_acquire);
      std::thread([this, index, seen] { worker_loop(index, seen); }).detach();
    }
  }
};

Pool* g_pool = nullptr;
pid_t g_pool_pid = 0;
std::mutex g_create_mu;

Pool* pool() {
  std::lock_guard<std::mutex> lock(g_create_mu);
  if (g_pool == nullptr || g_pool_pid != getpid()) {
    g_pool = new Pool();  // a forked child abandons the parent's pool (its threads are gone)
    g_pool_pid = getpid();
  }
  return g_pool;
}

}  // namespace

void parallel_for(int64_t n, int64_t grain, int threads, RangeFn fn, void* ctx, int spin_us) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int64_t units = (n + grain - 1) / grain;
  int parts = threads < 1 ? 1 : threads;
  if (parts > units) parts = static_cast<int>(units);
  if (parts <= 1) {
    fn(ctx, 0, n);
    return;
  }
  Pool* p = pool();
  std::unique_lock<std::mutex> call(p->call_mu, std::try_to_lock);
  if (!call.owns_lock()) {  // another thread is using the pool: run inline
    fn(ctx, 0, n);
    return;
  }
  p->grow(parts - 1);
  p->bounds.assign(parts + 1, 0);
  for (int i = 0; i <= parts; ++i) {
    int64_t b = (units * i / parts) * grain;
    p->bounds[i] = b < n ? b : n;
  }
  p->fn = fn;
  p->ctx = ctx;
  p->parts = parts;
  p->spin_us.store(spin_us, std::memory_order_relaxed);
  p->remaining.store(parts - 1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(p->mu);
    p->generation.fetch_add(1, std::memory_order_acq_rel);
  }
  p->cv.notify_all();
  fn(ctx, p->bounds[0], p->bounds[1]);
  while (p->remaining.load(std::memory_order_acquire) != 0) _mm_pause();
}

}  // namespace tq
