// The lut4 bf16 dot path's body (lut4_linear.h, "bf16 dot path"): 4-bit weights whose entries are
// rounded to bf16 (int4 with bf16 scales and zeros, lut4_bf16_dot_weights) against bf16 activations.
// Per 64 positions the weights come from a 32-word bf16 table: two blocks' 16 entries [A | B] for
// blocks of 32 (bytes 0..15 index A's half, 16..31 B's), or one block's twice for blocks of a multiple
// of 64 (one table per block, built once); vdpbf16ps multiplies them with the activations (exact
// products, fp32 sums), and the tile's accumulators are summed by one shuffle tree. Written once over
// an Ops type: the AVX512_BF16 instructions (dot_bf16_avx512.h + lut4_linear_avx512bf16.cpp's
// Lut4DotOps) or their emulation on arrays (dot_bf16_emulated.h + lut4_dot_emulated.cpp: the same
// operations in the same order, so the same bits, on any CPU, for tests). Beside those headers'
// operations, Ops provides Tab, table(p, i, j) (the bf16 entries R(R((codebook[c] + shift) s) + z)
// of flat blocks i and j, j < 0: B's words +0) and weights(tab, w, bytes, lo, hi) (32 or 16 packed
// bytes at w, words past `bytes` from zero bytes: lo word j tab[(byte j & 15) + 16 (j >= 16)], hi word
// j tab[(byte j >> 4) + 16 (j >= 16)]). Templates in an anonymous namespace only (see common.h).
#pragma once
#include <stdint.h>
#include <string.h>
#include <xmmintrin.h>

#include "lut4_linear.h"
#include "tiling.h"

namespace tq {
namespace {

template <class Ops>
struct Lut4DotBody {
  using V = typename Ops::V;
  using B = typename Ops::B;
  using Tab = typename Ops::Tab;

  // Whether every value of v[0..count) is 0, inf, NaN or of magnitude >= 2^-59 (then every weight
  // is 0 or at least 2^-66 and no product or table sum is subnormal: vdpbf16ps and vcvtne2ps2bf16
  // read subnormals as zero).
  // On the bits, so that the loop vectorizes: the scalar form (a bool per value) cost 18% of a
  // two-row call on SmolLM2's 3072 x 576.
  static bool dot_safe(const float* v, int64_t count) {
    constexpr uint32_t kTiny = (127u - 59u) << 23;  // the bits of 2^-59
    uint32_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      uint32_t u;
      memcpy(&u, v + i, sizeof u);
      bad |= static_cast<uint32_t>((u & 0x7FFFFFFFu) - 1u < kTiny - 1u);  // nonzero and below 2^-59
    }
    return bad == 0;
  }

  // The 64 positions from 32-position unit g: weights from the packed bytes at w (`bytes` of them)
  // and tab into every activation row's accumulator (p.xb: row m's positions [64 j, 64 j + 64) at
  // m * p.kx + 64 j, the 32 odd positions then the 32 even ones).
  template <int MT>
  __attribute__((always_inline)) static void dot(const Lut4Params& p, const Tab& tab, const uint8_t* w, int bytes, int64_t g, V (&acc)[MT]) {
    B lo, hi;
    Ops::weights(tab, w, bytes, lo, hi);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const uint16_t* x = p.xb + m * p.kx + g * 32;
      acc[m] = Ops::dp(acc[m], lo, Ops::x32(x));
      acc[m] = Ops::dp(acc[m], hi, Ops::x32(x + 32));
    }
  }

  // NT weight rows from n x all MT activation rows: NT * MT (<= 16) accumulators over K.
  template <int NT, int MT>
  TQ_TILE static void tile(const Lut4Params& p, int64_t n) {
    static_assert(NT * MT <= 16, "one sum16 per tile");
    const int64_t G = p.blocks_per_row, K = p.K;
    // an array per weight row, passed by reference; every loop that indexes acc or tab is unrolled,
    // so that they stay in registers (an array indexed at run time lives in memory)
    V acc[NT][MT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[t][m] = Ops::zero();
    const uint8_t* w[NT];
    for (int t = 0; t < NT; ++t) w[t] = p.packed + (n + t) * (K / 2);
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    if (p.block == 32) {  // pairs of blocks: a table per 64 positions
      int64_t g = 0;
      for (; g + 1 < G; g += 2) {  // 64 positions: one line of each row, two of the next tile's
        if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
        if (ahead + 64 < ahead_end) _mm_prefetch(ahead + 64, _MM_HINT_T0);
        ahead += 32 * NT;
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) dot<MT>(p, Ops::table(p, (n + t) * G + g, (n + t) * G + g + 1), w[t] + g * 16, 32, g, acc[t]);
      }
      if (g < G)  // the last block alone: B's bytes and table words zero (as its padded activations)
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) dot<MT>(p, Ops::table(p, (n + t) * G + g, -1), w[t] + g * 16, 16, g, acc[t]);
    } else {  // blocks of a multiple of 64 positions: one table per block, block / 64 steps of 64 positions
      const int64_t units = p.block / 32;  // 32-position units per block
      for (int64_t b = 0; b < G; ++b) {
        Tab tab[NT];
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) tab[t] = Ops::table(p, (n + t) * G + b, (n + t) * G + b);
        for (int64_t g = b * units; g < (b + 1) * units; g += 2) {
          if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
          if (ahead + 64 < ahead_end) _mm_prefetch(ahead + 64, _MM_HINT_T0);
          ahead += 32 * NT;
#pragma GCC unroll 16
          for (int t = 0; t < NT; ++t) dot<MT>(p, tab[t], w[t] + g * 16, 32, g, acc[t]);
        }
      }
    }
    V v[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {  // so that lane i sums accumulator i (t * MT + m)
      const int i = 4 * (j % 4) + j / 4;
      v[j] = i < NT * MT ? acc[i / MT][i % MT] : Ops::zero();
    }
    alignas(64) float sums[16];
    Ops::sum16(v, sums);
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float s = sums[t * MT + m];
        p.out[m * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
      }
  }

  // Tiles of NT weight rows: 4 for up to 4 activation rows, 2 up to 8, else 1 (NT x M <= 16
  // accumulators). A tile with a scale or zero that could make a product subnormal runs `fallback`
  // (the table path; p.xp is prepared too).
  template <int NT, int MT>
  static void rows_m(const Lut4Params& p, int64_t n0, int64_t n1, Lut4RowsFn fallback) {
    const int64_t G = p.blocks_per_row;
    tiles_then_singles<NT>(n0, n1, [&](auto nt, int64_t n) {
      constexpr int R = decltype(nt)::value;
      lut4_prefetch_values(p, n + R, R);  // the next tile's, so that its check does not wait for them
      const bool safe = dot_safe(p.absmax + n * G, R * G) && (!p.zeros || dot_safe(p.zeros + n * G, R * G));
      if (safe) tile<R, MT>(p, n);
      else fallback(p, n, n + R);
    });
  }

  static void rows(const Lut4Params& p, int64_t n0, int64_t n1, Lut4RowsFn fallback) {
    switch (p.M) {
#define TQ_DOT_CASE(m) \
  case m: return rows_m<(m <= 4 ? 4 : m <= 8 ? 2 : 1), m>(p, n0, n1, fallback);
      TQ_DOT_CASE(1) TQ_DOT_CASE(2) TQ_DOT_CASE(3) TQ_DOT_CASE(4) TQ_DOT_CASE(5) TQ_DOT_CASE(6) TQ_DOT_CASE(7) TQ_DOT_CASE(8)
      TQ_DOT_CASE(9) TQ_DOT_CASE(10) TQ_DOT_CASE(11) TQ_DOT_CASE(12) TQ_DOT_CASE(13) TQ_DOT_CASE(14) TQ_DOT_CASE(15) TQ_DOT_CASE(16)
#undef TQ_DOT_CASE
      default: return fallback(p, n0, n1);  // not reached: the caller takes it for M <= kLut4DotMaxM
    }
  }
};
static_assert(kLut4DotMaxM == 16, "Lut4DotBody::rows has a case per M");

}  // namespace
}  // namespace tq
