// The VNNI panel kernel's body (int8_linear.h, "Panel order"), over an Ops that gives its
// instructions: on AVX-512 VNNI (int8_linear_avx512.cpp) and emulated in portable C++
// (int8_panel_emulated.cpp: the same sums and outputs on any CPU, for tests). Register tiles of
// R <= 4 activation rows x P <= 4 panels (64 weight rows): per step of 4 positions, each panel's 64
// bytes (16 rows x 4 codes, as stored) and each row's 4 codes + 128 broadcast meet in one vpdpbusd
// (per lane: the sum of 4 unsigned x signed byte products added to an int32, modulo 2^32); then
// minus 128 * the stored row sums, and the row's output (Ops::finish). Ops:
//   V: 16 int32 lanes;  zero();  load(const int8_t* 64 bytes);  broadcast(int32 4 codes);
//   dpbusd(acc, broadcast, weights);  pin(V&) (keeps a register accumulator a register);
//   finish(p, acc, m, first, count): output row m, weight rows [first, first + count) (count <= 16).
// In an anonymous namespace (see common.h).
#pragma once
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "int8_linear.h"

namespace tq {
namespace {

// The static form's outputs (p.row_sums set) of one activation row m and weight rows
// [first, first + count) from their int32 sums d (minus 128 * the row sums already): minus z * the
// row's sum in int64, as the row kernels, times the activation scale, times the weight row's scale.
inline void int8_panel_static_outputs(const Int8Params& p, const int32_t* d, int64_t m, int64_t first, int64_t count,
                                      float* f) {
  for (int64_t t = 0; t < count; ++t) {
    const int64_t total = static_cast<int64_t>(d[t]) - static_cast<int64_t>(p.zero_point) * p.row_sums[first + t];
    f[t] = (static_cast<float>(total) * p.xs[m]) * p.scale[first + t];
  }
}

// Output rows [n, n + cols) (cols <= 16 * P) for activation rows [m0, m0 + R). noinline: each
// instantiation is its own function, so its accumulators are pinned in registers (GCC otherwise
// rotates them through copies every step).
template <class Ops, int R, int P>
__attribute__((noinline)) void int8_panel_tile(const Int8Params& p, int64_t m0, int64_t n, int64_t cols) {
  using V = typename Ops::V;
  const int64_t steps = p.Kp / 4, panel_bytes = steps * 64;
  const int8_t* base = p.w + int8_panel_offset(n, p.Kp);
  V acc[R][P];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) acc[r][j] = Ops::zero();
  for (int64_t s = 0; s < steps; ++s) {
    V b[P];
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) b[j] = Ops::load(base + j * panel_bytes + s * 64);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      memcpy(&x4, p.xu + (m0 + r) * p.Kp + 4 * s, 4);
      const V xb = Ops::broadcast(x4);
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) {
        acc[r][j] = Ops::dpbusd(acc[r][j], xb, b[j]);
        Ops::pin(acc[r][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < P; ++j) {
    const int64_t left = cols - 16 * j;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) Ops::finish(p, acc[r][j], m0 + r, n + 16 * j, left < 16 ? left : 16);
  }
}

template <class Ops, int R>
void int8_panel_block(const Int8Params& p, int64_t m0, int64_t n, int64_t cols) {
  switch ((cols + 15) / 16) {
    case 1: int8_panel_tile<Ops, R, 1>(p, m0, n, cols); break;
    case 2: int8_panel_tile<Ops, R, 2>(p, m0, n, cols); break;
    case 3: int8_panel_tile<Ops, R, 3>(p, m0, n, cols); break;
    default: int8_panel_tile<Ops, R, 4>(p, m0, n, cols); break;
  }
}

// Output rows [n0, n1) (n0 a multiple of 16) for p.M activation rows: per 64 weight rows, the
// activation rows 4 at a time (the 64 rows' panels stay in L1 between them).
template <class Ops>
void int8_panel_rows(const Int8Params& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += 64) {
    const int64_t cols = n1 - n < 64 ? n1 - n : 64;
    int64_t m = 0;
    for (; m + 4 <= p.M; m += 4) int8_panel_block<Ops, 4>(p, m, n, cols);
    switch (p.M - m) {
      case 1: int8_panel_block<Ops, 1>(p, m, n, cols); break;
      case 2: int8_panel_block<Ops, 2>(p, m, n, cols); break;
      case 3: int8_panel_block<Ops, 3>(p, m, n, cols); break;
      default: break;
    }
  }
}

}  // namespace
}  // namespace tq
