// The lut4 scaled dot path's body (lut4_linear.h, "scaled dot path"): 4-bit weights with an
// integer codebook and plain fp32 scales (int4 quantized from an fp32 model, any group size) against
// bf16 activations. Every code's codebook value is a bf16 word exactly, so vdpbf16ps multiplies codes
// by activations exactly and sums in fp32; each 128 positions' lanes are scaled once by their
// blocks' scales (one FMA per lane), and the zeros' term sum_b z_b X_b (X_b: the block's activation
// sum) is added per lane before the lanes are summed. Written once over an Ops type: the AVX512_BF16
// instructions (dot_bf16_avx512.h + lut4_linear_avx512bf16.cpp's Lut4ScaledDotOps) or their
// emulation on arrays (dot_bf16_emulated.h + lut4_scaled_dot_emulated.cpp: the same operations in
// the same order, so the same bits, on any CPU, for tests, the narrower last chunk (`chunk`'s LOW
// form) included; only the one-row tiles per block size are the kernel's alone). Beside those
// headers' operations, Ops provides Tab, table(codebook) (the 16 codebook values as bf16 words,
// each twice: words c and c + 16),
// weights(tab, w, bytes, q[4]) (the 128 weights of `bytes` <= 64 packed bytes at w, bytes past them
// zero: with word j the bytes 2j and 2j + 1 as a little-endian 16-bit word, q[i] word j is the value
// of its nibble at bits 4i..4i+3, the weight at position 4j + (1, 0, 3, 2)[i]), spread(v, per,
// count) (lane l: v[l / per] where l / per < count, else 0; v[count..] not read), values_ok(v, w,
// count) (the guard: every v[i] and w[i] (w may be null) 0, or normal and at most 2^100),
// weights_low(tab, w, bytes <= 32, q[4]) and dp_low(acc, a, b) (weights and dp on lanes 0-7 only,
// the rest zero) and kConstantBlocks (one-row tiles compiled per block size).
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

  // Weight rows [n, n + rows): whether all may take the path.
  static bool rows_ok(const Lut4Params& p, int64_t n, int64_t rows) {
    const int64_t G = p.blocks_per_row;
    return Ops::values_ok(p.absmax + n * G, p.zeros ? p.zeros + n * G : nullptr, rows * G);
  }

  // NT weight rows from n x MT activation rows from m0: NT * MT (<= 16) accumulators over K, in
  // chunks of 128 positions. p.xb holds chunk c of row m at (c * M + m) * 128 in the order the
  // weights come out (lut4_linear.cpp's to_chunk_order), so one pointer and constant offsets
  // address a chunk's rows. Lane i of a chunk's sums covers its positions [8 i, 8 i + 8), so a
  // block of 32 positions is 4 lanes, of 64 is 8, and a larger block all 16: one scale vector per
  // chunk.
  // One activation row on the instructions: the block size a compile-time constant (PER lanes per
  // block: 4 for blocks of 32, 8 for 64, 16 for 128 and more), so the full chunks' loads, masks and
  // scale spreads compile to fixed ones (with the half chunk below and the vectorized guard, 3072 x
  // 576 at one row on one Zen 4 core: 69 -> 64 us); else, and on the emulation (its tiles compile
  // once), PER 0: the lanes per block read from p.
  template <int NT, int MT>
  static void tile(const Lut4Params& p, const Tab& tab, int64_t n, int64_t m0) {
    if constexpr (MT == 1 && Ops::kConstantBlocks) {
      if (p.block == 32) tile_per<NT, MT, 4>(p, tab, n, m0);
      else if (p.block == 64) tile_per<NT, MT, 8>(p, tab, n, m0);
      else tile_per<NT, MT, 16>(p, tab, n, m0);
    } else {
      tile_per<NT, MT, 0>(p, tab, n, m0);
    }
  }

  // One chunk of 128 positions from k for the tile's rows: `bytes` packed bytes of each (64 but in
  // the last chunk), their scales from s[t] + si, `per` lanes per block, `blocks` scales (per 16:
  // one).
  // LOW (a last chunk of at most 64 positions): the lookups and vdpbf16ps on the low halves only
  // (lanes 0-7, positions < 64), lanes 8-15 of each sum +0, which the full width also gives there
  // (codes read as 0 against the zero-padded activations, summed onto +0): the same bits at half
  // the work (K = 576: a tenth of a row's).
  template <int NT, int MT, bool LOW = false>
  __attribute__((always_inline)) static void chunk(const Tab& tab, const uint8_t* const* w, const float* const* s, int64_t k, int64_t si,
                                                   int bytes, int per, int blocks, const uint16_t* x, V (&tot)[NT * MT]) {
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      B c[4];
      if constexpr (LOW) Ops::weights_low(tab, w[t] + k / 2, bytes, c);
      else Ops::weights(tab, w[t] + k / 2, bytes, c);
      const V sv = Ops::spread(s[t] + si, per, blocks);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const uint16_t* xm = x + m * 128;
        V a;
        if constexpr (LOW) {
          a = Ops::dp_low(Ops::zero(), c[0], Ops::x32(xm));
          a = Ops::dp_low(a, c[1], Ops::x32(xm + 32));
          a = Ops::dp_low(a, c[2], Ops::x32(xm + 64));
          a = Ops::dp_low(a, c[3], Ops::x32(xm + 96));
        } else {
          a = Ops::dp(Ops::zero(), c[0], Ops::x32(xm));
          a = Ops::dp(a, c[1], Ops::x32(xm + 32));
          a = Ops::dp(a, c[2], Ops::x32(xm + 64));
          a = Ops::dp(a, c[3], Ops::x32(xm + 96));
        }
        tot[t * MT + m] = Ops::fma(a, sv, tot[t * MT + m]);
      }
    }
  }

  // tile<NT, MT> with PER lanes per block (0: read from p).
  template <int NT, int MT, int PER>
  TQ_TILE static void tile_per(const Lut4Params& p, const Tab& tab, int64_t n, int64_t m0) {
    static_assert(NT * MT <= 16, "one sum16 per tile");
    const int64_t K = p.K, G = p.blocks_per_row, step = p.M * 128;
    const int shift = __builtin_ctzll(static_cast<unsigned long long>(p.block));  // a power of two
    const int per = PER ? PER : p.block >= 128 ? 16 : static_cast<int>(p.block / 8);  // lanes per block
    // every loop that indexes tot is unrolled, so that it stays in registers (an array indexed at
    // run time lives in memory: a store per FMA; one row of 3072 x 576 took 88 us against 73)
    V tot[NT * MT];
#pragma GCC unroll 16
    for (int i = 0; i < NT * MT; ++i) tot[i] = Ops::zero();
    const uint8_t* w[NT];
    const float* s[NT];
    for (int t = 0; t < NT; ++t) {
      w[t] = p.packed + (n + t) * (K / 2);
      s[t] = p.absmax + (n + t) * G;
    }
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    auto fetch_ahead = [&]() {  // 64 bytes of each row: as many of the next tile's
      for (int q = 0; q < 64 * NT; q += 64)
        if (ahead + q < ahead_end) _mm_prefetch(ahead + q, _MM_HINT_T0);
      ahead += 64 * NT;
    };
    const uint16_t* x = p.xb + m0 * 128;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128, x += step) {
      fetch_ahead();
      chunk<NT, MT>(tab, w, s, k, k >> shift, 64, per, per == 16 ? 1 : 16 / per, x, tot);
    }
    if (PER != 16 && k < K) {  // blocks of 128 or more divide K: no last chunk
      // the last chunk may hold 32, 64 or 96 positions: nothing past the row or its scales is read
      // (the bytes read as zero: codes whose products with the zero activations there are 0; the
      // scales of blocks past K as 0)
      fetch_ahead();
      const int bytes = static_cast<int>((K - k) / 2), blocks = per == 16 ? 1 : static_cast<int>((K - k) >> shift);
      if (bytes <= 32) chunk<NT, MT, true>(tab, w, s, k, k >> shift, bytes, per, blocks, x, tot);
      else chunk<NT, MT>(tab, w, s, k, k >> shift, bytes, per, blocks, x, tot);
    }
    if (p.zeros)  // per lane, 16 blocks at a time: z_b X_b (X_b in p.xsums [M, G])
#pragma GCC unroll 16
      for (int t = 0; t < NT; ++t)
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          const float* z = p.zeros + (n + t) * G;
          const float* xs = p.xsums + (m0 + m) * G;
          for (int64_t g = 0; g < G; g += 16) {
            const int64_t c = G - g < 16 ? G - g : 16;
            tot[t * MT + m] = Ops::fma(Ops::load_partial(z + g, c), Ops::load_partial(xs + g, c), tot[t * MT + m]);
          }
        }
    V v[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {  // so that lane i sums tot[i]
      const int i = 4 * (j % 4) + j / 4;
      v[j] = i < NT * MT ? tot[i] : Ops::zero();
    }
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
