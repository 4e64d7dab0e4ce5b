// The lut4 kernel (lut4_linear_body.h) for AVX-512 (F, BW, VL, DQ) + FMA: no decode paths (the
// table path's one-vpermps lookup measured faster than their shifts and masks; NF4's codebook
// decode path on 16 lanes, tried again, was 5-7% slower at one row: 3072 x 512 on one Zen 4 core
// 90-92 us against the table path's 84-86, and in a standalone copy of both loops the 8 vpermps
// per 128 weights bound both, 62 us against the table loop's 69), the GEMM path; the
// int8-activation rows of AVX2 and its VNNI GEMM form (cpu.cpp swaps in AVX2's without VNNI). Linkage: as
// lut4_linear_avx2.cpp (everything internal but kLut4Avx512).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#include "simd_avx512.h"
#include "lut4_linear_body.h"

namespace tq {
extern const Lut4Kernels kLut4Avx512 = {&Lut4Kernel<Avx512>::rows, &Lut4Kernel<Avx512>::dequant, nullptr, 0, &Lut4Kernel<Avx512>::lookup_rows, true, &Lut4Kernel<Avx512>::gemm_rows, &lut4_q8_rows_avx2, &lut4_q8_gemm_avx512vnni, &lut4_q8_block_avx2, nullptr, nullptr, nullptr, 5};
}  // namespace tq
