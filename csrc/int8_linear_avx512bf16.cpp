// The int8 weight-only bf16 dot path for AVX-512 with AVX512_BF16 (see int8_linear.h, "bf16 dot
// path"; the body: int8_dot_body.h): int8 codes become bf16 words exactly (every integer in
// [-128, 127] is a bf16 value), vdpbf16ps multiplies them with the bf16 activations (products exact
// in fp32) and sums in fp32, and each output is scaled once: out[m, n] = s[n] * sum_k q[n, k] x[m, k]
// (+ bias[n]). cpu.cpp puts it into the AVX-512 table's int8.dot_bf16 on CPUs with AVX512_BF16
// unless TORCHQ_NATIVE_AVX512BF16=0. Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "dot_bf16_avx512.h"
#include "int8_dot_body.h"

namespace tq {
namespace {

struct Int8DotOps : Avx512Bf16DotOps {
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
};

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) { Int8Dot<Int8DotOps>::rows(p, n0, n1, kInt8Avx512.weight_rows); }

}  // namespace

extern const Int8RowsFn kInt8Avx512Bf16Dot = &dot_rows;

}  // namespace tq
