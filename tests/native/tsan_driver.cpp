// Stress driver for tq::parallel_for (csrc/threadpool.cpp), built with -fsanitize=thread by
// tests/test_native_threads.py: several threads call parallel_for at once with varying sizes,
// part counts and spin times; every element of every call must be visited exactly once.
//   g++ -std=c++17 -fsanitize=thread -O1 -g -pthread -Icsrc csrc/threadpool.cpp \
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
};

void visit(void* ctx, int64_t begin, int64_t end) {
  Job* job = static_cast<Job*>(ctx);
  if (begin < 0 || end > job->n || begin > end) {
    fprintf(stderr, "bad range [%lld, %lld) for n=%lld\n", (long long)begin, (long long)end, (long long)job->n);
    abort();
  }
  for (int64_t i = begin; i < end; ++i) (*job->hits)[i] += 1;  // plain writes: TSan sees overlaps
}

std::atomic<int> g_failures{0};

void caller(int id, int calls) {
  static const int kThreads[] = {1, 2, 3, 4, 8, 2, 5};
  static const int64_t kSizes[] = {8, 64, 1, 3, 100, 16, 7};
  static const int64_t kGrains[] = {4, 1, 4, 1, 3, 4, 1};
  static const int kSpins[] = {0, 0, 20, 0};
  unsigned seed = 12345u + 977u * id;
  for (int c = 0; c < calls; ++c) {
    seed = seed * 1103515245u + 12345u;
    const int threads = kThreads[(seed >> 8) % 7];
    const int k = (seed >> 16) % 7;
    std::vector<int> hits(kSizes[k], 0);  // a fresh buffer per call, as the kernels' outputs are
    Job job{&hits, kSizes[k]};
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
  printf("ok: %d callers x %d calls\n", callers, calls);
  return 0;
}
