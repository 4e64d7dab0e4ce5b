// An 8x8 transpose of 32-bit elements in AVX2 registers, for the int8 GEMM panels (int8_gemm_body.h,
// lut4_q8_avx2.cpp). Include after the unit's `#pragma GCC target` (AVX2 or wider). In an
// anonymous namespace (see common.h).
#pragma once
#include <immintrin.h>

namespace tq {
namespace {

// 8x8 transpose of 32-bit elements (r[i] lane j -> r[j] lane i): the int8 GEMM panels' layout
// (4 codes of 8 rows per vector).
inline void transpose8_epi32(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}

}  // namespace
}  // namespace tq
