// The int8 weight-only bf16 dot path (and the bf16 dot-product GEMM's int8 form) on emulated instructions (int8_dot_body.h over
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

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) { Int8Dot<Int8EmulatedDotOps>::rows(p, n0, n1, kernels().int8.weight_rows); }

void dp_gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) { Bf16DpBody<Int8EmulatedDpOps, true>::gemm(g, n0, n1); }

}  // namespace

extern const Int8RowsFn kInt8EmulatedDot = &dot_rows;
extern const Bf16DpGemmFn kBf16DpEmulatedInt8Gemm = &dp_gemm;

}  // namespace tq
