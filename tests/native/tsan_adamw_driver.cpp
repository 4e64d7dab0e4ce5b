// Stress driver for the fused quantized-state AdamW step (csrc/optim_adamw.cpp, tq_adamw_blockwise),
// built with -fsanitize=thread (and -O2) by tests/test_native_threads.py. Several threads step
// their own tensors at once, each call split over the pool (min_parallel_work 0, 2..8 parts),
// with 8- and 4-bit states, fp32 and bf16 parameters, and maps that differ per caller so the
// lazily built bin tables (table_for) are created while other threads read theirs. Every
// caller's final parameters, codes and absmax must equal a single-threaded run bit for bit.
// The driver defines tq::active_isa itself (csrc/cpu.cpp would pull in every kernel): the third
// argument picks the path, "avx2" (where the CPU has it) or "scalar".
//   g++ -std=c++17 -fsanitize=thread -O1 -g -pthread -Icsrc csrc/threadpool.cpp csrc/optim_adamw.cpp
//       tests/native/tsan_adamw_driver.cpp -o driver && ./driver [callers] [steps] [avx2|scalar]
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <thread>
#include <vector>

#include "common.h"

TQ_API int tq_adamw_blockwise(void* p, const void* g, int dtype, int64_t n, uint8_t* c1, int64_t c1_bytes, float* a1,
                              int64_t a1_len, uint8_t* c2, int64_t c2_bytes, float* a2, int64_t a2_len, const float* map1,
                              const float* mids1, const float* map2, const float* mids2, int bits, int64_t block,
                              const float* scalars, int maximize, int threads);
TQ_API int64_t tq_set_min_parallel_work(int64_t work);

namespace {
int g_isa = tq::ISA_SCALAR;
}  // namespace

namespace tq {
int active_isa() { return g_isa; }
}  // namespace tq

namespace {

struct Case {
  int64_t n;
  int bits;
  int64_t block;
  int dtype;    // 0 fp32, 1 bf16
  int variant;  // which maps: a distinct pair per variant (a distinct bin table each)
};

const Case kCases[] = {{5000, 8, 256, 0, 0}, {4097, 8, 256, 1, 1}, {9000, 4, 128, 0, 2},
                       {4099, 4, 128, 1, 3}, {20000, 8, 2048, 0, 4}, {6000, 4, 64, 0, 5}};
constexpr int kNumCases = sizeof(kCases) / sizeof(kCases[0]);

// A sorted map of 2^bits values (signed: in [-1, 1] holding 0; unsigned: in (0, 1]) and its midpoints.
struct Maps {
  std::vector<float> map1, mids1, map2, mids2;
};

Maps make_maps(int bits, int variant) {
  const int k = 1 << bits;
  Maps m;
  for (int i = 0; i < k; ++i) {
    const float t = static_cast<float>(i) / (k - 1);  // 0..1
    const float bend = 1.0f + 0.05f * variant;
    float s = 2.0f * t - 1.0f;
    s = s < 0 ? -powf(-s, bend) : powf(s, bend);
    m.map1.push_back(i == k / 2 ? 0.0f : s);
    m.map2.push_back(powf(static_cast<float>(i + 1) / k, bend));
  }
  // keep map1 sorted with an exact 0 (the k/2-th value sits between its neighbours)
  for (int i = 0; i + 1 < k; ++i) {
    m.mids1.push_back(0.5f * (m.map1[i] + m.map1[i + 1]));
    m.mids2.push_back(0.5f * (m.map2[i] + m.map2[i + 1]));
  }
  return m;
}

uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct State {
  std::vector<uint8_t> p, c1, c2;  // p: n fp32 or bf16 values as bytes
  std::vector<float> a1, a2;
};

float rnd(unsigned* seed) {
  *seed = *seed * 1103515245u + 12345u;
  return static_cast<float>((*seed >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}

// `steps` AdamW steps of case c from a fixed start (seeded by `seed`), split over `threads`.
State run(const Case& c, const Maps& m, int steps, int threads, unsigned seed) {
  const int64_t nb = (c.n + c.block - 1) / c.block, bytes = c.bits == 8 ? c.n : (c.n + 1) / 2;
  const size_t esize = c.dtype == 0 ? 4 : 2;
  State s;
  s.p.resize(c.n * esize);
  s.c1.assign(bytes, 0);
  s.c2.assign(bytes, 0);
  s.a1.assign(nb, 0.0f);
  s.a2.assign(nb, 0.0f);
  std::vector<uint8_t> g(c.n * esize);
  for (int64_t i = 0; i < c.n; ++i) {
    const float v = rnd(&seed);
    if (c.dtype == 0) {
      memcpy(&s.p[i * 4], &v, 4);
    } else {
      const uint16_t b = to_bf16(v);
      memcpy(&s.p[i * 2], &b, 2);
    }
  }
  for (int step = 1; step <= steps; ++step) {
    for (int64_t i = 0; i < c.n; ++i) {
      const float v = 1e-3f * rnd(&seed) * (1 + (i % 7));
      if (c.dtype == 0) {
        memcpy(&g[i * 4], &v, 4);
      } else {
        const uint16_t b = to_bf16(v);
        memcpy(&g[i * 2], &b, 2);
      }
    }
    const float beta1 = 0.9f, beta2 = 0.999f, lr = 1e-3f, eps = 1e-8f;
    const float bc1 = 1.0f - powf(beta1, step), bc2 = 1.0f - powf(beta2, step);
    const float scalars[8] = {beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * 0.01f, lr / bc1, sqrtf(bc2), eps};
    const int rc = tq_adamw_blockwise(s.p.data(), g.data(), c.dtype, c.n, s.c1.data(), bytes, s.a1.data(), nb, s.c2.data(),
                                      bytes, s.a2.data(), nb, m.map1.data(), m.mids1.data(), m.map2.data(), m.mids2.data(),
                                      c.bits, c.block, scalars, 0, threads);
    if (rc != 0) {
      fprintf(stderr, "tq_adamw_blockwise returned %d (n=%lld bits=%d)\n", rc, (long long)c.n, c.bits);
      abort();
    }
  }
  return s;
}

bool same(const State& a, const State& b) {
  return a.p == b.p && a.c1 == b.c1 && a.c2 == b.c2 && memcmp(a.a1.data(), b.a1.data(), a.a1.size() * 4) == 0 &&
         memcmp(a.a2.data(), b.a2.data(), a.a2.size() * 4) == 0;
}

std::atomic<int> g_failures{0};

void caller(int id, int steps, const std::vector<State>* expected, const std::vector<Maps>* maps) {
  static const int kThreads[] = {2, 3, 4, 8, 5};
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < kNumCases; ++k) {
      const int ci = (k + id) % kNumCases;  // callers start on different cases
      const int threads = kThreads[(id + round + k) % 5];
      const State got = run(kCases[ci], (*maps)[ci], steps, threads, 1000u + ci);
      if (!same(got, (*expected)[ci])) {
        fprintf(stderr, "caller %d round %d: case %d (n=%lld bits=%d dtype=%d) with %d threads differs from one thread\n",
                id, round, ci, (long long)kCases[ci].n, kCases[ci].bits, kCases[ci].dtype, threads);
        g_failures.fetch_add(1);
        return;
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int callers = argc > 1 ? atoi(argv[1]) : 4;
  const int steps = argc > 2 ? atoi(argv[2]) : 3;
  const bool want_avx2 = argc <= 3 || strcmp(argv[3], "scalar") != 0;
  g_isa = want_avx2 && __builtin_cpu_supports("avx2") ? tq::ISA_AVX2 : tq::ISA_SCALAR;
  tq_set_min_parallel_work(0);  // every call split into `threads` parts, however small
  std::vector<Maps> maps;
  for (const Case& c : kCases) maps.push_back(make_maps(c.bits, c.variant));
  // the references first, on one thread (builds no bin table: the callers race to build them)
  std::vector<State> expected;
  for (int ci = 0; ci < kNumCases; ++ci) expected.push_back(State());
  {
    std::vector<std::thread> ts;  // the tables are built concurrently here already
    for (int ci = 0; ci < kNumCases; ++ci)
      ts.emplace_back([&, ci] { expected[ci] = run(kCases[ci], maps[ci], steps, 1, 1000u + ci); });
    for (auto& t : ts) t.join();
  }
  std::vector<std::thread> ts;
  for (int t = 0; t < callers; ++t) ts.emplace_back(caller, t, steps, &expected, &maps);
  for (auto& t : ts) t.join();
  if (g_failures.load()) return 1;
  printf("ok: %d callers x %d cases x 3 rounds x %d steps equal one thread (%s path)\n", callers, kNumCases, steps,
         g_isa == tq::ISA_AVX2 ? "avx2" : "scalar");
  return 0;
}
