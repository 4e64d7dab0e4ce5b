// The bf16 dot-product GEMM (bf16_dp_gemm.h) on AVX512_BF16, decoded form (lut4 weights):
// bf16_dp_gemm_body.h over dot_bf16_avx512.h (the int8 form: int8_linear_avx512bf16.cpp). cpu.cpp
// puts it into the AVX-512 table's bf16_dp_gemm on CPUs with AVX512_BF16 unless
// TORCHQ_NATIVE_AVX512BF16=0. Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "dot_bf16_avx512.h"
#include "bf16_dp_gemm_body.h"

namespace tq {
namespace {

void gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) { Bf16DpBody<Avx512Bf16DotOps, false>::gemm(g, n0, n1); }

}  // namespace

extern const Bf16DpGemmFn kBf16DpAvx512Bf16Gemm = &gemm;

}  // namespace tq
