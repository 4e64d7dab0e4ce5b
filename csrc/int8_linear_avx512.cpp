// The int8 kernels (int8_linear_body.h) for AVX-512 + FMA, with the VNNI int8 dot product:
// vpdpbusd on activation codes + 128 (unsigned) and the weight codes (signed), minus
// 128 * (row sum of the weight codes), computed alongside. Linkage: as lut4_linear_avx2.cpp
// (everything internal but kInt8Avx512).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#include "simd_avx512.h"
#include "int8_gemm_body.h"
#include "int8_linear_body.h"
#include "int8_panel_body.h"
#include "int8_panels_body.h"

namespace tq {
namespace {

struct Avx512VnniDot {
  using Acc = __m512i;
  using X = __m512i;  // 64 activation codes + 128
  using Weights = __m512i;
  using RowSum = __m512i;
  static constexpr int kBytes = 64;

  static Acc zero() { return _mm512_setzero_si512(); }
  static RowSum rowsum_zero() { return _mm512_setzero_si512(); }
  static const uint8_t* activations(const Int8Params& p) { return p.xu; }
  static X load_activations(const uint8_t* x) { return _mm512_load_si512(x); }
  static Weights load_weights(const int8_t* w, RowSum& rowsum) {
    const __m512i v = _mm512_loadu_si512(w);
    rowsum = _mm512_dpbusd_epi32(rowsum, _mm512_set1_epi8(1), v);
    return v;
  }
  static Acc dot(Acc acc, X x, Weights w) { return _mm512_dpbusd_epi32(acc, x, w); }
  static int32_t hsum(Acc v) {
    __m256i h = _mm256_add_epi32(_mm512_extracti64x4_epi64(v, 0), _mm512_extracti64x4_epi64(v, 1));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
  static int32_t correction(RowSum rowsum) { return 128 * hsum(rowsum); }
};

// The GEMM form (int8_gemm_body.h): vpdpbusd of 4 broadcast codes + 128 against 8 rows' 4 signed
// codes, no saturation; minus 128 * the row sums.
struct VnniStep {
  static constexpr bool kAbs = false;
  static constexpr int kOffset = 128;
  static __m256i step(__m256i acc, __m256i xb, const int8_t* pw, int half) {
    return _mm256_dpbusd_epi32(acc, xb, _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 32 * half)));
  }
};

void dynamic_gemm(const Int8Params& p, int64_t n0, int64_t n1) {
  int8_gemm<VnniStep>(p, n0, n1, Int8DotKernel<Avx512VnniDot>::dynamic_rows);
}

// The panel kernel's instructions (int8_panel_body.h): vpdpbusd on zmm registers; outputs by 16
// lanes, bf16 rounded to nearest even with every NaN to 0x7FC0 (from_f32_row's bf16).
struct Avx512VnniPanelOps {
  using V = __m512i;
  static V zero() { return _mm512_setzero_si512(); }
  static V load(const int8_t* w) { return _mm512_loadu_si512(w); }
  static V broadcast(int32_t x4) { return _mm512_set1_epi32(x4); }
  static V dpbusd(V acc, V x, V w) { return _mm512_dpbusd_epi32(acc, x, w); }
  static void pin(V& acc) { asm("" : "+v"(acc)); }
  static void finish(const Int8Params& p, V acc, int64_t m, int64_t first, int64_t count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    // 128 * the row sums, modulo 2^32 as the sums
    const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.code_sums + first), 7);
    const __m512i dot = _mm512_sub_epi32(acc, corr);
    __m512 o;
    if (!p.row_sums) {
      o = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(p.xs[m])),
                        _mm512_maskz_loadu_ps(mask, p.scale + first));
    } else {
      alignas(64) int32_t d[16];
      alignas(64) float f[16] = {};
      _mm512_store_si512(d, dot);
      int8_panel_static_outputs(p, d, m, first, count, f);
      o = _mm512_load_ps(f);
    }
    if (p.out_bf16) {
      const __m512i u = _mm512_castps_si512(o);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
      const __m512i h = _mm512_mask_mov_epi32(Avx512::bf16_bits(o), nan, _mm512_set1_epi32(0x7FC0));
      _mm256_mask_storeu_epi16(p.out_bf16 + m * p.N + first, mask, _mm512_cvtepi32_epi16(h));
    } else {
      _mm512_mask_storeu_ps(p.out + m * p.N + first, mask, o);
    }
  }
};

void panel_rows(const Int8Params& p, int64_t n0, int64_t n1) { int8_panel_rows<Avx512VnniPanelOps>(p, n0, n1); }

}  // namespace

extern const Int8Kernels kInt8Avx512 = {&Int8Kernel<Avx512>::weight_rows, &Int8DotKernel<Avx512VnniDot>::dynamic_rows, 128,
                                        &Int8Kernel<Avx512>::quantize_rows, &Int8Kernel<Avx512>::quantize_static_rows,
                                        &Int8Kernel<Avx512>::dequant_rows, &dynamic_gemm,
                                        kInt8GemmMinMVnni,
                                        &Int8Kernel<Avx512>::weight_gemm, kInt8WeightGemmMinMAvx512,
                                        nullptr, nullptr,  // VNNI takes every range
                                        &unpack_panels_avx2, &panel_rows};

}  // namespace tq
