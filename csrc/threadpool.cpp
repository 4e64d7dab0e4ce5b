// A small persistent thread pool for tq::parallel_for.
//
// Every worker owns a slot: the caller writes the worker's job (fn, ctx, its range, spin) into
// the slot and then bumps the slot's ticket under the slot's mutex. Whoever runs a slot's range
// first claims it (a CAS of `claimed` to the ticket): the worker once it has seen the ticket, or
// the caller, which after its own range runs every range no worker has started yet (a worker
// that is asleep or has no core, e.g. because PyTorch's OpenMP threads spin on them, does not
// hold the call up). The runner decrements the call's `remaining` counter once. A worker reads
// the job only after it won the claim; the caller writes a slot again only after `remaining`
// reached zero, so nobody reads a half-written or a later call's job, and workers that take no
// part in a call are not woken. Slots are allocated once per worker (never moved); a call
// allocates nothing. Ranges are fixed by (n, grain, parts), whoever runs them.
//
// After a job a worker spins for the job's spin_us (0 by default) and then sleeps on its slot's
// condition variable. One call runs at a time; a call that finds the pool busy (another Python
// thread) runs its whole range inline. After fork() the child starts a fresh pool (the parent's
// threads do not exist there).
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tq {
namespace {

struct alignas(64) Slot {
  std::mutex mu;
  std::condition_variable cv;
  bool sleeping = false;            // guarded by mu: the worker waits on cv
  std::atomic<uint64_t> ticket{0};  // bumped (under mu) once per job given to this worker
  std::atomic<uint64_t> claimed{0};  // the last ticket whose range someone started
  // The job: written by the caller before `ticket` is bumped, read by whoever claimed it, not
  // written again before the range's runner has decremented the call's `remaining`.
  RangeFn fn = nullptr;
  void* ctx = nullptr;
  int64_t begin = 0, end = 0;
  int spin_us = 0;  // how long the worker spins for its next job before sleeping
};

struct Pool {
  std::mutex call_mu;                       // one parallel_for at a time; guards `slots`
  std::vector<std::unique_ptr<Slot>> slots;  // slots[i] belongs to the worker running range i + 1
  std::atomic<int> remaining{0};             // workers of the current call that have not finished

  void worker_loop(Slot* s) {
    uint64_t seen = 0;  // a slot's ticket starts at 0 and the worker starts before its first job
    int spin = 0;
    for (;;) {
      uint64_t now = s->ticket.load(std::memory_order_acquire);
      if (now == seen && spin > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
        for (int i = 1; now == seen; ++i) {
          _mm_pause();
          now = s->ticket.load(std::memory_order_acquire);
          if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) break;
        }
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(s->mu);
        s->sleeping = true;
        s->cv.wait(lock, [&] { return s->ticket.load(std::memory_order_relaxed) != seen; });
        s->sleeping = false;
        now = s->ticket.load(std::memory_order_relaxed);
      }
      seen = now;
      // Claim the range (the caller may have run it already), then copy the job out before
      // signalling completion: afterwards the caller may rewrite it.
      uint64_t expected = now - 1;
      if (!s->claimed.compare_exchange_strong(expected, now, std::memory_order_acq_rel)) continue;
      const RangeFn fn = s->fn;
      void* const ctx = s->ctx;
      const int64_t begin = s->begin, end = s->end;
      spin = s->spin_us;
      fn(ctx, begin, end);
      remaining.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void grow(int wanted) {  // with call_mu held
    while (static_cast<int>(slots.size()) < wanted) {
      slots.emplace_back(new Slot());
      Slot* s = slots.back().get();
      std::thread([this, s] { worker_loop(s); }).detach();
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

// Default 1 << 16 multiply-adds per range (a few microseconds of a decode-sized kernel on one
// core): below that, waking a worker costs more than the range saves (K=576 N=64 M=1 int4: 3 us
// on one thread, 8.5 us split in two). In a 30-layer SmolLM2-shaped int4 decode on 2 loaded cores
// (min_parallel_work values alternated in one process) splitting even the 576x576 M=1 calls
// (3.3e5) paid: medians 83 ms always split, 84 ms at 1 << 16, 111 ms at 1 << 18, 151 ms at 1 << 20.
std::atomic<int64_t> g_min_parallel_work{[] {
  const char* s = getenv("TORCHQ_NATIVE_MIN_PARALLEL_WORK");
  return s && *s ? static_cast<int64_t>(atoll(s)) : static_cast<int64_t>(1) << 16;
}()};

// Which threads run parallel_for's ranges: POOL_OPENMP (built with OpenMP, the default) runs them
// in an OpenMP parallel region. The library links libgomp.so.1 by name; loaded into a process
// where PyTorch already loaded its own libgomp.so.1 (torch/lib), the dynamic loader binds the
// library to that one, so the ranges run on PyTorch's intra-op threads. Between PyTorch ops
// those threads spin waiting for the next region: a separate pool's worker then finds its core
// taken, and the caller ends up running every range itself (measured at M = 256 on 2 cores: half
// the calls took twice as long). POOL_OWN (TORCHQ_NATIVE_POOL=own, or a build without OpenMP):
// the pool above. A forked child always uses the own pool (see g_atfork).
enum PoolMode : int { POOL_OWN = 0, POOL_OPENMP = 1 };
#ifdef _OPENMP
constexpr bool kHaveOpenMP = true;
#else
constexpr bool kHaveOpenMP = false;
#endif
std::atomic<int> g_pool_mode{[] {
  const char* s = getenv("TORCHQ_NATIVE_POOL");
  const bool own = s && (s[0] == 'o' && s[1] == 'w' && s[2] == 'n' && s[3] == 0);
  return kHaveOpenMP && !own ? POOL_OPENMP : POOL_OWN;
}()};

// A forked child of a process that ran OpenMP regions inherits libgomp's record of threads that
// do not exist there: its next region would wait for them forever. Every fork after this library
// loaded switches the child to the own pool (which starts fresh after a fork).
void use_own_pool_after_fork() { g_pool_mode.store(POOL_OWN, std::memory_order_relaxed); }
const int g_atfork = pthread_atfork(nullptr, nullptr, use_own_pool_after_fork);

}  // namespace

int64_t min_parallel_work() { return g_min_parallel_work.load(std::memory_order_relaxed); }

void parallel_for(int64_t n, int64_t grain, int threads, RangeFn fn, void* ctx, int spin_us, int64_t work) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t units = (n + grain - 1) / grain;
  int parts = threads < 1 ? 1 : threads;
  if (parts > units) parts = static_cast<int>(units);
  const int64_t least = min_parallel_work();
  if (work > 0 && least > 0 && parts > 1 && work / least < parts) parts = static_cast<int>(work / least > 1 ? work / least : 1);
  if (parts <= 1) {
    fn(ctx, 0, n);
    return;
  }
#ifdef _OPENMP
  if (g_pool_mode.load(std::memory_order_relaxed) == POOL_OPENMP) {
#pragma omp parallel num_threads(parts)
    {
      // the team may be smaller than asked (nested in another region: one thread): its size splits
      const int64_t team = omp_get_num_threads(), i = omp_get_thread_num();
      const int64_t b0 = (units * i / team) * grain, b1 = (units * (i + 1) / team) * grain;
      fn(ctx, b0 < n ? b0 : n, b1 < n ? b1 : n);
    }
    return;
  }
#endif
  Pool* p = pool();
  std::unique_lock<std::mutex> call(p->call_mu, std::try_to_lock);
  if (!call.owns_lock()) {  // another thread is using the pool: run inline
    fn(ctx, 0, n);
    return;
  }
  p->grow(parts - 1);
  auto bound = [&](int i) {  // range i is [bound(i), bound(i + 1))
    const int64_t b = (units * i / parts) * grain;
    return b < n ? b : n;
  };
  // Every worker of the previous call has decremented `remaining` (the previous caller waited
  // for zero before releasing call_mu), so no worker reads a slot while it is written here.
  p->remaining.store(parts - 1, std::memory_order_relaxed);
  for (int i = 1; i < parts; ++i) {
    Slot* s = p->slots[i - 1].get();
    s->fn = fn;
    s->ctx = ctx;
    s->begin = bound(i);
    s->end = bound(i + 1);
    s->spin_us = spin_us;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->ticket.store(s->ticket.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      wake = s->sleeping;
    }
    if (wake) s->cv.notify_one();
  }
  fn(ctx, 0, bound(1));
  // Run the ranges no worker has started (claimed[i] is ticket - 1 until someone starts it).
  for (int i = 1; i < parts; ++i) {
    Slot* s = p->slots[i - 1].get();
    uint64_t expected = s->ticket.load(std::memory_order_relaxed) - 1;
    if (s->claimed.load(std::memory_order_relaxed) != expected) continue;
    if (!s->claimed.compare_exchange_strong(expected, expected + 1, std::memory_order_acq_rel)) continue;
    fn(ctx, bound(i), bound(i + 1));
    p->remaining.fetch_sub(1, std::memory_order_acq_rel);
  }
  // Wait for the workers that started; yield the core when they are slow (more threads than cores).
  for (int i = 0; p->remaining.load(std::memory_order_acquire) != 0; ++i) {
    if (i < 4096) {
      _mm_pause();
    } else {
      sched_yield();
    }
  }
}

}  // namespace tq

// Sets the least work per range (tq::min_parallel_work; 0: split by `threads` alone) and returns
// the previous value; a negative value only reads it.
TQ_API int64_t tq_set_min_parallel_work(int64_t work) {
  if (work < 0) return tq::g_min_parallel_work.load();
  return tq::g_min_parallel_work.exchange(work);
}

// The pool parallel_for uses (0: torchq's own, 1: OpenMP, PyTorch's threads); returns the previous
// mode, or -1 (nothing changed) for 1 in a build without OpenMP. A negative mode only reads it.
TQ_API int tq_set_thread_pool(int mode) {
  if (mode < 0) return tq::g_pool_mode.load();
  if (mode > 1 || (mode == 1 && !tq::kHaveOpenMP)) return -1;
  return tq::g_pool_mode.exchange(mode);
}
