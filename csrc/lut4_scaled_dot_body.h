// The lut4 scaled dot path's body (lut4_linear.h, "scaled dot path"): 4-bit weights with an
// integer codebook and plain fp32 scales (int4 quantized from an fp32 model, any group size) against
// bf16 activations. Every code's codebook value is a bf16 word exactly, so vdpbf16ps multiplies codes
// by activations exactly and sums in fp32; each 64 positions' lanes are scaled once by their block's
// scale (one FMA per lane), and the zeros' term sum_b z_b X_b (X_b: the block's activation sum) is
// added per lane before the lanes are summed. Written once over an Ops type: the AVX512_BF16
// instructions (dot_bf16_avx512.h + lut4_linear_avx512bf16.cpp's Lut4ScaledDotOps) or their
// emulation on arrays (dot_bf16_emulated.h + lut4_scaled_dot_emulated.cpp: the same operations in
// the same order, so the same bits, on any CPU, for tests). Beside those headers' operations, Ops
// provides Tab, table(codebook) (the 16 codebook values as bf16 words, each twice: words c and
// c + 16) and weights(tab, w, bytes, lo, hi) (bytes = 32 or 16 packed bytes at w: lo word j the
// low nibble's value of byte j, hi word j the high nibble's; words past `bytes` from zero bytes).
// Templates in an anonymous namespace only (see common.h).
#pragma once
#include <float.h>
#include <stdint.h>
#include <string.h>
#include <xmmintrin.h>

#include "dot_tiles.h"
#include "lut4_linear.h"

namespace tq {
namespace {

template <class Ops>
struct Lut4ScaledDot {
  using V = typename Ops::V;
  using B = typename Ops::B;
  using Tab = typename Ops::Tab;

  // Whether each of the scales or zeros v[0..count) lets its weight row take the path: 0, or normal
  // and at most 2^100 (so that no weight c s is subnormal or overflows where the reference's would not;
  // inf / NaN scales would give NaN where the reference's weights give inf). On the bits, so that
  // the loop vectorizes (a scalar check per value cost as much as the row's dot products).
  static bool values_ok(const float* v, int64_t count) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      uint32_t u;
      memcpy(&u, v + i, sizeof u);
      const uint32_t a = u & 0x7FFFFFFFu;
      bad |= static_cast<uint32_t>(a != 0u) & static_cast<uint32_t>(a - 0x00800000u > 0x71800000u - 0x00800000u);
    }
    return bad == 0;
  }
  // Weight rows [n, n + rows): whether all may take the path.
  static bool rows_ok(const Lut4Params& p, int64_t n, int64_t rows) {
    const int64_t G = p.blocks_per_row;
    return values_ok(p.absmax + n * G, rows * G) && (!p.zeros || values_ok(p.zeros + n * G, rows * G));
  }


  // NT weight rows from n x MT activation rows from m0: NT * MT (<= 16) accumulators over K. p.xb
  // holds positions [64 j, 64 j + 64) of row m at (j * M + m) * 64 (the 32 odd positions, then the
  // 32 even ones), so one pointer and constant offsets address a step's rows.
  template <int NT, int MT>
  TQ_TILE static void tile(const Lut4Params& p, const Tab& tab, int64_t n, int64_t m0) {
    static_assert(NT * MT <= 16, "one sum16 per tile");
    const int64_t K = p.K, G = p.blocks_per_row, step = p.M * 64;
    const int shift = __builtin_ctzll(static_cast<unsigned long long>(p.block));  // a power of two
    const bool pairs = p.block == 32;  // a step's halves are two blocks
    V tot[16];
    for (int i = 0; i < 16; ++i) tot[i] = Ops::zero();
    const uint8_t* w[NT];
    const float* s[NT];
    for (int t = 0; t < NT; ++t) {
      w[t] = p.packed + (n + t) * (K / 2);
      s[t] = p.absmax + (n + t) * G;
    }
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    const uint16_t* x = p.xb + m0 * 64;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64, x += step) {  // 32 bytes of each row: as many of the next tile's
      for (int q = 0; q < 32 * NT; q += 64)
        if (ahead + q < ahead_end) _mm_prefetch(ahead + q, _MM_HINT_T0);
      ahead += 32 * NT;
      for (int t = 0; t < NT; ++t) {
        B lo, hi;
        Ops::weights(tab, w[t] + k / 2, 32, lo, hi);
        const V sv = pairs ? Ops::halves(s[t] + k / 32) : Ops::set1(s[t][k >> shift]);
        for (int m = 0; m < MT; ++m) {
          V a = Ops::dp(Ops::zero(), lo, Ops::x32(x + m * 64));
          a = Ops::dp(a, hi, Ops::x32(x + m * 64 + 32));
          tot[t * MT + m] = Ops::fma(a, sv, tot[t * MT + m]);
        }
      }
    }
    if (k < K) {  // the last 32 positions (K % 64 == 32: blocks of 32): the upper words' activations are zero
      for (int t = 0; t < NT; ++t) {
        B lo, hi;
        Ops::weights(tab, w[t] + k / 2, 16, lo, hi);
        const V sv = Ops::set1(s[t][k / 32]);
        for (int m = 0; m < MT; ++m) {
          V a = Ops::dp(Ops::zero(), lo, Ops::x32(x + m * 64));
          a = Ops::dp(a, hi, Ops::x32(x + m * 64 + 32));
          tot[t * MT + m] = Ops::fma(a, sv, tot[t * MT + m]);
        }
      }
    }
    if (p.zeros)  // per lane, 16 blocks at a time: z_b X_b (X_b in p.xsums [M, G])
      for (int t = 0; t < NT; ++t)
        for (int m = 0; m < MT; ++m) {
          const float* z = p.zeros + (n + t) * G;
          const float* xs = p.xsums + (m0 + m) * G;
          for (int64_t g = 0; g < G; g += 16) {
            const int64_t c = G - g < 16 ? G - g : 16;
            tot[t * MT + m] = Ops::fma(Ops::load_partial(z + g, c), Ops::load_partial(xs + g, c), tot[t * MT + m]);
          }
        }
    V v[16];
    for (int j = 0; j < 16; ++j) v[j] = tot[4 * (j % 4) + j / 4];  // so that lane i sums tot[i]
    alignas(64) float sums[16];
    Ops::sum16(v, sums);
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float y = sums[t * MT + m];
        p.out[(m0 + m) * p.N + n + t] = p.bias ? y + p.bias[n + t] : y;
      }
  }

  // DotSchedule's hooks: a tile's values are fetched for the next tile and checked (rows_ok); the
  // table path (p.xp holds its activations) runs refused rows.
  using Params = Lut4Params;
  static bool tile_ok(const Lut4Params& p, int64_t n, int64_t rows) {
    lut4_prefetch_values(p, n + rows, rows);  // the next tile's
    return rows_ok(p, n, rows);
  }

  // Output rows [n0, n1) for all M activation rows; `fallback`: the table path's rows.
  static void rows(const Lut4Params& p, int64_t n0, int64_t n1, Lut4RowsFn fallback) {
    DotSchedule<Lut4ScaledDot>::rows(p, Ops::table(p.codebook), n0, n1, p.kx * 2, p.K / 2, fallback);
  }
};

}  // namespace
}  // namespace tq
