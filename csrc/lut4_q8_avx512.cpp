// The int8-activation GEMM form (lut4_linear.h: from 5 rows here, q8_gemm_min_m; block a multiple of 32)
// for AVX-512 VNNI: the panels of lut4_q8_gemm_panels (16 weight rows x 4 positions per 64-byte
// step: one zmm), register tiles of up to 4 activation rows x 16 weight rows.
//
// Per 32-block j of an activation row: vpdpbusd adds the step's four code x activation-code products
// of each weight row to its int32 lane (affine kind: u8 codes 0..15 x int8 codes; codebook kind:
// |t| x the activation code negated where t < 0, which AVX-512 does with a masked subtraction
// instead of AVX2's vpsignb; |t|, |q| <= 127, so no product or sum saturates). The block's sum I
// is exact in int32, as the AVX2 form's int16-then-int32 sums; then acc = fma(float(I), a_j * s_b,
// acc) per block in block order, and (affine kind) acc = fma(s_b d_b + z_b, X_b, acc) per weight
// block: per output the AVX2 form's fp32 operations, in its order, so the two forms are bit-equal.
//
// Linkage: compiled with AVX-512 VNNI flags; everything but lut4_q8_gemm_avx512vnni is internal.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#include <immintrin.h>

#include <string.h>

#include "lut4_linear.h"

namespace tq {
namespace {

constexpr int kCols = 16;    // weight rows per panel: one zmm of int32 / fp32 lanes
constexpr int kTileRows = 4;  // activation rows per register tile

// The steps of one half of a 32-block: 4 steps of the panel at pw, activations at offset xo of
// each row's codes; sums[r] += the products of row r.
template <bool CODEBOOK, int R>
inline void block_half(const uint8_t* pw, const int8_t* const (&q)[R], int64_t xo, __m512i (&sums)[R]) {
  constexpr int64_t kStep = CODEBOOK ? 128 : 64;
  const __m512i zero = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) {
    const __m512i w = _mm512_load_si512(pw + kStep * i);
    __m512i u = w;  // the unsigned operand
    __mmask64 negative = 0;
    if constexpr (CODEBOOK) {
      u = _mm512_load_si512(pw + kStep * i + 64);  // |t|
      negative = _mm512_movepi8_mask(w);
    }
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      memcpy(&x4, q[r] + xo + 4 * i, 4);
      __m512i xb = _mm512_set1_epi32(x4);
      if constexpr (CODEBOOK) xb = _mm512_mask_sub_epi8(xb, negative, zero, xb);
      sums[r] = _mm512_dpbusd_epi32(sums[r], u, xb);
    }
  }
}

// out[m0 .. m0 + R, n .. n + cols) from the panel (see lut4_q8_gemm_avx2's q8_gemm_tile: the same
// operations per output lane).
template <bool CODEBOOK, int R>
__attribute__((noinline)) void tile(const Lut4Params& p, const uint8_t* panel, const float* sc, const float* off, int64_t n,
                                    int64_t cols, int64_t m0) {
  constexpr int64_t kStep = CODEBOOK ? 128 : 64;
  const int64_t K = p.K, kq = p.kq, G = p.blocks_per_row, per_block = p.block / 32, chunks = kq / 64;
  const int8_t* q[R];
  const float* xa[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    q[r] = p.xq8 + (m0 + r) * kq;
    xa[r] = p.xa + (m0 + r) * chunks * 8;
    acc[r] = _mm512_setzero_ps();
  }
  int64_t g = 0, in_block = 0;  // the weight block of 32-block j, and j's index within it
  for (int64_t j = 0; 32 * j < K; ++j) {
    // 32-block j = 2c + h holds steps [16c + 4h, 16c + 4h + 4) and the 8 after them + 8 (chunk c)
    const int64_t step0 = 16 * (j >> 1) + 4 * (j & 1);
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    block_half<CODEBOOK, R>(panel + step0 * kStep, q, 4 * step0, sums);
    block_half<CODEBOOK, R>(panel + (step0 + 8) * kStep, q, 4 * step0 + 32, sums);
    const __m512 sv = _mm512_load_ps(sc + kCols * g);
    const int64_t ai = (j >> 1) * 8 + 4 * (j & 1);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(_mm512_set1_ps(xa[r][ai]), sv), acc[r]);
    if (++in_block == per_block) in_block = 0, ++g;
  }
  for (int64_t b = 0; !CODEBOOK && b < G; ++b) {  // sum_b (s_b d_b + z_b) X_b
    const __m512 o = _mm512_load_ps(off + kCols * b);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(p.xblk[(m0 + r) * G + b]), acc[r]);
  }
  alignas(64) float row[kCols];
  for (int r = 0; r < R; ++r) {
    float* o = p.out + (m0 + r) * p.N + n;
    if (cols == kCols && !p.bias) {
      _mm512_storeu_ps(o, acc[r]);
      continue;
    }
    _mm512_store_ps(row, acc[r]);
    for (int64_t t = 0; t < cols; ++t) o[t] = p.bias ? row[t] + p.bias[n + t] : row[t];
  }
}

template <bool CODEBOOK>
void panel_rows(const Lut4Params& p, const uint8_t* panel, const float* sc, const float* off, int64_t n, int64_t cols) {
  int64_t m = 0;
  for (; m + kTileRows <= p.M; m += kTileRows) tile<CODEBOOK, kTileRows>(p, panel, sc, off, n, cols, m);
  switch (p.M - m) {
    case 3: tile<CODEBOOK, 3>(p, panel, sc, off, n, cols, m); break;
    case 2: tile<CODEBOOK, 2>(p, panel, sc, off, n, cols, m); break;
    case 1: tile<CODEBOOK, 1>(p, panel, sc, off, n, cols, m); break;
    default: break;
  }
}

}  // namespace

void lut4_q8_gemm_avx512vnni(const Lut4Params& p, int64_t n0, int64_t n1) {
  lut4_q8_gemm_panels(p, n0, n1, &panel_rows<false>, &panel_rows<true>);
}

}  // namespace tq
