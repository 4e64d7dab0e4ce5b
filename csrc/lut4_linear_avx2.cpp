// The lut4 kernel (lut4_linear_body.h) for AVX2 + FMA (+ F16C for fp16-rounded int4 tables).
//
// Linkage: this unit compiles with other target flags than its siblings, so nothing it compiles
// may be shared with them. The traits (simd_avx2.h) and the kernel body are defined in anonymous
// namespaces: every instantiation here has internal linkage, so the linker cannot merge it with
// the AVX-512 unit's (an inline function or template with external linkage would be emitted by
// both and one copy, possibly built for AVX-512, would serve both). Only kLut4Avx2 is exported.
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "lut4_linear_body.h"

namespace tq {
extern const Lut4Kernels kLut4Avx2 = {&Lut4Kernel<Avx2>::rows, &Lut4Kernel<Avx2>::dequant, &Lut4Kernel<Avx2>::decode, Avx2::kLanes, &Lut4Kernel<Avx2>::lookup_rows, false, &Lut4Kernel<Avx2>::gemm_rows, &lut4_q8_rows_avx2, &lut4_q8_gemm_avx2, &lut4_q8_block_avx2, nullptr, nullptr, nullptr, 0};
}  // namespace tq
