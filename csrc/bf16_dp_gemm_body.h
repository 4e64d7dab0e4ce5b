// The bf16 dot-product GEMM's body (bf16_dp_gemm.h), written once over an Ops type:
// dot_bf16_avx512.h's or dot_bf16_emulated.h's operations, and for the int8 form
// bytes64(w, count) (w[0..count) as bytes 0..count-1 of a B, zero after; count <= 64) and
// code_pairs(chunk, a, b) (a panel-order chunk's 16 dwords of 4 codes as bf16 pairs: lane t of a
// the codes of bytes 4 t and 4 t + 1, of b those of 4 t + 2 and 4 t + 3). Templates
// in an anonymous namespace only (see common.h).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_amx_body.h"  // bf16_value, bf16_weights_ok
#include "bf16_dp_gemm.h"
#include "int8_linear.h"  // int8_panel_k, int8_panel_offset
#include "tiling.h"

namespace tq {
namespace {

// kCodes: the int8 form (panels from g.codes), else the decoded form (g.decode).
template <class Ops, bool kCodes>
struct Bf16DpBody {
  using V = typename Ops::V;
  using B = typename Ops::B;
  static constexpr int kRows = 16;  // weight rows per panel (the lanes), activation rows per block
  static_assert(kRows == 16, "panel-order int8 codes come in panels of 16 rows (int8_panel_offset)");

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

  // The int8 weight rows [n, n + cols) of row-major codes in panel order (as Int8VnniLayout stores
  // them: chunk j = positions 4 j .. 4 j + 3 of the 16 rows, 4 bytes a row; rows at or past cols
  // and positions at or past codes_k zero): per 64 positions, the 16 rows' bytes and one 16 x 16
  // dword transpose.
  static void code_panel_from_rows(const Bf16DpGemm& g, int64_t n, int64_t cols, int8_t* chunks) {
    const int64_t K = g.K, Kc = g.codes_k;
    for (int64_t k = 0; k < K; k += 64) {
      B v[kRows];
#pragma GCC unroll 16
      for (int t = 0; t < kRows; ++t)
        v[t] = t >= cols || k >= Kc ? Ops::zero_words() : Ops::bytes64(g.codes + (n + t) * Kc + k, Kc - k < 64 ? Kc - k : 64);
      Ops::transpose16(v);
#pragma GCC unroll 16
      for (int q = 0; q < kRows; ++q)
        if (k + 4 * q < K) Ops::store_words(reinterpret_cast<uint16_t*>(chunks + (k + 4 * q) * 16), v[q]);
    }
  }

  // Pairs 2 j and 2 j + 1 of a panel's weights (positions 4 j .. 4 j + 3 of its 16 rows) as
  // vdpbf16ps operands: read from a built panel ...
  struct FromPanel {
    const uint16_t* panel;
    __attribute__((always_inline)) void operator()(int64_t j, B& a, B& b) const {
      a = Ops::x32(panel + 2 * j * 32);
      b = Ops::x32(panel + (2 * j + 1) * 32);
    }
  };
  // ... or converted in registers from panel-order int8 codes (chunk j holds positions 4 j ..
  // 4 j + 3 of the 16 rows, 4 bytes a row: its low and high code pairs are already in lane order).
  // Every block of activation rows converts them again, which costs less than writing bf16 panels
  // and reading them back at any row count measured (one Zen 4 core, 576 x 3072: 16 rows 444 ->
  // 307-324 us, 64 rows 1232 -> 1169, 256 rows 5510 -> 4804).
  struct FromCodePanels {
    const int8_t* chunks;
    __attribute__((always_inline)) void operator()(int64_t j, B& a, B& b) const { Ops::code_pairs(chunks + 64 * j, a, b); }
  };

  // Activation rows [m0, m0 + MR) against the panel of weight rows [n, n + cols): acc[m] lane t =
  // sum over position pairs q of vdpbf16ps(pair q of x row m broadcast, the weights' pair vector q),
  // in order of q (the weights from `from`, two pairs at a time).
  template <int MR, class From>
  TQ_TILE static void block(const Bf16DpGemm& g, const From& from, int64_t m0, int64_t n, int64_t cols) {
    const int64_t K = g.K;
    V acc[MR];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[m] = Ops::zero();
    const uint16_t* x = g.x + m0 * K;  // the block's B tiles: pair q of its row m at x + 32 q + 2 m
    for (int64_t j = 0; j < K / 4; ++j, x += 64) {
      B a, b;
      from(j, a, b);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) acc[m] = Ops::dp(acc[m], Ops::pair(x + 2 * m), a);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) acc[m] = Ops::dp(acc[m], Ops::pair(x + 32 + 2 * m), b);
    }
    const V s = g.scale ? Ops::load_partial(g.scale + n, cols) : Ops::zero();
    const V bias = g.bias ? Ops::load_partial(g.bias + n, cols) : Ops::zero();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      V y = acc[m];
      if (g.scale) y = Ops::mul(s, y);
      if (g.bias) y = Ops::add(y, bias);
      Ops::store_bf16(g.out + (m0 + m) * g.N + n, y, cols);
    }
  }

  // Every block of activation rows against one panel's weights.
  template <class From>
  static void blocks(const Bf16DpGemm& g, const From& from, int64_t n, int64_t cols) {
    int64_t m = 0;
    for (; m + kRows <= g.M; m += kRows) block<kRows>(g, from, m, n, cols);
    if (m < g.M) with_tile_size<kRows - 1>(g.M - m, [&](auto size) { block<decltype(size)::value>(g, from, m, n, cols); });
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
        g.out[m * g.N + n + t] = bf16_rne_nan(g.bias ? acc + g.bias[n + t] : acc);
      }
  }

  // Output columns [n0, n1): per panel of 16 weight rows, every block of activation rows. Decoded
  // weights become a bf16 panel once; int8 codes are read in panel order (row-major codes put in
  // that order once, as int8: about 40 us a call for a 576 x 3072 layer on a Zen 4 core, where
  // building bf16 panels from them took 137).
  static void gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) {
    const int64_t K = g.K;
    const bool scratch = !kCodes || !g.codes_panels;
    void* buf = nullptr;
    if (scratch) {
      buf = aligned_alloc(64, static_cast<size_t>(kCodes ? kRows * K : 2 * kRows * K * 2));
      if (!buf) {
        __atomic_store_n(g.failed, 1, __ATOMIC_RELAXED);
        return;
      }
    }
    const int64_t Kp = int8_panel_k(g.codes_k);  // a panel-order panel's bytes per row
    for (int64_t n = n0; n < n1; n += kRows) {
      const int64_t cols = n1 - n < kRows ? n1 - n : kRows;
      if constexpr (kCodes) {
        int8_t* chunks = static_cast<int8_t*>(buf);
        if (g.codes_panels) chunks = const_cast<int8_t*>(g.codes + int8_panel_offset(n, Kp));
        else code_panel_from_rows(g, n, cols, chunks);
        blocks(g, FromCodePanels{chunks}, n, cols);
      } else {
        uint16_t* panel = static_cast<uint16_t*>(buf);
        uint16_t* rows = panel + kRows * K;
        g.decode(g.ctx, n, n + cols, rows);
        if (!bf16_weights_ok(rows, cols * K)) {
          portable(g, rows, n, cols);
          continue;
        }
        panel_from_rows(g, rows, cols, panel);
        blocks(g, FromPanel{panel}, n, cols);
      }
    }
    free(buf);
  }
};

}  // namespace
}  // namespace tq
