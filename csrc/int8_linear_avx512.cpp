// The int8 kernels (int8_linear_body.h) for AVX-512 + FMA, with the VNNI int8 dot product:
// vpdpbusd on activation codes + 128 (unsigned) and the weight codes (signed), minus
// 128 * (row sum of the weight codes), computed alongside. Linkage: as lut4_linear_avx2.cpp
// (everything internal but kInt8Avx512).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#include "simd_avx512.h"
#include "int8_gemm_body.h"
#include "int8_linear_body.h"

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

}  // namespace

extern const Int8Kernels kInt8Avx512 = {&Int8Kernel<Avx512>::weight_rows, &Int8DotKernel<Avx512VnniDot>::dynamic_rows, 128,
                                        &Int8Kernel<Avx512>::quantize_rows, &Int8Kernel<Avx512>::quantize_static_rows,
                                        &Int8Kernel<Avx512>::dequant_rows, &dynamic_gemm,
                                        kInt8GemmMinMVnni,
                                        &Int8Kernel<Avx512>::weight_gemm, kInt8WeightGemmMinMAvx512,
                                        nullptr, nullptr};  // VNNI takes every range

}  // namespace tq
