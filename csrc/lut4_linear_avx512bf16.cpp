// The lut4 kernels for AVX-512 with AVX512_BF16 (see lut4_linear.h): the AVX-512 kernel body
// (lut4_linear_body.h) whose bf16-rounded tables (int4 with bf16 scales and zeros in blocks of 32)
// are built two blocks at a time with vcvtne2ps2bf16 (simd_avx512bf16.h), the bf16 dot path for up
// to kLut4DotMaxM bf16 activation rows, and the scaled dot path's instructions (fp32 scales,
// lut4_scaled_dot_body.h). cpu.cpp puts them into the AVX-512 table's rows_bf16 / dequant_bf16 /
// dot_bf16 / scaled_dot on CPUs with AVX512_BF16 unless TORCHQ_NATIVE_AVX512BF16=0.
// Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "dot_bf16_avx512.h"
#include "lut4_dot_body.h"
#include "lut4_linear_body.h"
#include "lut4_scaled_dot_body.h"

namespace tq {
namespace {

using Body = Lut4Kernel<Avx512Bf16>;

// The bf16 dot path's tables and lookups (lut4_dot_body.h).
struct Lut4DotOps : Avx512Bf16DotOps {
  using Tab = __m512i;

  // The bf16 words of flat blocks i and j (j < 0: B's half is zero): [A's 16 entries | B's 16],
  // rounded as Body::entries rounds them (j == i: both halves block i's).
  __attribute__((always_inline)) static Tab table(const Lut4Params& p, int64_t i, int64_t j) {
    const __m512 code = _mm512_loadu_ps(p.codebook), zero = _mm512_setzero_ps();
    const bool pair = j >= 0;
    __m512 a = code, b = code;
    if (p.shifts) {
      a = _mm512_add_ps(a, _mm512_set1_ps(p.shifts[i]));
      b = pair ? _mm512_add_ps(b, _mm512_set1_ps(p.shifts[j])) : zero;
    }
    a = _mm512_mul_ps(a, _mm512_set1_ps(p.absmax[i]));
    b = pair ? _mm512_mul_ps(b, _mm512_set1_ps(p.absmax[j])) : zero;
    const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    // without a pair, B's words are +0 and stay +0 plus +0
    return p.zeros ? Avx512Bf16::plus_then_bf16(r, _mm512_set1_ps(p.zeros[i]), pair ? _mm512_set1_ps(p.zeros[j]) : zero) : r;
  }

  // 32 (or 16, the rest zero) packed bytes at w -> 64 weights as bf16: lo = the low nibbles (odd
  // positions), hi = the high nibbles (even positions), word j of each from byte j, bytes 16..31
  // indexing the table's B half.
  __attribute__((always_inline)) static void weights(const Tab& tab, const uint8_t* w, int bytes, B& lo, B& hi) {
    const __m256i b = bytes == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m512i v = _mm512_cvtepu8_epi16(b);
    const __m512i bsel = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const __m512i low = _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(15), bsel, 0xEA);  // (v & 15) | bsel
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(v, 4), bsel);
    lo = (B)_mm512_permutexvar_epi16(low, tab);
    hi = (B)_mm512_permutexvar_epi16(high, tab);
  }
};

void dot_rows(const Lut4Params& p, int64_t n0, int64_t n1) { Lut4DotBody<Lut4DotOps>::rows(p, n0, n1, &Body::rows); }

// The scaled dot path's weights (lut4_scaled_dot_body.h): codebook values as bf16 words by vpermw.
struct Lut4ScaledDotOps : Avx512Bf16DotOps {
  using Tab = __m512i;
  static constexpr bool kConstantBlocks = true;  // Lut4ScaledDot::tile

  // Words c and c + 16: codebook[c] as bf16 (exact: the caller allows only integer codebooks that are bf16 values).
  static Tab table(const float* codebook) {
    alignas(64) uint16_t words[32];
    for (int c = 0; c < 16; ++c) {
      uint32_t u;
      memcpy(&u, codebook + c, sizeof u);
      words[c] = words[c + 16] = static_cast<uint16_t>(u >> 16);
    }
    return _mm512_load_si512(words);
  }

  // The table kind (lut4_scaled_dot_body.h): the codebook as fp32 lanes 0-15, and a chunk's table
  // [bf16(code * a) | bf16(code * b)] (one fp32 rounding each, then vcvtne2ps2bf16's).
  static V code(const float* codebook) { return _mm512_loadu_ps(codebook); }
  __attribute__((always_inline)) static Tab table2(const V& code, float a, float b) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(code, _mm512_set1_ps(b)), _mm512_mul_ps(code, _mm512_set1_ps(a)));
  }
  // weights() of 64 bytes with each index's bit 4 (the next nibble's low bit there) replaced by the
  // block: 0 for words 0-15 (positions 0-63), 1 for words 16-31 (one vpternlog: (v & 15) | that bit).
  __attribute__((always_inline)) static void weights_split(const Tab& tab, const uint8_t* w, B (&q)[4]) {
    const __m512i v = _mm512_loadu_si512(w);
    const __m512i block = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1), low = _mm512_set1_epi16(15);
    q[0] = (B)_mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(v, low, block, 0xEA), tab);
    q[1] = (B)_mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low, block, 0xEA), tab);
    q[2] = (B)_mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low, block, 0xEA), tab);
    q[3] = (B)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(v, 12), block), tab);
  }
  // lut4_scale of flat blocks [b0, b0 + count) into dst, 16 at a time: map[code] by eight vpermi2ps
  // (32 entries each, by the code's low 5 bits) and three blends (bits 5, 6, 7), times absmax2 of
  // its 256-block (16 consecutive blocks span at most two), plus the offset: two roundings, as
  // lut4_scale (no FMA).
  static void decode_scales(const Lut4Params& p, int64_t b0, int64_t count, float* dst) {
    __m512 map[16];
    for (int i = 0; i < 16; ++i) map[i] = _mm512_loadu_ps(p.nested_map + 16 * i);
    const __m512 offset = _mm512_set1_ps(p.nested_offset);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < count; i += 16) {
      const int c = count - i < 16 ? static_cast<int>(count - i) : 16;
      const __mmask16 keep = static_cast<__mmask16>((1u << c) - 1u);
      const __m512i code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(keep, p.nested_codes + b0 + i));
      __m512 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm512_permutex2var_ps(map[2 * j], code, map[2 * j + 1]);
      const __mmask16 bit5 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(32)), bit6 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(64)),
                      bit7 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(128));
      for (int j = 0; j < 4; ++j) r[j] = _mm512_mask_blend_ps(bit5, r[2 * j], r[2 * j + 1]);
      for (int j = 0; j < 2; ++j) r[j] = _mm512_mask_blend_ps(bit6, r[2 * j], r[2 * j + 1]);
      const __m512 value = _mm512_mask_blend_ps(bit7, r[0], r[1]);
      const int64_t g0 = (b0 + i) >> 8, g1 = (b0 + i + c - 1) >> 8;
      __m512 absmax2 = _mm512_set1_ps(p.nested_absmax[g0]);
      if (g1 != g0) {  // lanes from 256 - (b0 + i) % 256 on are the next group's
        const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>((b0 + i) & 255)));
        absmax2 = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(256)), absmax2, _mm512_set1_ps(p.nested_absmax[g1]));
      }
      _mm512_mask_storeu_ps(dst + i, keep, _mm512_add_ps(_mm512_mul_ps(value, absmax2), offset));
    }
  }

  // vpermw reads an index's low 5 bits: each 16-bit word of the packed bytes indexes by its nibble
  // at bits 0-3 (words c and c + 16 are equal), its others after a shift by 4, 8 and 12.
  __attribute__((always_inline)) static void weights(const Tab& tab, const uint8_t* w, int bytes, B (&q)[4]) {
    const __mmask64 keep = bytes >= 64 ? ~0ull : (1ull << bytes) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(keep, w);
    q[0] = (B)_mm512_permutexvar_epi16(v, tab);
    q[1] = (B)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
    q[2] = (B)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab);
    q[3] = (B)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab);
  }

  // weights() for bytes <= 32: the 64 weights of the low 256 bits only (words 0-15), the upper
  // halves of q zero.
  __attribute__((always_inline)) static void weights_low(const Tab& tab, const uint8_t* w, int bytes, B (&q)[4]) {
    const __m256i v = _mm256_maskz_loadu_epi8(bytes >= 32 ? ~0u : (1u << bytes) - 1u, w);
    const __m256i t = _mm512_castsi512_si256(tab);  // vpermw on 256 bits reads 4 index bits: words 0-15
    q[0] = (B)_mm512_zextsi256_si512(_mm256_permutexvar_epi16(v, t));
    q[1] = (B)_mm512_zextsi256_si512(_mm256_permutexvar_epi16(_mm256_srli_epi16(v, 4), t));
    q[2] = (B)_mm512_zextsi256_si512(_mm256_permutexvar_epi16(_mm256_srli_epi16(v, 8), t));
    q[3] = (B)_mm512_zextsi256_si512(_mm256_permutexvar_epi16(_mm256_srli_epi16(v, 12), t));
  }
  // dp() on lanes 0-7 (the low 256 bits of each operand); lanes 8-15 of the result acc's.
  __attribute__((always_inline)) static V dp_low(V acc, B a, B b) {
    return _mm512_insertf32x8(acc, _mm256_dpbf16_ps(_mm512_castps512_ps256(acc), (__m256bh)_mm512_castsi512_si256((__m512i)a),
                                                    (__m256bh)_mm512_castsi512_si256((__m512i)b)), 0);
  }

  // Lut4EmulatedDotOps::values_ok, 16 values at a time: with a = |bits|, every a is 0 or in
  // [min, 2^100] exactly when (unsigned) a - 1 >= min_bits - 1 (a - 1 wraps 0 to the top)
  // and a <= 2^100's bits; the running minimum of a - 1 and maximum of a over both arrays, compared once.
  static bool values_ok(const float* v, const float* w, int64_t count, uint32_t min_bits) {
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), minus1 = _mm512_set1_epi32(-1);
    __m512i lo = minus1, hi = _mm512_setzero_si512();
    auto take = [&](__m512i bits) {
      const __m512i a = _mm512_and_si512(bits, magnitude);
      lo = _mm512_min_epu32(lo, _mm512_add_epi32(a, minus1));
      hi = _mm512_max_epu32(hi, a);
    };
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      take(_mm512_loadu_si512(v + i));
      if (w) take(_mm512_loadu_si512(w + i));
    }
    if (i < count) {  // the rest: masked-off lanes read as 0, which passes
      const __mmask16 rest = static_cast<__mmask16>((1u << (count - i)) - 1u);
      take(_mm512_maskz_loadu_epi32(rest, v + i));
      if (w) take(_mm512_maskz_loadu_epi32(rest, w + i));
    }
    return !(_mm512_cmplt_epu32_mask(lo, _mm512_set1_epi32(static_cast<int>(min_bits - 1u))) |
             _mm512_cmpgt_epu32_mask(hi, _mm512_set1_epi32(0x71800000)));
  }

  // Lane l: v[l / per] (per 4, 8 or 16) where l / per < count, else 0; one masked load and a
  // permute (per 16: a broadcast).
  __attribute__((always_inline)) static V spread(const float* v, int per, int count) {
    if (per == 16) return _mm512_set1_ps(v[0]);  // count is 1
    const __m512i idx = per == 4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), v));
  }
};

void scaled_dot_rows(const Lut4Params& p, int64_t n0, int64_t n1) { Lut4ScaledDotPath<Lut4ScaledDotOps>::rows(p, n0, n1, &Body::rows); }

}  // namespace

// Only rows, dequant and dot_bf16 are used (cpu.cpp: rows_bf16 / dequant_bf16 / dot_bf16 of the
// AVX-512 table); the scaled dot path goes to its scaled_dot.
extern const Lut4Kernels kLut4Avx512Bf16 = {&Body::rows, &Body::dequant, nullptr, 0, nullptr, false, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &dot_rows, 0};
extern const Lut4RowsFn kLut4Avx512Bf16ScaledDot = &scaled_dot_rows;
extern const Lut4ValuesOkFn kLut4Avx512Bf16ScaledDotValuesOk = &Lut4ScaledDotOps::values_ok;
}  // namespace tq
