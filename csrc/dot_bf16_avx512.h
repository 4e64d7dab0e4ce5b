// The AVX512_BF16 operations the bf16 dot-path bodies are written over (int8_dot_body.h,
// lut4_scaled_dot_body.h): V (16 fp32 lanes), B (32 bf16 words), vdpbf16ps, and the shuffle tree
// that sums 16 accumulators' lanes at once. dot_bf16_emulated.h does the same operations in the
// same order on arrays. Include after the unit's `#pragma GCC target` (avx512bf16). In an
// anonymous namespace (see common.h).
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace tq {
namespace {

struct Avx512Bf16DotOps {
  using V = __m512;
  using B = __m512bh;

  __attribute__((always_inline)) static V zero() { return _mm512_setzero_ps(); }

  // 32 bf16 activations at p as vdpbf16ps's operand.
  __attribute__((always_inline)) static B x32(const uint16_t* p) { return (B)_mm512_loadu_ps(reinterpret_cast<const float*>(p)); }

  // The pair of bf16 words at p (p[0], p[1]) in every lane (one broadcast dword).
  __attribute__((always_inline)) static B pair(const uint16_t* p) {
    int32_t d;
    __builtin_memcpy(&d, p, 4);
    return (B)_mm512_set1_epi32(d);
  }
  // v's 16 lanes into out[0..15].
  __attribute__((always_inline)) static void store(float* out, V v) { _mm512_storeu_ps(out, v); }

  // The bf16 dot-product GEMM's (bf16_dp_gemm_body.h): 32 zero words; 32 words to p; the 16 x 16
  // dword transpose of v (dword j of v[i] to dword i of v[j]); lane products and sums; lanes
  // rounded to bf16 (nearest even, NaN to 0x7FC0) into dst[0..count).
  __attribute__((always_inline)) static B zero_words() { return (B)_mm512_setzero_ps(); }
  __attribute__((always_inline)) static void store_words(uint16_t* p, B b) { _mm512_storeu_ps(reinterpret_cast<float*>(p), (__m512)b); }
  __attribute__((always_inline)) static void transpose16(B (&v)[16]) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = (__m512i)v[i];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
      for (int i = 0; i < 4; ++i) {
        t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
        t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xDD);
      }
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    }
    for (int i = 0; i < 16; ++i) v[i] = (B)r[i];
  }
  __attribute__((always_inline)) static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  __attribute__((always_inline)) static V add(V a, V b) { return _mm512_add_ps(a, b); }
  __attribute__((always_inline)) static void store_bf16(uint16_t* dst, V v, int64_t count) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>(count >= 16 ? 0xFFFFu : (1u << count) - 1u), _mm512_cvtepi32_epi16(r));
  }

  // vdpbf16ps: lane i += a[2i+1] b[2i+1], then += a[2i] b[2i] (fp32 roundings; DAZ / FTZ, which
  // the dot paths' guards keep from acting).
  __attribute__((always_inline)) static V dp(V acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }

  // a * b + c in one rounding per lane.
  __attribute__((always_inline)) static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // v[0..count) (count <= 16) in lanes 0..count-1, zero above; nothing read past v + count.
  __attribute__((always_inline)) static V load_partial(const float* v, int64_t count) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), v);
  }

  __attribute__((always_inline)) static void keep(B& b) { asm("" : "+v"(b)); }

  // The 16 lane sums of v[0..15]: lane 4q + r of out holds the sum of v[4r + q] (45 shuffles and
  // adds where 16 separate horizontal sums take about 140).
  __attribute__((always_inline)) static void sum16(const V (&v)[16], float* out) {
    V c[8], e[4], g[2];
    for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s 8 partial sums, 8-15: v[2i + 1]'s
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; ++j)  // quarter q: v[4j + q]'s 4 partial sums
      e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88), _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
    for (int l = 0; l < 2; ++l)  // quarter q: 2 partial sums of v[8l + q], then 2 of v[8l + 4 + q]
      g[l] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * l], e[2 * l + 1], 0x44), _mm512_shuffle_ps(e[2 * l], e[2 * l + 1], 0xEE));
    _mm512_store_ps(out, _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD)));
  }
};

}  // namespace
}  // namespace tq
