// The int8 kernels (int8_linear_body.h) for AVX2 + FMA, with the AVX2 int8 dot product: |w|
// (unsigned) times sign(w) * x (signed) with vpmaddubsw; with |x| <= 127 and |w| <= 128 a pair
// sums to at most 32512, so the int16 step never saturates. This dynamic kernel also serves
// AVX-512 CPUs without VNNI (see int8_linear.h). Linkage: as lut4_linear_avx2.cpp (everything
// internal but kInt8Avx2).
#pragma GCC target("avx2,fma")
#include "simd_avx2.h"
#include "int8_linear_body.h"

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

}  // namespace

extern const Int8Kernels kInt8Avx2 = {&Int8Kernel<Avx2>::weight_rows, &Int8DotKernel<Avx2SignDot>::dynamic_rows, 0,
                                      &Int8Kernel<Avx2>::quantize_rows, &Int8Kernel<Avx2>::dequant_rows};

}  // namespace tq
