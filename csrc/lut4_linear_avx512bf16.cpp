// The lut4 kernel (lut4_linear_body.h) for AVX-512 with AVX512_BF16: the AVX-512 kernel whose
// bf16-rounded tables (int4 with bf16 scales and zeros) are built two blocks at a time with
// vcvtne2ps2bf16 (simd_avx512bf16.h). cpu.cpp puts its rows and dequant into the AVX-512 table's
// rows_bf16 / dequant_bf16 on CPUs with AVX512_BF16 unless TORCHQ_NATIVE_AVX512BF16=0. Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "lut4_linear_body.h"

namespace tq {
// Only rows and dequant are used (cpu.cpp: rows_bf16 / dequant_bf16 of the AVX-512 table).
extern const Lut4Kernels kLut4Avx512Bf16 = {&Lut4Kernel<Avx512Bf16>::rows, &Lut4Kernel<Avx512Bf16>::dequant, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}  // namespace tq
