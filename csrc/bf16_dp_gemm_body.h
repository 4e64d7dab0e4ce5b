// The bf16 dot-product GEMM's body (bf16_dp_gemm.h), written once over an Ops type:
// dot_bf16_avx512.h's or dot_bf16_emulated.h's operations, and for the int8 form codes(w) /
// codes_tail(w, count) (32 int8 codes as bf16 words, zero past count: int8_dot_body.h's) and
// split_pairs(chunk, out) (a panel-order chunk's 16 dwords: bytes 0-1 of each to out[0..31],
// bytes 2-3 to out[32..63], in dword order). Templates
// in an anonymous namespace only (see common.h).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_amx_body.h"  // bf16_round, bf16_value, bf16_weights_ok
#include "bf16_dp_gemm.h"
#include "tiling.h"

namespace tq {
namespace {

// kCodes: the int8 form (panels from g.codes), else the decoded form (g.decode).
template <class Ops, bool kCodes>
struct Bf16DpBody {
  using V = typename Ops::V;
  using B = typename Ops::B;
  static constexpr int kRows = 16;  // weight rows per panel (the lanes), activation rows per block

  // Rows v[0..15] (32 words each: 16 pairs) of 32 positions from step s into the panel: pair q of
  // row t to word (16 (16 s + q) + t) * 2.
  __attribute__((always_inline)) static void put(B (&v)[kRows], uint16_t* panel, int64_t s) {
    Ops::transpose16(v);
#pragma GCC unroll 16
    for (int q = 0; q < kRows; ++q) Ops::store_words(panel + (s * kRows + q) * 32, v[q]);
  }

  // The panel of weight rows [n, n + cols) from decoded rows (rows at or past cols zero).
  static void panel_from_rows(const Bf16DpGemm& g, const uint16_t* rows, int64_t cols, uint16_t* panel) {
    const int64_t K = g.K;
    for (int64_t s = 0; s < K / 32; ++s) {
      B v[kRows];
#pragma GCC unroll 16
      for (int t = 0; t < kRows; ++t) v[t] = t < cols ? Ops::x32(rows + t * K + s * 32) : Ops::zero_words();
      put(v, panel, s);
    }
  }

  // The panel of int8 weight rows [n, n + cols): their codes as bf16 words (exact).
  static void panel_from_codes(const Bf16DpGemm& g, int64_t n, int64_t cols, uint16_t* panel) {
    const int64_t K = g.K, Kc = g.codes_k;
    for (int64_t s = 0; s < K / 32; ++s) {
      const int64_t k = s * 32;
      B v[kRows];
#pragma GCC unroll 16
      for (int t = 0; t < kRows; ++t) {
        const int8_t* w = g.codes + (n + t) * Kc + k;
        v[t] = t >= cols || k >= Kc ? Ops::zero_words() : k + 32 <= Kc ? Ops::codes(w) : Ops::codes_tail(w, Kc - k);
      }
      put(v, panel, s);
    }
  }

  // The same from panel-order codes (the panel of rows [n, n + 16) as stored): chunk j holds
  // positions 4 j .. 4 j + 3 of the 16 rows, 4 bytes a row, so its low and high code pairs are
  // already in lane order: split_pairs puts them apart, codes converts each half.
  static void panel_from_code_panels(const Bf16DpGemm& g, int64_t n, uint16_t* panel) {
    const int64_t Kp = (g.codes_k + 63) / 64 * 64;
    const int8_t* chunk = g.codes + n / kRows * kRows * Kp;
    alignas(64) int8_t halves[64];
    for (int64_t j = 0; j < g.K / 4; ++j, chunk += 64) {
      Ops::split_pairs(chunk, halves);
      Ops::store_words(panel + 2 * j * 32, Ops::codes(halves));
      Ops::store_words(panel + (2 * j + 1) * 32, Ops::codes(halves + 32));
    }
  }

  // Activation rows [m0, m0 + MR) against the panel of weight rows [n, n + cols): acc[m] lane t =
  // sum over position pairs q of vdpbf16ps(pair q of x row m broadcast, panel pair vector q).
  template <int MR>
  TQ_TILE static void block(const Bf16DpGemm& g, const uint16_t* panel, int64_t m0, int64_t n, int64_t cols) {
    const int64_t K = g.K;
    V acc[MR];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[m] = Ops::zero();
    const uint16_t* x = g.x + m0 * K;  // the block's B tiles: pair q of its row m at x + 32 q + 2 m
#pragma GCC unroll 2
    for (int64_t q = 0; q < K / 2; ++q, x += 32) {
      const B w = Ops::x32(panel + q * 32);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) acc[m] = Ops::dp(acc[m], Ops::pair(x + 2 * m), w);
    }
    const V s = g.scale ? Ops::load_partial(g.scale + n, cols) : Ops::zero();
    const V b = g.bias ? Ops::load_partial(g.bias + n, cols) : Ops::zero();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      V y = acc[m];
      if (g.scale) y = Ops::mul(s, y);
      if (g.bias) y = Ops::add(y, b);
      Ops::store_bf16(g.out + (m0 + m) * g.N + n, y, cols);
    }
  }

  // The panel's outputs without vdpbf16ps (weights it could flush): per output, the exact products
  // summed in order in fp32, as the AMX body's portable loop does.
  static void portable(const Bf16DpGemm& g, const uint16_t* rows, int64_t n, int64_t cols) {
    for (int64_t m = 0; m < g.M; ++m)
      for (int64_t t = 0; t < cols; ++t) {
        float acc = 0.0f;
        for (int64_t k = 0; k < g.K; ++k)  // x[m, k] in its B tile (see block)
          acc += bf16_value(rows[t * g.K + k]) * bf16_value(g.x[(m / kRows) * kRows * g.K + (k / 2) * 32 + 2 * (m % kRows) + (k & 1)]);
        if (g.scale) acc = g.scale[n + t] * acc;
        g.out[m * g.N + n + t] = bf16_round(g.bias ? acc + g.bias[n + t] : acc);
      }
  }

  // Output columns [n0, n1): each panel built once, then every block of activation rows.
  static void gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) {
    const int64_t K = g.K;
    const size_t panel_bytes = static_cast<size_t>(kRows * K * 2);
    uint16_t* buf = static_cast<uint16_t*>(aligned_alloc(64, kCodes ? panel_bytes : 2 * panel_bytes));
    if (!buf) {
      __atomic_store_n(g.failed, 1, __ATOMIC_RELAXED);
      return;
    }
    uint16_t* panel = buf;
    uint16_t* rows = buf + kRows * K;
    for (int64_t n = n0; n < n1; n += kRows) {
      const int64_t cols = n1 - n < kRows ? n1 - n : kRows;
      if constexpr (kCodes) {
        if (g.codes_panels) panel_from_code_panels(g, n, panel);
        else panel_from_codes(g, n, cols, panel);
      } else {
        g.decode(g.ctx, n, n + cols, rows);
        if (!bf16_weights_ok(rows, cols * K)) {
          portable(g, rows, n, cols);
          continue;
        }
        panel_from_rows(g, rows, cols, panel);
      }
      int64_t m = 0;
      for (; m + kRows <= g.M; m += kRows) block<kRows>(g, panel, m, n, cols);
      if (m < g.M) with_tile_size<kRows - 1>(g.M - m, [&](auto size) { block<decltype(size)::value>(g, panel, m, n, cols); });
    }
    free(buf);
  }
};

}  // namespace
}  // namespace tq
