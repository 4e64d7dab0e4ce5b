// The int8 weight-only bf16 dot path for AVX-512 with AVX512_BF16 (see int8_linear.h, "bf16 dot
// path"; the body: int8_dot_body.h), and its bf16 dequantization (int8_linear.h): int8 codes become bf16 words exactly (every integer in
// [-128, 127] is a bf16 value), vdpbf16ps multiplies them with the bf16 activations (products exact
// in fp32) and sums in fp32, and each output is scaled once: out[m, n] = s[n] * sum_k q[n, k] x[m, k]
// (+ bias[n]). cpu.cpp puts it into the AVX-512 table's int8.dot_bf16 on CPUs with AVX512_BF16
// unless TORCHQ_NATIVE_AVX512BF16=0; likewise the bf16 dot-product GEMM's int8 form. Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "dot_bf16_avx512.h"
#include "int8_dot_body.h"
#include "bf16_dp_gemm_body.h"

namespace tq {
namespace {

struct Int8DotOps : Avx512Bf16DotOps {
  // Word j of the result: the high half of fp32 lane j of lo (j < 16) or j - 16 of hi. Every int8
  // code is exact in bf16, so its fp32 value's low half is 0 and the high half is its bf16 word:
  // one vpermt2w, where vcvtne2ps2bf16 (which rounds) takes about 1.2x its issue time on Zen 4.
  __attribute__((always_inline)) static B high_words(V lo, V hi) {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                         31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return (B)_mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd, _mm512_castps_si512(hi));
  }

  // 32 codes of a row (w[0..31]) as bf16 words, word j from byte j.
  __attribute__((always_inline)) static B codes(const int8_t* w) {
    const V lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    const V hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
    return high_words(lo, hi);
  }

  // The first `count` (< 32) codes of w likewise, zero words after them (nothing read past w + count).
  __attribute__((always_inline)) static B codes_tail(const int8_t* w, int64_t count) {
    const __m256i b = _mm256_maskz_loadu_epi8((__mmask32)((1u << count) - 1u), w);
    const V lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const V hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return high_words(lo, hi);
  }
};

// bytes64 and code_pairs (bf16_dp_gemm_body.h) for Int8DotOps: a masked byte load; each quarter of the chunk (the 4 codes of 4
// rows) sign-extended and converted to fp32, exact; one vpermt2w per two quarters takes the high
// words of the pairs a and b want (8 rows each), and two vshufi64x2 put the halves together.
struct Int8DpOps : Int8DotOps {
  __attribute__((always_inline)) static B bytes64(const int8_t* w, int64_t count) {
    return (B)_mm512_maskz_loadu_epi8(count >= 64 ? ~__mmask64{0} : (__mmask64{1} << count) - 1, w);
  }
  __attribute__((always_inline)) static V quarter(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  __attribute__((always_inline)) static void code_pairs(const int8_t* chunk, B& a, B& b) {
    // word w of the result: lane 4 r + p of the quarters' 32 fp32 lanes (high word 2 (4 r + p) + 1),
    // for a's rows r = w / 2, positions p = w % 2 (w < 16), b's rows (w - 16) / 2, positions 2 + w % 2
    const __m512i pick = _mm512_set_epi16(63, 61, 55, 53, 47, 45, 39, 37, 31, 29, 23, 21, 15, 13, 7, 5,
                                          59, 57, 51, 49, 43, 41, 35, 33, 27, 25, 19, 17, 11, 9, 3, 1);
    const __m512i lo = _mm512_permutex2var_epi16(_mm512_castps_si512(quarter(chunk)), pick, _mm512_castps_si512(quarter(chunk + 16)));
    const __m512i hi = _mm512_permutex2var_epi16(_mm512_castps_si512(quarter(chunk + 32)), pick, _mm512_castps_si512(quarter(chunk + 48)));
    a = (B)_mm512_shuffle_i64x2(lo, hi, 0x44);
    b = (B)_mm512_shuffle_i64x2(lo, hi, 0xEE);
  }
};

// int8_dequant_bf16's operations: vcvtne2ps2bf16 rounds 32 fp32 values to bf16 words.
struct Int8DequantOps {
  using V = __m512;
  __attribute__((always_inline)) static void codes_f32(const int8_t* w, int64_t count, V& lo, V& hi) {
    const __m256i b = count >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))
                                  : _mm256_maskz_loadu_epi8((__mmask32)((1u << count) - 1u), w);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  }
  __attribute__((always_inline)) static V mul(V v, float s) { return _mm512_mul_ps(v, _mm512_set1_ps(s)); }
  __attribute__((always_inline)) static void store_bf16(uint16_t* dst, V lo, V hi, int64_t count) {
    const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo, 16..31 from hi
    if (count >= 32) _mm512_storeu_si512(dst, words);
    else _mm512_mask_storeu_epi16(dst, (__mmask32)((1u << count) - 1u), words);
  }
};

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) { Int8Dot<Int8DotOps>::rows(p, n0, n1, kInt8Avx512.weight_rows); }

void dequant(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
  int8_dequant_bf16<Int8DequantOps>(w, scale, K, n0, n1, out, bf16, kInt8Avx512.dequant_rows);
}

void dp_gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) { Bf16DpBody<Int8DpOps, true>::gemm(g, n0, n1); }

}  // namespace

extern const Int8RowsFn kInt8Avx512Bf16Dot = &dot_rows;
extern const Int8DequantFn kInt8Avx512Bf16Dequant = &dequant;
// The bf16 dot-product GEMM's int8 form (bf16_dp_gemm.h): the codes' bf16 words as above.
extern const Bf16DpGemmFn kInt8Avx512Bf16DpGemm = &dp_gemm;

}  // namespace tq
