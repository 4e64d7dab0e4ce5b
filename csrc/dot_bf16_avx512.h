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
