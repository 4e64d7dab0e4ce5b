// The int8 weight-only bf16 dot path for AVX-512 with AVX512_BF16 (see int8_linear.h, "bf16 dot
// path"; the body: int8_dot_body.h): int8 codes become bf16 words exactly (every integer in
// [-128, 127] is a bf16 value), vdpbf16ps multiplies them with the bf16 activations (products exact
// in fp32) and sums in fp32, and each output is scaled once: out[m, n] = s[n] * sum_k q[n, k] x[m, k]
// (+ bias[n]). cpu.cpp puts it into the AVX-512 table's int8.dot_bf16 on CPUs with AVX512_BF16
// unless TORCHQ_NATIVE_AVX512BF16=0. Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "int8_dot_body.h"

namespace tq {
namespace {

struct Avx512Bf16DotOps {
  using V = __m512;
  using B = __m512bh;

  __attribute__((always_inline)) static V zero() { return _mm512_setzero_ps(); }

  // 32 codes of a row (w[0..31]) as bf16 words, word j from byte j.
  __attribute__((always_inline)) static B codes(const int8_t* w) {
    const V lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    const V hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }

  // The first `count` (< 32) codes of w likewise, zero words after them (nothing read past w + count).
  __attribute__((always_inline)) static B codes_tail(const int8_t* w, int64_t count) {
    const __m256i b = _mm256_maskz_loadu_epi8((__mmask32)((1u << count) - 1u), w);
    const V lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const V hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }

  // 32 bf16 activations at p as vdpbf16ps's operand.
  __attribute__((always_inline)) static B x32(const uint16_t* p) { return (B)_mm512_loadu_ps(reinterpret_cast<const float*>(p)); }

  __attribute__((always_inline)) static V dp(V acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }

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

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) { Int8Dot<Avx512Bf16DotOps>::rows(p, n0, n1, kInt8Avx512.weight_rows); }

}  // namespace

extern const Int8RowsFn kInt8Avx512Bf16Dot = &dot_rows;

}  // namespace tq
