// The int8 weight-only bf16 dot path's body (int8_linear.h, "bf16 dot path"), written once over
// an Ops type: the AVX512_BF16 instructions (int8_linear_avx512bf16.cpp) or their emulation on
// arrays (int8_dot_emulated.cpp: the same operations in the same order, so the same bits, on any
// CPU, for tests). Ops provides V (16 fp32 lanes), B (32 bf16 words) and
//   zero(), codes(w) / codes_tail(w, count) (32 int8 codes as bf16 words, zero past count),
//   x32(p) (32 bf16 words), dp(acc, a, b) (vdpbf16ps: lane i += a[2i+1] b[2i+1], then += a[2i] b[2i],
//   each an fp32 rounding), sum16(v, out) (lane 4q + r of the shuffle tree: the sum of v[4r + q]),
//   keep(b) (a register hint).
// Templates in an anonymous namespace only (see common.h).
#pragma once
#include <float.h>
#include <stdint.h>

#include "int8_linear.h"
#include "tiling.h"

namespace tq {
namespace {

template <class Ops>
struct Int8Dot {
  using V = typename Ops::V;
  using B = typename Ops::B;

  // Whether scale s lets a weight row take the dot path: 0, or finite and normal (its product with
  // the fp32 sum is then the reference's weights' up to rounding; inf / NaN scales would give inf
  // where the reference's 0 * inf weights give NaN).
  static bool dot_scale(float s) { return s == 0.0f || (__builtin_fabsf(s) >= FLT_MIN && __builtin_fabsf(s) <= FLT_MAX); }

  // NT weight rows from n x MT activation rows from m0: NT * MT (<= 16) accumulators over K. p.xb
  // holds chunk c's 32 positions of row m at (c * M + m) * 32 (see Int8Params), so one pointer and
  // constant offsets address a chunk's rows.
  template <int NT, int MT>
  TQ_TILE static void tile(const Int8Params& p, int64_t n, int64_t m0) {
    static_assert(NT * MT <= 16, "one sum16 per tile");
    const int64_t K = p.K, step = p.M * 32;
    V acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = Ops::zero();
    const int8_t* w = p.w + n * K;
    const uint16_t* x = p.xb + m0 * 32;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, x += step) {
      B xv[MT];  // loaded once for the NT weight rows
      for (int m = 0; m < MT; ++m) {
        xv[m] = Ops::x32(x + m * 32);
        if constexpr (NT > 1) Ops::keep(xv[m]);  // kept in a register (else reloaded per weight row)
      }
      for (int t = 0; t < NT; ++t) {
        const B wv = Ops::codes(w + t * K + k);
        for (int m = 0; m < MT; ++m) acc[t * MT + m] = Ops::dp(acc[t * MT + m], wv, xv[m]);
      }
    }
    if (k < K) {  // the last codes of each row; the activations are zero-padded to kx
      for (int t = 0; t < NT; ++t) {
        const B wv = Ops::codes_tail(w + t * K + k, K - k);
        for (int m = 0; m < MT; ++m) acc[t * MT + m] = Ops::dp(acc[t * MT + m], wv, Ops::x32(x + m * 32));
      }
    }
    V v[16];
    for (int j = 0; j < 16; ++j) v[j] = acc[4 * (j % 4) + j / 4];  // so that lane i sums acc[i]
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

  // The activation rows a tile runs at once: up to 8 (x loaded once per 2 weight rows: at 16 rows,
  // 0.85-0.94x bf16 F.linear in chunks of 8 against 0.80-0.93x in chunks of 16 and 0.71-0.78x in
  // chunks of 4, one Zen 4 core, SmolLM2's shapes), fewer where their K positions would exceed
  // kDotChunkBytes (they are read once per weight tile: from L1 while they fit there; 576 x 1536 at
  // 16 rows took 313 us in chunks of 16, 48 KB, and 220 in chunks of 8), but at least 4.
  static constexpr int64_t kDotChunkBytes = 24 << 10, kDotChunkMaxRows = 8;

  // The weight rows a block holds: as many as keep their codes within kDotBlockBytes (a multiple of
  // 8 rows, at least 8). Above one chunk of activation rows, each chunk runs over a block before the
  // next chunk does, so the block's codes (and the chunk's activations) are read from L1.
  static constexpr int64_t kDotBlockBytes = 16 << 10;

  // Activation rows [m0, m0 + mt) (mt <= chunk) against the NT weight rows from n, in tiles of up to
  // 16 accumulators.
  template <int NT>
  static void weight_rows(const Int8Params& p, int64_t n, int64_t m0, int64_t mt) {
    with_tile_size<kDotChunkMaxRows>(mt, [&](auto size) {
      constexpr int MT = decltype(size)::value;
      constexpr int fit = 16 / MT < NT ? 16 / MT : NT;  // the most weight rows per tile at MT
      for (int t = 0; t < NT; t += fit) {
        if (t + fit <= NT) {
          tile<fit, MT>(p, n + t, m0);
        } else {
          with_tile_size<fit>(NT - t, [&](auto rest) { tile<decltype(rest)::value, MT>(p, n + t, m0); });
        }
      }
    });
  }

  // Weight rows [n0, n1) in tiles of NT: blocks of rows, each block's tiles for one chunk of
  // activation rows at a time. A tile holding a scale that is not dot_scale's runs the fp32 row
  // kernel for every activation row (p.x holds the fp32 rows) instead.
  template <int NT>
  static void blocks(const Int8Params& p, int64_t n0, int64_t n1, int64_t chunk, Int8RowsFn fallback) {
    int64_t block = kDotBlockBytes / p.K / 8 * 8;
    if (block < 8) block = 8;
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
      for (int64_t m0 = 0; m0 < p.M; m0 += chunk) {
        const int64_t mt = p.M - m0 < chunk ? p.M - m0 : chunk;
        tiles_then_singles<NT>(b0, b1, [&](auto r, int64_t n) {
          constexpr int R = decltype(r)::value;
          bool safe = true;
          for (int t = 0; t < R; ++t) safe &= dot_scale(p.scale[n + t]);
          if (safe) weight_rows<R>(p, n, m0, mt);
          else if (m0 == 0) fallback(p, n, n + R);
        });
      }
    }
  }

  // Output rows [n0, n1) for all M activation rows; `fallback`: the fp32 row kernel.
  static void rows(const Int8Params& p, int64_t n0, int64_t n1, Int8RowsFn fallback) {
    int64_t chunk = kDotChunkBytes / (p.kx * 2);
    chunk = chunk < 4 ? 4 : chunk > kDotChunkMaxRows ? kDotChunkMaxRows : chunk;
    if (chunk > p.M) chunk = p.M;
    // weight tiles of NT rows: as many as 16 accumulators allow at the call's widest chunk
    if (chunk <= 2) blocks<8>(p, n0, n1, chunk, fallback);
    else if (chunk <= 4) blocks<4>(p, n0, n1, chunk, fallback);
    else if (chunk <= 5) blocks<3>(p, n0, n1, chunk, fallback);
    else blocks<2>(p, n0, n1, chunk, fallback);
  }
};

}  // namespace
}  // namespace tq
