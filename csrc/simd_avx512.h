// ISA traits for AVX-512 (F, BW, VL, DQ + FMA): the vector type, its width and the primitives
// the templated kernel bodies (*_body.h) are written with. Include after the unit's
// `#pragma GCC target` and <immintrin.h>. In an anonymous namespace (see common.h).
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "lut4_linear.h"

namespace tq {
namespace {

struct Avx512 {
  using F = __m512;   // 16 fp32 lanes
  using I = __m512i;  // 16 int32 lanes
  static constexpr int kLanes = 16;
  // lut4 tiles: rows per fused (small-M) tile; activation rows per panel tile (32 registers).
  static constexpr int kLut4FusedRows = 4;
  static constexpr bool kLut4Bf16Pairs = false;  // lut4 tables in pairs (simd_avx512bf16.h)
  static constexpr int kGemmRows = 12;  // lut4 GEMM tiles: rows x 2 vectors of accumulators
  static constexpr int kLut4PanelM = 4;

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static F load_partial(const float* p, int64_t count) {  // p[0..count), count < 16; the other lanes 0
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), p);
  }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F v) { return _mm512_abs_ps(v); }
  static bool any_nan(F v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }

  static float hsum(F v) {  // (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized)
    __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  static I bf16_bits(F v) {  // round to nearest even; the bf16 in the low half of each lane
    const I u = _mm512_castps_si512(v);
    const I lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  }
  static void store_bf16(uint16_t* p, F v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v))); }

  // v rounded to bf16 or fp16 (Round), kept in fp32.
  static F round_to(F v, int kind) {
    if (kind == ROUND_BF16) {  // round to nearest even, keep the result in fp32
      const I u = _mm512_castps_si512(v);
      const I lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const I r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
      return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    if (kind == ROUND_FP16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
  }

  // lut4: the 32 weights of 16 packed bytes from a 16-entry table (one vector), in the permuted
  // activation order: w[0] = elements 0, 2, .., 30 (high nibbles), w[1] = 1, 3, .., 31.
  static void lut4_unpack(const F* table, const uint8_t* bytes, F w[2]) {
    const I v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    w[0] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table[0]);
    w[1] = _mm512_permutexvar_ps(v, table[0]);  // vpermps reads the low 4 bits only
  }

  // lut4: `count` weights (a multiple of 32) of packed `bytes` in natural order into dst (fp32, or
  // bf16 bits when bf16).
  static void lut4_dequant_block(const F* table, const uint8_t* bytes, int64_t count, void* dst, bool bf16) {
    if (bf16) {
      // The 16 entries rounded to bf16 once (as the fp32 path would round each weight), then
      // each dword of nibble indices (byte b -> words b >> 4, b & 15: elements 2j, 2j + 1) picks
      // two bf16 weights with one vpermw: 32 weights per 16 bytes, in natural order.
      const I lut16 = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(table[0])));
      const I low = _mm512_set1_epi32(15);
      uint16_t* o = static_cast<uint16_t*>(dst);
      for (int64_t k = 0; k < count; k += 32) {
        const I v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + k / 2)));
        const I idx = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(_mm512_and_si512(v, low), 16));
        _mm512_storeu_si512(o + k, _mm512_permutexvar_epi16(idx, lut16));
      }
      return;
    }
    const I first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const I second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    float* o = static_cast<float*>(dst);
    for (int64_t k = 0; k < count; k += 32) {
      F w[2];
      lut4_unpack(table, bytes + k / 2, w);
      _mm512_storeu_ps(o + k, _mm512_permutex2var_ps(w[0], first, w[1]));
      _mm512_storeu_ps(o + k + 16, _mm512_permutex2var_ps(w[0], second, w[1]));
    }
  }

  // int8: 16 int8 codes as fp32.
  static F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // int8: clamp(rint(v * r), lo, hi) + offset (NaN products -> 0, as the reference), stored as 16
  // bytes (truncated: signed and unsigned codes alike).
  static void quantize_store(uint8_t* dst, F v, F r, I lo, I hi, I offset, bool /*unsigned_codes*/) {
    v = _mm512_mul_ps(v, r);
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);  // NaN (inf * 0 in a row with an inf) -> 0
    I c = _mm512_cvtps_epi32(v);  // round half to even
    c = _mm512_min_epi32(_mm512_max_epi32(c, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_add_epi32(c, offset)));
  }
  // int8 static: v * r with NaN -> 0, clamped to [lo, hi] in fp32 (before the conversion: inf and
  // huge products saturate), rounded half to even, + add, stored as 16 bytes (truncated: signed
  // and offset codes alike). Returns the lanes whose product was NaN, one bit each.
  static int quantize_static_store(uint8_t* dst, F v, F r, F lo, F hi, I add, bool /*unsigned_codes*/) {
    v = _mm512_mul_ps(v, r);
    const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    v = _mm512_min_ps(_mm512_max_ps(_mm512_maskz_mov_ps(ordered, v), lo), hi);
    const I c = _mm512_add_epi32(_mm512_cvtps_epi32(v), add);  // round half to even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(c));
    return static_cast<uint16_t>(~ordered);
  }
  static I set1_i32(int v) { return _mm512_set1_epi32(v); }
};

}  // namespace
}  // namespace tq
