// The int8 weight-only bf16 dot path's body (int8_linear.h, "bf16 dot path"), written once over
// an Ops type: the AVX512_BF16 instructions (dot_bf16_avx512.h, int8_linear_avx512bf16.cpp) or
// their emulation on arrays (dot_bf16_emulated.h, int8_dot_emulated.cpp: the same operations in the
// same order, so the same bits, on any CPU, for tests). Beside those headers' V, B, zero, x32, dp,
// sum16 and keep, Ops provides codes(w) / codes_tail(w, count) (32 int8 codes as bf16 words, zero
// past count).
// Templates in an anonymous namespace only (see common.h).
#pragma once
#include <float.h>
#include <stdint.h>

#include "dot_tiles.h"
#include "int8_linear.h"

namespace tq {
namespace {

template <class Ops>
struct Int8Dot {
  using V = typename Ops::V;
  using B = typename Ops::B;
  struct NoContext {};  // (the tiles' context: none)

  // NT weight rows from n x MT activation rows from m0: NT * MT (<= 16) accumulators over K. p.xb
  // holds chunk c's 32 positions of row m at (c * M + m) * 32 (see Int8Params), so one pointer and
  // constant offsets address a chunk's rows.
  template <int NT, int MT>
  TQ_TILE static void tile(const Int8Params& p, const NoContext&, int64_t n, int64_t m0) {
    static_assert(NT * MT <= 16, "one sum16 per tile");
    const int64_t K = p.K, step = p.M * 32;
    // every loop that indexes acc is unrolled, so that it stays in registers (indexed at run time,
    // the array lived on the stack: two rows of 3072 x 576 took 170 us against 1 row's 92)
    V acc[NT * MT];
#pragma GCC unroll 16
    for (int i = 0; i < NT * MT; ++i) acc[i] = Ops::zero();
    const int8_t* w = p.w + n * K;
    const uint16_t* x = p.xb + m0 * 32;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, x += step) {
      B xv[MT];  // loaded once for the NT weight rows
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        xv[m] = Ops::x32(x + m * 32);
        if constexpr (NT > 1) Ops::keep(xv[m]);  // kept in a register (else reloaded per weight row)
      }
#pragma GCC unroll 16
      for (int t = 0; t < NT; ++t) {
        const B wv = Ops::codes(w + t * K + k);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) acc[t * MT + m] = Ops::dp(acc[t * MT + m], wv, xv[m]);
      }
    }
    if (k < K) {  // the last codes of each row; the activations are zero-padded to kx
#pragma GCC unroll 16
      for (int t = 0; t < NT; ++t) {
        const B wv = Ops::codes_tail(w + t * K + k, K - k);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) acc[t * MT + m] = Ops::dp(acc[t * MT + m], wv, Ops::x32(x + m * 32));
      }
    }
    V v[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {  // so that lane i sums acc[i] (zero past NT * MT)
      const int i = 4 * (j % 4) + j / 4;
      v[j] = i < NT * MT ? acc[i] : Ops::zero();
    }
    alignas(64) float sums[16];
    Ops::sum16(v, sums);
    for (int t = 0; t < NT; ++t) {
      const float s = p.scale[n + t];
      for (int m = 0; m < MT; ++m) {
        const float y = s * sums[t * MT + m];
        p.out[(m0 + m) * p.N + n + t] = p.bias ? y + p.bias[n + t] : y;
      }
    }
  }

  // DotSchedule's hooks: weight rows [n, n + rows) take the path if every scale is int8_dot_scale's,
  // else the fp32 row kernel (p.x holds the fp32 rows) runs them for every activation row.
  using Params = Int8Params;
  static bool tile_ok(const Int8Params& p, const NoContext&, int64_t n, int64_t rows) {
    bool safe = true;
    for (int64_t t = 0; t < rows; ++t) safe &= int8_dot_scale(p.scale[n + t]);
    return safe;
  }

  // Output rows [n0, n1) for all M activation rows; `fallback`: the fp32 row kernel.
  static void rows(const Int8Params& p, int64_t n0, int64_t n1, Int8RowsFn fallback) {
    DotSchedule<Int8Dot>::rows(p, NoContext{}, n0, n1, p.kx * 2, p.K, fallback);
  }
};

}  // namespace
}  // namespace tq
