// The int8-activation GEMM form (lut4_linear.h) of the codebook kind (NF4 / FP4 as int8 table
// values: nf4a8, fp4a8) on AMX tiles, written once over a Tiles trait (tile operations plus the
// signed byte dot product: lut4_q8_amx.cpp tdpbssd, or its emulation in portable C++,
// lut4_q8_amx_emulated.cpp) and a V trait (16 fp32 lanes: a zmm, or an array the emulation loops
// over). A panel function for lut4_q8_gemm_panels: every activation row against one panel of 16
// weight rows.
//
// Per 32-block j and 16 activation rows, one dot of K = 32 gives the block's exact int32 sums of
// all 16 x 16 outputs:
//  * A (16 rows x 32 bytes): the block's activation codes, from p.xq8_blocks (each block's 16 even
//    elements, then its 16 odd ones; row stride kq);
//  * B (8 rows x 64 bytes): the block's 8 panel steps (4 even, 4 odd; each 16 weight rows x 4
//    positions of signed table values, the first 64 bytes of the panel's 128-byte steps: the B
//    tile's layout), copied together per panel; |products| <= 127 * 127, 32 of them: exact.
// C tiles 0, 1 and 2, 3 take two consecutive blocks each, in turn: a group's epilogue runs while
// the next group computes, and a group is issued into the tiles stored one group earlier (a tile
// written right after its store waits for it). Per block in block order and activation row r,
// acc = fma(float(I), a_j * s_b, acc): the VNNI and AVX2 forms' fp32 operations per output in
// their order, so all three are bit-equal. A last group of fewer than 16 activation rows runs on
// a zero-padded copy of its codes; only its real rows are written.
//
// Why only the codebook kind: every block's 16 x 16 sums leave the tiles through memory
// (tilestored, then vector loads for the epilogue), one store per dot, and on an Emerald Rapids
// core that traffic bounds the form: for the affine kind (int4a8, u8 codes x int8, tdpbsud) it
// measured 0.86-0.95x the VNNI form at M = 16, 1.06-1.16x at 64 and 0.82-1.03x at 256 (3072 x 576,
// one core, three runs): not worth a second form; for the codebook kind, whose VNNI form needs a
// signed table and a masked negation per step, 1.06-1.64x from 64 rows (docs/native-cpu.md).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "amx_shapes.h"
#include "lut4_linear.h"

namespace tq {
namespace {

constexpr int kQ8AmxRows = 16;   // activation rows per C tile
constexpr int kQ8AmxCols = 16;   // weight rows per panel (lut4_q8_gemm_panels)
constexpr int64_t kQ8AmxBlockB = 8 * 64;  // bytes of one block's B tile
constexpr int64_t kQ8AmxPanelStep = 128;  // bytes per step of the codebook kind's panel (lut4_q8_gemm_panels)
constexpr AmxTileShape kQ8AmxShapes[8] = {{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 32}, {16, 32}, {8, 64}, {8, 64}};

// Calls f(std::integral_constant<int, u>) for u in [0, count), count 1 or 2 (tile numbers are
// immediates of the AMX instructions).
template <class Fn>
__attribute__((always_inline)) inline void for_q8_tiles(int count, Fn&& f) {
  f(std::integral_constant<int, 0>{});
  if (count > 1) f(std::integral_constant<int, 1>{});
}

// out[m0 .. m0 + rows, n .. n + cols) from the blocks' B tiles bt, q the 16 rows' codes in
// xq8_blocks' order (row stride kq; rows past `rows` zero); padded rows' scales are never used
// for an output.
template <class Tiles, class V>
__attribute__((always_inline)) inline void q8_amx_rows(const Lut4Params& p, const uint8_t* bt, const float* sc,
                                                       int64_t n, int64_t cols, int64_t m0, int64_t rows, const int8_t* q,
                                                       int32_t (&c)[2][2][kQ8AmxRows][kQ8AmxCols]) {
  using F = typename V::F;
  const int64_t K = p.K, kq = p.kq, chunks = kq / 64, J = K / 32;
  const float* xa[kQ8AmxRows];
  for (int r = 0; r < kQ8AmxRows; ++r) xa[r] = p.xa + (m0 + (r < rows ? r : rows - 1)) * chunks * 8;  // padded rows: never stored
  F acc[kQ8AmxRows];
  for (int r = 0; r < kQ8AmxRows; ++r) acc[r] = V::zero();
  auto group = [&](int64_t j0) __attribute__((always_inline)) { return J - j0 < 2 ? static_cast<int>(J - j0) : 2; };
  // group k (blocks 2k, 2k + 1) computes in C tiles 2 (k % 2) + u, A tile 4 + u, B tile 6 + u
  auto issue = [&](auto set, int64_t j0) __attribute__((always_inline)) {
    constexpr int S = decltype(set)::value;
    for_q8_tiles(group(j0), [&](auto u) {
      constexpr int U = decltype(u)::value;
      Tiles::template zero<2 * S + U>();
      Tiles::template load<4 + U>(q + 32 * (j0 + U), kq);
      Tiles::template load<6 + U>(bt + kQ8AmxBlockB * (j0 + U), 64);
      Tiles::template dot<2 * S + U, 4 + U, 6 + U>();
    });
  };
  auto store = [&](auto set, int64_t j0) __attribute__((always_inline)) {
    constexpr int S = decltype(set)::value;
    for_q8_tiles(group(j0), [&](auto u) {
      constexpr int U = decltype(u)::value;
      Tiles::template store<2 * S + U>(&c[S][U][0][0], kQ8AmxCols * sizeof(int32_t));
    });
  };
  auto epilogue = [&](int set, int64_t j0) __attribute__((always_inline)) {
    for (int u = 0; u < group(j0); ++u) {
      const int64_t j = j0 + u, g = j * 32 / p.block, ai = (j >> 1) * 8 + 4 * (j & 1);
      const F sv = V::load(sc + kQ8AmxCols * g);
#pragma GCC unroll 16
      for (int r = 0; r < kQ8AmxRows; ++r) acc[r] = V::fma(V::cvt(c[set][u][r]), V::mul(V::set1(xa[r][ai]), sv), acc[r]);
    }
  };
  // Software pipeline: group k's epilogue runs while group k + 1 computes, and the tiles a group
  // is issued into were stored one group earlier (a tile written right after its store waits for it).
  using S0 = std::integral_constant<int, 0>;
  using S1 = std::integral_constant<int, 1>;
  issue(S0{}, 0);
  store(S0{}, 0);
  if (J > 2) issue(S1{}, 2);
  for (int64_t j0 = 0; j0 < J; j0 += 4) {
    epilogue(0, j0);  // group in set 0
    if (j0 + 2 < J) store(S1{}, j0 + 2);
    if (j0 + 4 < J) issue(S0{}, j0 + 4);
    if (j0 + 2 >= J) break;
    epilogue(1, j0 + 2);  // group in set 1
    if (j0 + 4 < J) store(S0{}, j0 + 4);
    if (j0 + 6 < J) issue(S1{}, j0 + 6);
  }
  alignas(64) float row[kQ8AmxCols];
  for (int r = 0; r < rows; ++r) {
    V::store(row, acc[r]);
    float* o = p.out + (m0 + r) * p.N + n;
    for (int64_t t = 0; t < cols; ++t) o[t] = p.bias ? row[t] + p.bias[n + t] : row[t];
  }
}

// Lut4Q8PanelFn of the codebook kind: every activation row against the panel, 16 rows at a time:
// its blocks' B tiles copied together first (the signed values of each 128-byte step), a last
// partial group of rows through a zero-padded copy of its codes. If a buffer cannot be allocated,
// the AVX2 rows compute the panel.
template <class Tiles, class V>
void lut4_q8_amx_panel(const Lut4Params& p, const uint8_t* panel, const float* sc, const float* /*off*/, int64_t n, int64_t cols) {
  alignas(64) int32_t c[2][2][kQ8AmxRows][kQ8AmxCols];
  const int64_t M = p.M, J = p.K / 32, full = M / kQ8AmxRows * kQ8AmxRows;
  const size_t tiles_bytes = static_cast<size_t>(J * kQ8AmxBlockB), pad_bytes = full < M ? static_cast<size_t>(kQ8AmxRows * p.kq) : 0;
  uint8_t* bt = static_cast<uint8_t*>(aligned_alloc(64, tiles_bytes + pad_bytes));
  if (!bt) {  // cannot happen for sane K; stay correct anyway
    lut4_q8_rows_avx2(p, n, n + cols);
    return;
  }
  for (int64_t j = 0; j < J; ++j) {  // block j = 2c + h: steps 16c + 4h .. + 4 (even), the 4 from + 8 (odd)
    const int64_t step0 = 16 * (j >> 1) + 4 * (j & 1);
    for (int s = 0; s < 8; ++s) memcpy(bt + kQ8AmxBlockB * j + 64 * s, panel + (step0 + s + (s < 4 ? 0 : 4)) * kQ8AmxPanelStep, 64);
  }
  int8_t* pad = pad_bytes ? reinterpret_cast<int8_t*>(bt + tiles_bytes) : nullptr;
  if (pad) {
    memset(pad, 0, pad_bytes);
    memcpy(pad, p.xq8_blocks + full * p.kq, static_cast<size_t>((M - full) * p.kq));
  }
  Tiles::configure(kQ8AmxShapes);
  for (int64_t m0 = 0; m0 < full; m0 += kQ8AmxRows)
    q8_amx_rows<Tiles, V>(p, bt, sc, n, cols, m0, kQ8AmxRows, p.xq8_blocks + m0 * p.kq, c);
  if (pad) q8_amx_rows<Tiles, V>(p, bt, sc, n, cols, full, M - full, pad, c);
  Tiles::release();
  free(bt);
}

// The GEMM form's rows [n0, n1) (whole panels but the call's last) on Tiles: the codebook kind
// (the only calls lut4_q8_amx_gemm routes here); the affine kind, should one come, takes the AVX2
// form (bit-equal).
template <class Tiles, class V>
void q8_amx_gemm_on(const Lut4Params& p, int64_t n0, int64_t n1) {
  if (p.q8_affine) return lut4_q8_gemm_avx2(p, n0, n1);
  lut4_q8_gemm_panels(p, n0, n1, &lut4_q8_amx_panel<Tiles, V>, &lut4_q8_amx_panel<Tiles, V>);  // affine: not reached
}

}  // namespace
}  // namespace tq
