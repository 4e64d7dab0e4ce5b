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

// Rows [n0, n1) of w as bf16 q * s (int8_linear.h, "bf16 dequantization"), row n at out + (n - n0) * K:
// 32 codes at a time as fp32, times s, rounded to bf16 by Ops::store_bf16 (nearest even). Rows whose
// scale fails int8_dot_scale, and fp32 outputs, take `exact` (the generic kernel). Ops: V (16 fp32
// lanes); codes_f32(w, count, lo, hi): codes w[0..count) (count <= 32) as fp32, zero after, nothing
// read past w + count; mul(V, float); store_bf16(dst, lo, hi, count): the first count of the 32
// values rounded to bf16, nothing written past dst + count.
template <class Ops>
void int8_dequant_bf16(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16,
                       Int8DequantFn exact) {
  if (!bf16) {
    exact(w, scale, K, n0, n1, out, bf16);
    return;
  }
  for (int64_t n = n0; n < n1; ++n) {
    uint16_t* dst = static_cast<uint16_t*>(out) + (n - n0) * K;
    const float s = scale[n];
    if (!int8_dot_scale(s)) {
      exact(w, scale, K, n, n + 1, dst, true);
      continue;
    }
    const int8_t* row = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t count = K - k < 32 ? K - k : 32;
      typename Ops::V lo, hi;
      Ops::codes_f32(row + k, count, lo, hi);
      Ops::store_bf16(dst + k, Ops::mul(lo, s), Ops::mul(hi, s), count);
    }
  }
}

}  // namespace
}  // namespace tq
