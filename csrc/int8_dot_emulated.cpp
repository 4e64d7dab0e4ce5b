// The int8 weight-only bf16 dot path (and the bf16 dot-product GEMM's int8 form, and the bf16
// dequantization) on emulated instructions (int8_dot_body.h over
// dot_bf16_emulated.h, plus the code conversion of int8_linear_avx512bf16.cpp on arrays). The same
// bits as the AVX512_BF16 kernel, on any CPU:
// tq_set_int8_dot(INT8_DOT_EMULATED) runs it (tests), with the active ISA's fp32 row kernel for
// the weight rows that fall back. Compiled for the baseline ISA.
#include <string.h>

#include "dot_bf16_emulated.h"
#include "int8_dot_body.h"
#include "bf16_dp_gemm_body.h"
#include "kernels.h"

namespace tq {
namespace {

// The int8 codes as bf16 words on dot_bf16_emulated.h's arrays.
struct Int8EmulatedDotOps : EmulatedDotOps {
  static uint16_t bf16_of_code(int8_t q) { return bf16_word(static_cast<float>(q)); }  // exact: |q| <= 128

  static B codes(const int8_t* w) {
    B b;
    for (int j = 0; j < 32; ++j) b.h[j] = bf16_of_code(w[j]);
    return b;
  }

  static B codes_tail(const int8_t* w, int64_t count) {
    B b{};
    for (int64_t j = 0; j < count; ++j) b.h[j] = bf16_of_code(w[j]);
    return b;
  }
};

// bytes64 and code_pairs (bf16_dp_gemm_body.h) on arrays.
struct Int8EmulatedDpOps : Int8EmulatedDotOps {
  static B bytes64(const int8_t* w, int64_t count) {
    B b{};
    memcpy(b.h, w, static_cast<size_t>(count));
    return b;
  }
  static void code_pairs(const int8_t* chunk, B& a, B& b) {
    for (int t = 0; t < 16; ++t)
      for (int j = 0; j < 2; ++j) {
        a.h[2 * t + j] = bf16_of_code(chunk[4 * t + j]);
        b.h[2 * t + j] = bf16_of_code(chunk[4 * t + 2 + j]);
      }
  }
};

// int8_dequant_bf16's operations on arrays, vcvtne2ps2bf16 as Intel defines it: subnormal inputs
// read as zero (keeping the sign), NaN quieted (its top 16 bits with the quiet bit set), the others
// rounded to nearest even.
struct Int8EmulatedDequantOps {
  struct V {
    float f[16];
  };
  static void codes_f32(const int8_t* w, int64_t count, V& lo, V& hi) {
    for (int j = 0; j < 16; ++j) {
      lo.f[j] = j < count ? static_cast<float>(w[j]) : 0.0f;
      hi.f[j] = 16 + j < count ? static_cast<float>(w[16 + j]) : 0.0f;
    }
  }
  static V mul(V v, float s) {
    for (float& f : v.f) f *= s;
    return v;
  }
  static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static void store_bf16(uint16_t* dst, const V& lo, const V& hi, int64_t count) {
    for (int64_t j = 0; j < count; ++j) dst[j] = to_bf16(j < 16 ? lo.f[j] : hi.f[j - 16]);
  }
};

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) { Int8Dot<Int8EmulatedDotOps>::rows(p, n0, n1, kernels().int8.weight_rows); }

void dequant(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
  int8_dequant_bf16<Int8EmulatedDequantOps>(w, scale, K, n0, n1, out, bf16, kernels().int8.dequant_rows);
}

void dp_gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) { Bf16DpBody<Int8EmulatedDpOps, true>::gemm(g, n0, n1); }

}  // namespace

extern const Int8RowsFn kInt8EmulatedDot = &dot_rows;
extern const Int8DequantFn kInt8EmulatedDequant = &dequant;
extern const Bf16DpGemmFn kBf16DpEmulatedInt8Gemm = &dp_gemm;

}  // namespace tq
