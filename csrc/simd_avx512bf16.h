// ISA traits for AVX-512 with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): the
// AVX-512 traits plus the lut4 pair tables (lut4_linear_body.h), which round a block's 16 table
// entries to bf16 with vcvtne2ps2bf16, two blocks per instruction. Include after the unit's
// `#pragma GCC target` and <immintrin.h>. In an anonymous namespace (see common.h).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd_avx512.h"

namespace tq {
namespace {

struct Avx512Bf16 : Avx512 {
  static constexpr bool kLut4Bf16Pairs = true;

  // Two adjacent fp32 values (v[0], v[1]) in every 64-bit lane.
  __attribute__((always_inline)) static F pair(const float* v) {
    double d;
    memcpy(&d, v, sizeof d);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
  }

  // The zeros' step of the bf16 tables (lut4_bf16_table_pair, the dot path's): bf16 words 0..15 of
  // r back to fp32 plus z_lo, words 16..31 plus z_hi, each lane rounded to bf16 again (nearest
  // even; words 0..15 from the first sum, 16..31 from the second).
  __attribute__((always_inline)) static I plus_then_bf16(I r, F z_lo, F z_hi) {
    // word i of r to fp32 lane i (its high half), for words 0..15 and 16..31
    const I spread_lo = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    const I spread_hi = _mm512_add_epi16(spread_lo, _mm512_set1_epi16(16));
    const __mmask32 high_words = 0xAAAAAAAAu;
    const F lo = _mm512_add_ps(_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(high_words, spread_lo, r)), z_lo);
    const F hi = _mm512_add_ps(_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(high_words, spread_hi, r)), z_hi);
    return (I)(_mm512_cvtne2ps_pbh(hi, lo));
  }

  // The 16-entry tables of blocks A and B (adjacent: s2, sh2, z2 point at A's value, B's follows)
  // for weights R(R((codebook[c] + shift) * s) + z), R = round to bf16 (nearest even), as
  // Lut4Kernel::entries computes them. lo / hi: codebook entries 0..7 / 8..15, each twice, so that
  // lanes alternate A, B; sh2 / z2 null: no shifts / zeros. vcvtne2ps2bf16 rounds 32 lanes (both
  // blocks) at once, to nearest even as the reference does, except that it reads fp32 subnormals
  // as zero: the caller takes this path only where no product or sum rounded here is subnormal.
  // The rounded words of a lane pair (A_c, B_c) form dword c: << 16 gives A's table, the high
  // half B's.
  __attribute__((always_inline)) static void lut4_bf16_table_pair(F lo, F hi, const float* s2, const float* sh2, const float* z2, F& a, F& b) {
    if (sh2) {
      const F sh = pair(sh2);
      lo = _mm512_add_ps(lo, sh);
      hi = _mm512_add_ps(hi, sh);
    }
    const F s = pair(s2);
    I r = (I)(_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s)));  // words: lo's lanes, hi's
    if (z2) r = plus_then_bf16(r, pair(z2), pair(z2));
    a = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

}  // namespace
}  // namespace tq
