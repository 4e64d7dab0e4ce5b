// ISA traits for AVX2 + FMA (+ F16C for the fp16 rounding of lut4 tables): the vector type, its
// width and the primitives the templated kernel bodies (*_body.h) are written with. Include
// after the unit's `#pragma GCC target`. In an anonymous namespace (see common.h). A unit
// compiles only the members it uses, so round_to (F16C) needs F16C only in the lut4 unit.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "lut4_linear.h"
#include "transpose_avx2.h"  // transpose8_epi32

namespace tq {
namespace {

struct Avx2 {
  using F = __m256;   // 8 fp32 lanes
  using I = __m256i;  // 8 int32 lanes
  static constexpr int kLanes = 8;
  // lut4 tiles: 16 registers, so 2 rows per fused (small-M) tile and 3 activation rows per
  // panel tile.
  static constexpr int kLut4FusedRows = 2;
  static constexpr bool kLut4Bf16Pairs = false;  // lut4 tables in pairs (simd_avx512bf16.h)
  static constexpr int kGemmRows = 6;  // lut4 GEMM tiles: rows x 2 vectors of accumulators
  static constexpr int kLut4PanelM = 3;
  // lut4 decode tiles: weight rows per tile for one activation row (two accumulators each).
  static constexpr int kLut4DecodeRows = 4;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static F load_partial(const float* p, int64_t count) {  // p[0..count), count < 8; the other lanes 0 (not read)
    const I lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes));
  }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static bool any_nan(F v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }

  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  static __m128i bf16_bits(F v) {  // round to nearest even, 8 lanes -> 8 x uint16
    const I u = _mm256_castps_si256(v);
    const I lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const I r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void store_bf16(uint16_t* p, F v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(v)); }

  // v rounded to bf16 or fp16 (Round), kept in fp32.
  static F round_to(F v, int kind) {
    if (kind == ROUND_BF16) {  // round to nearest even, keep the result in fp32
      const I u = _mm256_castps_si256(v);
      const I lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      const I r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
      return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    if (kind == ROUND_FP16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
  }

  // lut4: values of 8 nibbles (the low 4 bits of each lane) from a 16-entry table in two vectors:
  // two 8-entry vpermps lookups and a blend on bit 3 of the nibble.
  static F lut4_lookup(const F* table, I idx) {
    const F a = _mm256_permutevar8x32_ps(table[0], idx);
    const F b = _mm256_permutevar8x32_ps(table[1], idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }

  // lut4: the 32 weights of 16 packed bytes, in the permuted activation order:
  // w[0] elements 0, 2, .., 14 | w[1] 16, 18, .., 30 | w[2] 1, 3, .., 15 | w[3] 17, 19, .., 31.
  static void lut4_unpack(const F* table, const uint8_t* bytes, F w[4]) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const I v0 = _mm256_cvtepu8_epi32(raw);
    const I v1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw));
    w[0] = lut4_lookup(table, _mm256_srli_epi32(v0, 4));
    w[1] = lut4_lookup(table, _mm256_srli_epi32(v1, 4));
    w[2] = lut4_lookup(table, v0);
    w[3] = lut4_lookup(table, v1);
  }

  // lut4: `count` weights (a multiple of 32) of packed `bytes` in natural order into dst (fp32, or
  // bf16 bits when bf16).
  static void lut4_dequant_block(const F* table, const uint8_t* bytes, int64_t count, void* dst, bool bf16) {
    for (int64_t k = 0; k < count; k += 32) {
      F v[4];  // even 0..14 | even 16..30 | odd 1..15 | odd 17..31
      lut4_unpack(table, bytes + k / 2, v);
      F out[4];
      for (int h = 0; h < 2; ++h) {
        const F lo = _mm256_unpacklo_ps(v[h], v[h + 2]), hi = _mm256_unpackhi_ps(v[h], v[h + 2]);
        out[2 * h] = _mm256_permute2f128_ps(lo, hi, 0x20);
        out[2 * h + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
      }
      for (int i = 0; i < 4; ++i) {
        if (bf16) store_bf16(static_cast<uint16_t*>(dst) + k + 8 * i, out[i]);
        else _mm256_storeu_ps(static_cast<float*>(dst) + k + 8 * i, out[i]);
      }
    }
  }

  // lut4 decode paths (lut4_linear.h): a chunk of 64 weights as 8 lanes of 8 nibbles.
  static I load_chunk(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // Nibble j of each lane (code 0..15).
  static I nibble(I v, int j) {
    if (j == 7) return _mm256_srli_epi32(v, 28);
    return _mm256_and_si256(j ? _mm256_srli_epi32(v, 4 * j) : v, _mm256_set1_epi32(15));
  }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  // Nibble j of each lane left in place, as fp32: c * 16^j exactly (4 significant bits), one mask
  // instead of a shift and a mask (j = 7, whose mask would set the sign bit: shifted down, c).
  static F nibble_in_place(I v, int j) {
    if (j == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * j))));
  }
  // codebook[nibble j] for a 16-entry codebook in two vectors: two vpermps on its low 3 bits, a
  // blend on its bit 3 (moved to the sign bit).
  static F codebook_lookup(const F* codebook, I v, int j) {
    const I idx = j ? _mm256_srli_epi32(v, 4 * j) : v;
    const F a = _mm256_permutevar8x32_ps(codebook[0], idx), b = _mm256_permutevar8x32_ps(codebook[1], idx);
    const I sign = j == 7 ? v : _mm256_slli_epi32(v, 28 - 4 * j);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(sign));
  }
  // The per-lane value of per-block values s (s[0] for the chunk's first block) when blocks of
  // `block` < 64 weights split a chunk: lane l holds weights 8l..8l+7, block 8l / block.
  // `block` is a power of two (lut4_linear.h): a shift, not the eight 64-bit divisions of 8 l /
  // block that every decode tile began with (see Lut4Kernel::decode_tile).
  static I block_lane_index(int64_t block) {
    const int shift = block < 64 ? __builtin_ctzll(static_cast<unsigned long long>(block)) : 31;
    return _mm256_srlv_epi32(_mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56), _mm256_set1_epi32(shift));
  }
  static F block_lanes(const float* s, int64_t count, I index) {  // count = 2 (block 32)
    (void)count;
    const __m128 v = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), index);
  }
  // int8: 8 int8 codes as fp32.
  static F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // int8: clamp(rint(v * r), lo, hi) + offset (NaN products -> 0, as the reference), stored as 8
  // bytes (offset 128: unsigned codes).
  static void quantize_store(uint8_t* dst, F v, F r, I lo, I hi, I offset, bool unsigned_codes) {
    v = _mm256_mul_ps(v, r);
    v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // NaN (inf * 0 in a row with an inf) -> 0
    I c = _mm256_cvtps_epi32(v);  // round half to even
    c = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(c, lo), hi), offset);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    const __m128i b8 = unsigned_codes ? _mm_packus_epi16(w16, w16) : _mm_packs_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), b8);
  }
  // int8 static: v * r with NaN -> 0, clamped to [lo, hi] in fp32 (before the conversion: inf and
  // huge products saturate), rounded half to even, + add, stored as 8 bytes (unsigned_codes: the
  // codes + an offset, 0..255). Returns the lanes whose product was NaN, one bit each.
  static int quantize_static_store(uint8_t* dst, F v, F r, F lo, F hi, I add, bool unsigned_codes) {
    v = _mm256_mul_ps(v, r);
    const F ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
    v = _mm256_min_ps(_mm256_max_ps(_mm256_and_ps(v, ordered), lo), hi);
    const I c = _mm256_add_epi32(_mm256_cvtps_epi32(v), add);  // round half to even
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    const __m128i b8 = unsigned_codes ? _mm_packus_epi16(w16, w16) : _mm_packs_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), b8);
    return _mm256_movemask_ps(ordered) ^ 0xFF;
  }
  static I set1_i32(int v) { return _mm256_set1_epi32(v); }
};

}  // namespace
}  // namespace tq
