// The int8 x int8 GEMM on tiles (AMX's tdpbssd, or its emulation) for the dynamic and static int8
// kernels' many-row calls, written once over a Tiles trait (int8_amx.cpp: the AMX instructions;
// int8_amx_emulated.cpp: the same operations in portable C++, which tests run on every machine).
//
// Operands (tdpbssd: C[16 x 16 int32] += A[16 x 64 int8] . B[16 x 64 int8 as 16 x 16 quads]):
//  * A: 16 weight rows x 64 positions of p.w, loaded in place (row stride K) where all 16 rows and
//    64 positions exist; else (a panel's partial last step, the last panel's missing rows) the
//    rows are copied into a zeroed 16 x 64 scratch first, so positions past K weigh 0 (the
//    activation codes are padded with z there, the static format's zero point);
//  * B: per 16 activation rows and 64-position step, row q holds positions 4q .. 4q + 3 of the 16
//    rows, 4 bytes each (pack_activations, from p.xq: offset-0 codes);
//  * C[t][r]: the int32 sum sum_k w[n + t, k] x_q[m + r, k], exact while |sum| < 2^31 (K < 2^17
//    guarantees it: 127 * 128 * K); beyond, it wraps modulo 2^32 as the other forms' sums do.
// The panel form (PANELS, a weight in panel order: int8_linear.h) swaps the roles: the activation
// codes p.xq are the A tiles, loaded in place (16 rows x 64 positions, row stride Kp; the caller pads
// the rows to a multiple of 16 with zeros), and the weight's panels the B tiles as stored (16 steps
// of 16 rows x 4 codes: 1 KB contiguous, zero past N and K), so nothing is packed per call and C[r][t]
// comes out in the output's own order (activation row r, weight row t).
// Output: out[m, n] = (float(sum - z * row_sums[n]) * xs[m]) * scale[n], the subtraction modulo
// 2^32 as the other GEMM forms (exact while kInt8StaticGemmMaxK bounds K), the same bits as the
// reference (int8_linear.h).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "int8_linear.h"
#include "common.h"

namespace tq {
namespace {

constexpr int kAmxTile = 16;  // weight rows per A tile, activation rows per B tile
constexpr int kAmxStep = 64;  // positions per tile step
constexpr int kAmxCTiles = 4;  // C tiles per pass over a panel: 64 activation rows (tiles 0..3; A is 4, B 5)
constexpr int64_t kAmxTileBytes = kAmxTile * 64;
// 16 lanes in GCC / Clang vector extensions: AVX-512 in the AMX unit, portable code in the emulated one
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef float F32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));

// The B tiles of all M activation rows (each thread's range packs its own copy: M x Kp bytes): block
// i (rows 16 i ..), step s at b + (i * steps + s) * 1024, row q holding positions 4q .. 4q + 3 of
// the block's 16 rows: the 16 x 16 dword transpose of the rows' 64 bytes; rows past M are zero.
template <class Tiles>
void pack_activations(const Int8Params& p, int8_t* b) {
  const int64_t steps = p.Kp / kAmxStep, blocks = (p.M + kAmxTile - 1) / kAmxTile;
  alignas(64) int8_t rows[kAmxTile][kAmxStep];  // a last partial block's rows, zero below M
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t present = p.M - i * kAmxTile < kAmxTile ? p.M - i * kAmxTile : kAmxTile;
    for (int64_t s = 0; s < steps; ++s) {
      const int8_t* src = p.xq + i * kAmxTile * p.Kp + s * kAmxStep;
      int8_t* dst = b + (i * steps + s) * kAmxTileBytes;
      if (present == kAmxTile) {
        Tiles::transpose16(src, p.Kp, dst);
        continue;
      }
      memset(rows, 0, sizeof rows);
      for (int64_t r = 0; r < present; ++r) memcpy(rows[r], src + r * p.Kp, kAmxStep);
      Tiles::transpose16(rows, kAmxStep, dst);
    }
  }
}

// Calls f(std::integral_constant<int, i>) for i in [0, count), count <= kAmxCTiles (tile numbers
// are immediates of the AMX instructions).
template <class Fn>
__attribute__((always_inline)) inline void for_c_tiles(int count, Fn&& f) {
  f(std::integral_constant<int, 0>{});
  if (count > 1) f(std::integral_constant<int, 1>{});
  if (count > 2) f(std::integral_constant<int, 2>{});
  if (count > 3) f(std::integral_constant<int, 3>{});
}

// Output rows [n0, n1) (whole panels of 16 but the call's last) for all p.M activation rows.
// fallback(p, n0, n1): a row kernel that reads p.xq, for a failed scratch allocation.
template <class Tiles, bool PANELS = false>
void amx_int8_gemm(const Int8Params& p, int64_t n0, int64_t n1, Int8RowsFn fallback) {
  const int64_t K = p.K, N = p.N, M = p.M, steps = p.Kp / kAmxStep, blocks = (M + kAmxTile - 1) / kAmxTile;
  int8_t* b = PANELS ? nullptr : static_cast<int8_t*>(aligned_alloc(64, static_cast<size_t>(blocks * steps) * kAmxTileBytes));
  if (!PANELS && !b) {
    fallback(p, n0, n1);
    if (p.out_bf16)  // this range's fp32 outputs as bf16, rounded as the tiles' epilogue rounds
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) p.out_bf16[m * N + n] = bf16_rne_nan(p.out[m * N + n]);
    return;
  }
  if constexpr (!PANELS) pack_activations<Tiles>(p, b);
  alignas(64) int32_t c[kAmxTile][kAmxTile];
  alignas(64) int8_t edge[kAmxTile][64];  // a weight tile that would read past the buffer
  U32x16 correction;  // per weight row of the panel
  F32x16 scale;
  Tiles::configure();
  // Blocks of up to 64 activation rows outside, the range's panels inside: a block's B tiles (64 x
  // Kp bytes) stay in L1 / L2 across the panels, where passes of every block per panel streamed all
  // M rows' tiles again for each panel (960 x 576, one Emerald Rapids core, 64 / 96 / 128 / 256
  // rows: 85 / 183 / 224 / 431 us before, 80 / 155 / 196 / 368 after).
  for (int64_t i0 = 0; i0 < blocks; i0 += kAmxCTiles) {
    const int tiles = blocks - i0 < kAmxCTiles ? static_cast<int>(blocks - i0) : kAmxCTiles;
    for (int64_t n = n0; n < n1; n += kAmxTile) {
      const int64_t cols = n1 - n < kAmxTile ? n1 - n : kAmxTile;
      for (int64_t t = 0; t < kAmxTile; ++t) {  // modulo 2^32, as the int32 sums
        correction[t] = p.row_sums && t < cols
                            ? static_cast<int32_t>(static_cast<uint32_t>(p.zero_point) * static_cast<uint32_t>(p.row_sums[n + t]))
                            : 0;
        scale[t] = t < cols ? p.scale[n + t] : 0.0f;
      }
      // the weight tile of step s: in place, or (a partial step or panel) copied into edge
      auto load_weights = [&](int64_t s) __attribute__((always_inline)) {
        if constexpr (PANELS) {
          Tiles::template load<4>(p.w + int8_panel_offset(n, p.Kp) + s * kAmxTileBytes, 64);
          return;
        }
        const int64_t k0 = s * kAmxStep;
        if (cols == kAmxTile && k0 + kAmxStep <= K) {
          Tiles::template load<4>(p.w + n * K + k0, K);
          return;
        }
        memset(edge, 0, sizeof edge);
        const int64_t len = K - k0 < kAmxStep ? K - k0 : kAmxStep;
        for (int64_t t = 0; t < cols; ++t) memcpy(edge[t], p.w + (n + t) * K + k0, static_cast<size_t>(len));
        Tiles::template load<4>(&edge[0][0], 64);
      };
      for_c_tiles(tiles, [&](auto i) { Tiles::template zero<decltype(i)::value>(); });
      for (int64_t s = 0; s < steps; ++s) {
        load_weights(s);
        for_c_tiles(tiles, [&](auto i) {
          constexpr int I = decltype(i)::value;
          if constexpr (PANELS) {  // A: 16 activation rows' 64 codes in place; B: the weights
            Tiles::template load<5>(p.xq + (i0 + I) * kAmxTile * p.Kp + s * kAmxStep, p.Kp);
            Tiles::template dot<I, 5, 4>();
          } else {
            Tiles::template load<5>(b + ((i0 + I) * steps + s) * kAmxTileBytes, 64);
            Tiles::template dot<I, 4, 5>();
          }
        });
      }
      for_c_tiles(tiles, [&](auto i) {
        constexpr int I = decltype(i)::value;
        if constexpr (PANELS) Tiles::template store<I>(&c[0][0], 64);  // c[r][t]: activation row r, weight row t
        else Tiles::template store_transposed<I>(&c[0][0]);
        const int64_t first = (i0 + I) * kAmxTile, rows = M - first < kAmxTile ? M - first : kAmxTile;
        for (int64_t r = 0; r < rows; ++r) {  // one vector per activation row (along the weight rows)
          U32x16 sums;
          memcpy(&sums, c[r], sizeof sums);
          const F32x16 o = (__builtin_convertvector(reinterpret_cast<I32x16>(sums - correction), F32x16) * p.xs[first + r]) * scale;
          if (p.out_bf16) {  // rounded to nearest even, every NaN to 0x7FC0 (from_f32_row's bf16)
            U32x16 u;
            memcpy(&u, &o, sizeof u);
            const U32x16 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            const U16x16 h = __builtin_convertvector(((u & 0x7FFFFFFFu) > 0x7F800000u) ? U32x16{} + 0x7FC0u : rounded, U16x16);
            if (cols == kAmxTile) memcpy(p.out_bf16 + (first + r) * N + n, &h, sizeof h);  // one store, not a call
            else memcpy(p.out_bf16 + (first + r) * N + n, &h, static_cast<size_t>(cols) * sizeof(uint16_t));
            continue;
          }
          float* out = p.out + (first + r) * N + n;
          if (cols == kAmxTile) memcpy(out, &o, sizeof o);
          else memcpy(out, &o, static_cast<size_t>(cols) * sizeof(float));
        }
      });
    }
  }
  Tiles::release();
  free(b);
}

}  // namespace
}  // namespace tq
