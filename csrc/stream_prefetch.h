// Software prefetch for the weights a kernel streams from memory (decode: every weight read once per
// call). The kernels run tile by tile over weight rows that lie in memory one after another; while a
// tile computes, they fetch the next tile's lines into L1, one line per step, because rows of a few
// KB are too short for the hardware prefetchers to ramp up on their own. prefetch_next also fetches
// the line kStreamFarBytes further into L2: requests to L2 do not hold L1's few fill buffers, so more
// lines are in flight at once. One core of a Sapphire Rapids VM (16.5 GB/s from four interleaved
// streams), int8 weight-only, 1 bf16 row, a new copy of the weight per call:
// 3072 x 576 160 -> 140 us, 576 x 1536 80 -> 75, 960 x 576 60 -> 54 (benchmarks/bench_vllm_kernels.py
// --threads 1 --rows 1 --configs int8wo --stream-mb 256); in a scratch loop of the same kernel, the
// far fetch 2-32 tiles (4.6-74 KB) ahead measured within 5% of each other, into L1 instead 20% slower.
// In an anonymous namespace (see common.h).
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace tq {
namespace {

constexpr int64_t kStreamFarBytes = 8192;

// The line at `at` into L1 and the line kStreamFarBytes further into L2, each where it lies before
// `end` (the streamed weight's end: nothing past it is fetched).
inline void prefetch_next(const char* at, const char* end) {
  if (at < end) _mm_prefetch(at, _MM_HINT_T0);
  if (end - at > kStreamFarBytes) _mm_prefetch(at + kStreamFarBytes, _MM_HINT_T1);
}

// The lines of bytes [from, from + bytes) into L2, those before `end`: the rows a decode into scratch
// will read kStreamFarBytes from now (it reads them whole, a panel of rows at a time, so the lines
// go a row or a few at a time, not one per step).
inline void prefetch_l2(const void* from, int64_t bytes, const void* end) {
  const char* a = static_cast<const char*>(from);
  const char* e = static_cast<const char*>(end);
  for (int64_t b = 0; b < bytes && a + b < e; b += 64) _mm_prefetch(a + b, _MM_HINT_T1);
}

}  // namespace
}  // namespace tq
