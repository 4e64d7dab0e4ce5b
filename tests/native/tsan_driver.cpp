// Stress driver for tq::parallel_for (csrc/threadpool.cpp), built with -fsanitize=thread by
// tests/test_native_threads.py: several threads call parallel_for at once with varying sizes,
// part counts, spin times and work per element; every element of every call must be visited
// exactly once, and the pool's workers must have run some ranges (not only the callers).
//   g++ -std=c++17 -fsanitize=thread -O1 -g -pthread -Icsrc csrc/threadpool.cpp
//       tests/native/tsan_driver.cpp -o tsan_driver && ./tsan_driver [callers] [calls]
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <thread>
#include <vector>

#include "common.h"

namespace {

struct Job {
  std::vector<int>* hits;
  int64_t n;
  int work;  // busy iterations per element, so that workers get to run ranges
};

thread_local bool t_caller = false;
std::atomic<long> g_worker_ranges{0};

void visit(void* ctx, int64_t begin, int64_t end) {
  Job* job = static_cast<Job*>(ctx);
  if (begin < 0 || end > job->n || begin > end) {
    fprintf(stderr, "bad range [%lld, %lld) for n=%lld\n", (long long)begin, (long long)end, (long long)job->n);
    abort();
  }
  if (!t_caller) g_worker_ranges.fetch_add(1, std::memory_order_relaxed);
  for (int64_t i = begin; i < end; ++i) {
    volatile int sink = 0;
    for (int w = 0; w < job->work; ++w) sink = sink + w;
    (*job->hits)[i] += 1;  // plain writes: TSan sees overlaps
  }
}

std::atomic<int> g_failures{0};

void caller(int id, int calls) {
  t_caller = true;
  static const int kThreads[] = {1, 2, 3, 4, 8, 2, 5};
  static const int64_t kSizes[] = {8, 64, 1, 3, 100, 16, 7};
  static const int64_t kGrains[] = {4, 1, 4, 1, 3, 4, 1};
  static const int kSpins[] = {0, 0, 20, 0};
  static const int kWork[] = {0, 200, 0, 2000};
  unsigned seed = 12345u + 977u * id;
  for (int c = 0; c < calls; ++c) {
    seed = seed * 1103515245u + 12345u;
    const int threads = kThreads[(seed >> 8) % 7];
    const int k = (seed >> 16) % 7;
    std::vector<int> hits(kSizes[k], 0);  // a fresh buffer per call, as the kernels' outputs are
    Job job{&hits, kSizes[k], kWork[(seed >> 4) % 4]};
    tq::parallel_for(kSizes[k], kGrains[k], threads, visit, &job, kSpins[(seed >> 24) % 4]);
    for (int64_t i = 0; i < kSizes[k]; ++i) {
      if (hits[i] != 1) {
        fprintf(stderr, "caller %d call %d: element %lld of %lld visited %d times (threads=%d)\n", id, c,
                (long long)i, (long long)kSizes[k], hits[i], threads);
        g_failures.fetch_add(1);
        return;
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int callers = argc > 1 ? atoi(argv[1]) : 4;
  const int calls = argc > 2 ? atoi(argv[2]) : 2000;
  caller(0, calls / 4);  // one caller alone first: every call uses the pool
  std::vector<std::thread> ts;
  for (int t = 0; t < callers; ++t) ts.emplace_back(caller, t + 1, calls);
  for (auto& t : ts) t.join();
  if (g_failures.load()) return 1;
  printf("ok: %d callers x %d calls, %ld ranges run by pool workers\n", callers, calls, g_worker_ranges.load());
  return 0;
}
