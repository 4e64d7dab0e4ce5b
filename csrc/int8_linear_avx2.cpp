// The int8 kernels (int8_linear_body.h) for AVX2 + FMA, with the AVX2 int8 dot product: |w|
// (unsigned) times sign(w) * x (signed) with vpmaddubsw; with |x| <= 127 and |w| <= 128 a pair
// sums to at most 32512, so the int16 step never saturates. Activation codes within [-64, 63]
// (7-bit ranges) take the narrow kernels instead: codes + 64 (unsigned, <= 127) times the signed
// weights straight into vpmaddubsw (pairs <= 2 * 127 * 128 = 32512), minus 64 * the weight row's
// sum: three instructions per 32 products instead of four. These dynamic kernels also serve
// AVX-512 CPUs without VNNI (see int8_linear.h). Linkage: as lut4_linear_avx2.cpp (everything
// internal but kInt8Avx2).
#pragma GCC target("avx2,fma")
#include <stdlib.h>
#include <string.h>

#include "simd_avx2.h"
#include "int8_gemm_body.h"
#include "int8_linear_body.h"
#include "int8_panels_body.h"

namespace tq {
namespace {

struct Avx2SignDot {
  using Acc = __m256i;
  using X = __m256i;  // 32 activation codes
  struct Weights {
    __m256i w, abs_w;
  };
  struct RowSum {};  // nothing to correct
  static constexpr int kBytes = 32;

  static Acc zero() { return _mm256_setzero_si256(); }
  static RowSum rowsum_zero() { return {}; }
  static const uint8_t* activations(const Int8Params& p) { return reinterpret_cast<const uint8_t*>(p.xq); }
  static X load_activations(const uint8_t* x) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x)); }
  static Weights load_weights(const int8_t* w, RowSum&) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return {v, _mm256_abs_epi8(v)};
  }
  static Acc dot(Acc acc, X x, const Weights& w) {
    const __m256i pairs = _mm256_maddubs_epi16(w.abs_w, _mm256_sign_epi8(x, w.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static int32_t hsum(Acc v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
  static int32_t correction(const RowSum&) { return 0; }
};

// Narrow activations (int8_linear.h: Int8Kernels.narrow_rows): codes + 64 against the signed
// weights, the weight rows' sums kept alongside for the correction.
struct Avx2NarrowDot {
  using Acc = __m256i;
  using X = __m256i;  // 32 activation codes + 64
  using Weights = __m256i;
  using RowSum = __m256i;
  static constexpr int kBytes = 32;

  static Acc zero() { return _mm256_setzero_si256(); }
  static RowSum rowsum_zero() { return _mm256_setzero_si256(); }
  static const uint8_t* activations(const Int8Params& p) { return p.xu; }
  static X load_activations(const uint8_t* x) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x)); }
  static Weights load_weights(const int8_t* w, RowSum& rowsum) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    rowsum = _mm256_add_epi32(rowsum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1)));
    return v;
  }
  static Acc dot(Acc acc, X x, Weights w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
  }
  static int32_t hsum(Acc v) { return Avx2SignDot::hsum(v); }
  static int32_t correction(RowSum rowsum) { return kNarrowOffset * hsum(rowsum); }
};

// ---- the dynamic GEMM forms (int8_linear.h: Int8Kernels.dynamic_gemm, narrow_gemm) ---------

// The sign trick on panel steps that carry |w|: |w| x sign(x, w) (pairs <= 2 * 128 * 127, no
// saturation), vpmaddwd to int32.
struct SignStep {
  static constexpr bool kAbs = true;
  static constexpr int kOffset = 0;
  static __m256i step(__m256i acc, __m256i xb, const int8_t* pw, int half) {
    const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 32 * half));
    const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 64 + 32 * half));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xb, w)), _mm256_set1_epi16(1)));
  }
};

// Narrow activations: codes + 64 (<= 127) straight against the signed codes.
struct NarrowStep {
  static constexpr bool kAbs = false;
  static constexpr int kOffset = kNarrowOffset;
  static __m256i step(__m256i acc, __m256i xb, const int8_t* pw, int half) {
    const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 32 * half));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w), _mm256_set1_epi16(1)));
  }
};

void dynamic_gemm(const Int8Params& p, int64_t n0, int64_t n1) {
  int8_gemm<SignStep>(p, n0, n1, Int8DotKernel<Avx2SignDot>::dynamic_rows);
}

void narrow_gemm(const Int8Params& p, int64_t n0, int64_t n1) {
  int8_gemm<NarrowStep>(p, n0, n1, Int8DotKernel<Avx2NarrowDot>::dynamic_rows);
}

}  // namespace

extern const Int8Kernels kInt8Avx2 = {&Int8Kernel<Avx2>::weight_rows, &Int8DotKernel<Avx2SignDot>::dynamic_rows, 0,
                                      &Int8Kernel<Avx2>::quantize_rows, &Int8Kernel<Avx2>::quantize_static_rows,
                                      &Int8Kernel<Avx2>::dequant_rows, &dynamic_gemm, kInt8GemmMinMAvx2,
                                      &Int8Kernel<Avx2>::weight_gemm, kInt8WeightGemmMinMAvx2,
                                      &Int8DotKernel<Avx2NarrowDot>::dynamic_rows,
                                      &narrow_gemm, &unpack_panels_avx2, nullptr};

}  // namespace tq
