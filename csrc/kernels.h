// The kernels of one ISA, as one table of function pointers.
//
// cpu.cpp builds one table per ISA when the library loads and points the active one at the
// widest ISA allowed (tq_set_isa, TORCHQ_NATIVE_ISA); the exported entry points read the table
// once per call and call through it, so no call switches on the ISA.
// A new kernel: a field here (its Params and function types in its own header), filled for
// every ISA in cpu.cpp's tables. A new ISA: an Isa value (common.h), its detection (cpu.cpp),
// a traits header (simd_<isa>.h) and one thin translation unit per kernel body that
// instantiates the body with those traits and exports the ISA's kernel set.
#pragma once
#include "bf16_dp_gemm.h"
#include "int8_linear.h"
#include "lut4_linear.h"

namespace tq {

struct KernelTable {
  int isa;  // Isa
  Lut4Kernels lut4;
  Int8Kernels int8;
  // The bf16 dot-product GEMM (bf16_dp_gemm.h), decoded and int8 forms: AVX-512 with AVX512_BF16
  // only, else null.
  Bf16DpGemmFn bf16_dp_gemm = nullptr, bf16_dp_int8_gemm = nullptr;
};

// The active ISA's table (never null; changes only with tq_set_isa).
const KernelTable& kernels();

}  // namespace tq
