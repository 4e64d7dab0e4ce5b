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
// weights_low(tab, w, bytes <= 32, q[4]) and dp_low(acc, a, b) (weights and dp on lanes 0-7 only:
// the other words zero, the other lanes acc's) and kConstantBlocks (one-row tiles compiled per block size); for the table kind
// (NF4 / FP4, lut4_linear.h) also code(codebook) (the 16 values as V), table2(code, a, b) (words
// 0-15 the bf16 roundings of code * a, words 16-31 of code * b: vcvtne2ps2bf16), weights_split(tab,
// w, q) (weights() of 64 bytes with each index's bit 4 set for words 16-31: the second block of 64)
// and decode_scales(p, b0, count, dst) (lut4_scale of flat blocks [b0, b0 + count), bit for bit).
// Templates in an anonymous namespace only (see common.h).
#pragma once
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xmmintrin.h>

#include "dot_tiles.h"
#include "lut4_linear.h"

namespace tq {
namespace {

// The table kind's tile context: the codebook, and where absmax is double-quantized, the tile's
// decoded absmax (tile_ok fills it for weight rows [decoded_n0, decoded_n0 + capacity / G)).
template <class Ops>
struct Lut4TableDotContext {
  typename Ops::V code;
  float* decoded;  // null: plain absmax
  int64_t capacity;
  mutable int64_t decoded_n0;
};

// The tiles' context: the scaled kind's table (a vector type: not a template argument, which would
// lose its attributes), or the table kind's.
template <class Ops, bool TABLE>
struct Lut4ScaledDotContext {
  using type = typename Ops::Tab;
};
template <class Ops>
struct Lut4ScaledDotContext<Ops, true> {
  using type = Lut4TableDotContext<Ops>;
};

// TABLE: the table kind (NF4 / FP4: per-chunk tables of bf16 weights, lut4_linear.h); else the
// scaled kind (integer codebooks, a scale FMA per chunk).
template <class Ops, bool TABLE>
struct Lut4ScaledDot {
  using V = typename Ops::V;
  using B = typename Ops::B;
  using Tab = typename Ops::Tab;
  using Ctx = typename Lut4ScaledDotContext<Ops, TABLE>::type;

  // The scales of weight row n (the table kind's double-quantized absmax: decoded by tile_ok).
  static const float* scales(const Lut4Params& p, const Ctx& ctx, int64_t n) {
    if constexpr (TABLE)
      if (ctx.decoded) return ctx.decoded + (n - ctx.decoded_n0) * p.blocks_per_row;
    return p.absmax + n * p.blocks_per_row;
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
  static void tile(const Lut4Params& p, const Ctx& ctx, int64_t n, int64_t m0) {
    if constexpr (MT == 1 && Ops::kConstantBlocks) {
      if (!TABLE && p.block == 32) tile_per<NT, MT, 4>(p, ctx, n, m0);
      else if (p.block == 64) tile_per<NT, MT, 8>(p, ctx, n, m0);
      else tile_per<NT, MT, 16>(p, ctx, n, m0);
    } else {
      tile_per<NT, MT, 0>(p, ctx, n, m0);
    }
  }

  // One chunk of 128 positions from k for the tile's rows: `bytes` packed bytes of each (64 but in
  // the last chunk), their scales from s[t] + si, `per` lanes per block, `blocks` scales (per 16:
  // one).
  // LOW (a last chunk of at most 64 positions): the lookups and vdpbf16ps on the low halves only
  // (lanes 0-7, positions < 64), lanes 8-15 of each sum unchanged (+0 in the scaled kind's chunk
  // sums), which the full width also gives there (codes read as 0 against the zero-padded
  // activations, products +0 added): the same bits at half the work (K = 576: a tenth of a row's).
  template <int NT, int MT, bool LOW = false>
  __attribute__((always_inline)) static void chunk(const Ctx& ctx, const uint8_t* const* w, const float* const* s, int64_t k, int64_t si,
                                                   int bytes, int per, int blocks, const uint16_t* x, V (&tot)[NT * MT]) {
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      B c[4];
      V sv;
      if constexpr (TABLE) {  // the chunk's one or two blocks' bf16 weights (a LOW chunk: one block of 64)
        const float a = s[t][si], b = LOW || per == 16 ? a : s[t][si + 1];
        const Tab tab = Ops::table2(ctx.code, a, b);
        if constexpr (LOW) Ops::weights_low(tab, w[t] + k / 2, bytes, c);
        else if (per == 16) Ops::weights(tab, w[t] + k / 2, bytes, c);  // both halves the one block's
        else Ops::weights_split(tab, w[t] + k / 2, c);
      } else {
        if constexpr (LOW) Ops::weights_low(ctx, w[t] + k / 2, bytes, c);
        else Ops::weights(ctx, w[t] + k / 2, bytes, c);
        sv = Ops::spread(s[t] + si, per, blocks);
      }
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const uint16_t* xm = x + m * 128;
        V a = TABLE ? tot[t * MT + m] : Ops::zero();  // the table kind's weights are scaled: straight into the sums
        if constexpr (LOW) {
          a = Ops::dp_low(a, c[0], Ops::x32(xm));
          a = Ops::dp_low(a, c[1], Ops::x32(xm + 32));
          a = Ops::dp_low(a, c[2], Ops::x32(xm + 64));
          a = Ops::dp_low(a, c[3], Ops::x32(xm + 96));
        } else {
          a = Ops::dp(a, c[0], Ops::x32(xm));
          a = Ops::dp(a, c[1], Ops::x32(xm + 32));
          a = Ops::dp(a, c[2], Ops::x32(xm + 64));
          a = Ops::dp(a, c[3], Ops::x32(xm + 96));
        }
        if constexpr (TABLE) tot[t * MT + m] = a;
        else tot[t * MT + m] = Ops::fma(a, sv, tot[t * MT + m]);
      }
    }
  }

  // tile<NT, MT> with PER lanes per block (0: read from p).
  template <int NT, int MT, int PER>
  TQ_TILE static void tile_per(const Lut4Params& p, const Ctx& ctx, int64_t n, int64_t m0) {
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
      s[t] = scales(p, ctx, n + t);
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
      chunk<NT, MT>(ctx, w, s, k, k >> shift, 64, per, per == 16 ? 1 : 16 / per, x, tot);
    }
    if (PER != 16 && k < K) {  // blocks of 128 or more divide K: no last chunk
      // the last chunk may hold 32, 64 or 96 positions: nothing past the row or its scales is read
      // (the bytes read as zero: codes whose products with the zero activations there are 0; the
      // scales of blocks past K as 0)
      fetch_ahead();
      const int bytes = static_cast<int>((K - k) / 2), blocks = per == 16 ? 1 : static_cast<int>((K - k) >> shift);
      if (bytes <= 32) chunk<NT, MT, true>(ctx, w, s, k, k >> shift, bytes, per, blocks, x, tot);
      // (the table kind's last chunk is always 32 bytes: its blocks are multiples of 64 positions
      // and divide K, lut4_linear.cpp's valid_shape)
      else if constexpr (!TABLE) chunk<NT, MT>(ctx, w, s, k, k >> shift, bytes, per, blocks, x, tot);
    }
    if (!TABLE && p.zeros)  // per lane, 16 blocks at a time: z_b X_b (X_b in p.xsums [M, G])
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

  // DotSchedule's hooks: a tile's values are fetched for the next tile, decoded (the table kind's
  // double-quantized absmax) and checked; the table path (p.xp holds its activations) runs refused
  // rows.
  using Params = Lut4Params;
  static bool tile_ok(const Lut4Params& p, const Ctx& ctx, int64_t n, int64_t rows) {
    lut4_prefetch_values(p, n + rows, rows);  // the next tile's
    const int64_t G = p.blocks_per_row;
    if constexpr (TABLE) {
      if (ctx.decoded) {
        if (rows * G > ctx.capacity) return false;
        Ops::decode_scales(p, n * G, rows * G, ctx.decoded);
        ctx.decoded_n0 = n;
      }
      return Ops::values_ok(scales(p, ctx, n), nullptr, rows * G, kLut4TableDotMinBits);
    }
    return Ops::values_ok(p.absmax + n * G, p.zeros ? p.zeros + n * G : nullptr, rows * G, kFltMinBits);
  }
  static constexpr uint32_t kFltMinBits = 0x00800000u;  // the scaled kind's least admitted magnitude

  // Output rows [n0, n1) for all M activation rows; `fallback`: the table path's rows.
  static void rows(const Lut4Params& p, const Ctx& ctx, int64_t n0, int64_t n1, Lut4RowsFn fallback) {
    DotSchedule<Lut4ScaledDot>::rows(p, ctx, n0, n1, p.kx * 2, p.K / 2, fallback);
  }
};

// The path's rows: the scaled kind for lut4_scaled_dot_allowed weights, else the table kind (the
// caller allows only those two).
template <class Ops>
struct Lut4ScaledDotPath {
  // The most weight rows a tile_ok call checks (DotSchedule's widest tile).
  static constexpr int64_t kMaxTileRows = 8;

  static void rows(const Lut4Params& p, int64_t n0, int64_t n1, Lut4RowsFn fallback) {
    if (lut4_scaled_dot_allowed(p)) {
      Lut4ScaledDot<Ops, false>::rows(p, Ops::table(p.codebook), n0, n1, fallback);
      return;
    }
    Lut4TableDotContext<Ops> ctx{Ops::code(p.codebook), nullptr, 0, 0};
    if (!p.absmax) {  // double-quantized: a tile's decoded absmax (where it cannot be had, the table path)
      ctx.capacity = kMaxTileRows * p.blocks_per_row;
      ctx.decoded = static_cast<float*>(aligned_alloc(64, (ctx.capacity * sizeof(float) + 63) / 64 * 64));
      if (!ctx.decoded) {
        fallback(p, n0, n1);
        return;
      }
    }
    Lut4ScaledDot<Ops, true>::rows(p, ctx, n0, n1, fallback);
    free(ctx.decoded);
  }
};

}  // namespace
}  // namespace tq
