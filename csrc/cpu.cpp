// CPU feature detection, the ISA override (tq_set_isa, or TORCHQ_NATIVE_ISA at load) and the
// kernel table of the active ISA (kernels.h).
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>

#include "bf16_amx.h"
#include "bf16_dp_gemm.h"
#include "common.h"
#include "kernels.h"
#include "weight_abi.h"

namespace tq {
namespace {

int detect() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return ISA_AVX2;
  return ISA_SCALAR;
}

int from_environment(int best) {
  const char* s = getenv("TORCHQ_NATIVE_ISA");
  if (s == nullptr || *s == 0) return best;
  int wanted = best;
  if (strcmp(s, "scalar") == 0) wanted = ISA_SCALAR;
  else if (strcmp(s, "avx2") == 0) wanted = ISA_AVX2;
  else if (strcmp(s, "avx512") == 0) wanted = ISA_AVX512;
  return wanted < best ? wanted : best;
}

// Whether the int8 dynamic kernel and the int8-activation lut4 GEMM may use AVX-512 VNNI
// (vpdpbusd): the CPU has it and TORCHQ_NATIVE_VNNI is not "0" (read at load). TORCHQ_NATIVE_VNNI=0
// runs the path of AVX-512 CPUs that lack VNNI (the AVX2 kernels), so a VNNI machine tests it too.
bool use_vnni() {
  __builtin_cpu_init();
  const char* s = getenv("TORCHQ_NATIVE_VNNI");
  return __builtin_cpu_supports("avx512vnni") && (s == nullptr || strcmp(s, "0") != 0);
}

// Whether the lut4 kernel builds bf16-rounded tables with AVX512_BF16 (lut4_linear_avx512bf16.cpp):
// the CPU has it and TORCHQ_NATIVE_AVX512BF16 is not "0" (read at load). =0 runs the AVX-512 path
// of CPUs without it, so an AVX512_BF16 machine tests both.
bool use_avx512bf16() {
  __builtin_cpu_init();
  const char* s = getenv("TORCHQ_NATIVE_AVX512BF16");
  return __builtin_cpu_supports("avx512bf16") && (s == nullptr || strcmp(s, "0") != 0);
}

// One table per ISA, built once at load from the kernel sets the ISA units export (constant
// initialized, so ready before this dynamic initialization). A table is never written after.
struct Tables {
  KernelTable by_isa[3];
  Tables() {
    by_isa[ISA_SCALAR] = {ISA_SCALAR, kLut4Scalar, kInt8Scalar};
    by_isa[ISA_AVX2] = {ISA_AVX2, kLut4Avx2, kInt8Avx2};
    by_isa[ISA_AVX512] = {ISA_AVX512, kLut4Avx512, kInt8Avx512};
    if (use_avx512bf16()) {
      by_isa[ISA_AVX512].lut4.rows_bf16 = kLut4Avx512Bf16.rows;
      by_isa[ISA_AVX512].lut4.dequant_bf16 = kLut4Avx512Bf16.dequant;
      by_isa[ISA_AVX512].lut4.dot_bf16 = kLut4Avx512Bf16.dot_bf16;
      by_isa[ISA_AVX512].int8.dot_bf16 = kInt8Avx512Bf16Dot;
      by_isa[ISA_AVX512].int8.dequant_bf16 = kInt8Avx512Bf16Dequant;
      by_isa[ISA_AVX512].lut4.scaled_dot = kLut4Avx512Bf16ScaledDot;
      by_isa[ISA_AVX512].bf16_dp_gemm = kBf16DpAvx512Bf16Gemm;
      by_isa[ISA_AVX512].bf16_dp_int8_gemm = kInt8Avx512Bf16DpGemm;
    }
    if (!use_vnni()) {
      by_isa[ISA_AVX512].int8.dynamic_rows = kInt8Avx2.dynamic_rows;
      by_isa[ISA_AVX512].int8.dynamic_offset = kInt8Avx2.dynamic_offset;
      by_isa[ISA_AVX512].int8.dynamic_gemm = kInt8Avx2.dynamic_gemm;
      by_isa[ISA_AVX512].int8.dynamic_gemm_min_m = kInt8Avx2.dynamic_gemm_min_m;
      by_isa[ISA_AVX512].int8.narrow_rows = kInt8Avx2.narrow_rows;
      by_isa[ISA_AVX512].int8.narrow_gemm = kInt8Avx2.narrow_gemm;
      by_isa[ISA_AVX512].int8.panel_rows = kInt8Avx2.panel_rows;
      by_isa[ISA_AVX512].lut4.q8_gemm = kLut4Avx2.q8_gemm;
      by_isa[ISA_AVX512].lut4.q8_gemm_min_m = kLut4Avx2.q8_gemm_min_m;
    }
  }
};

const Tables g_tables;
const int g_supported = detect();
std::atomic<const KernelTable*> g_active{&g_tables.by_isa[from_environment(g_supported)]};

}  // namespace

const KernelTable& kernels() { return *g_active.load(std::memory_order_relaxed); }

// CPUID leaf 7's AMX-TILE bit and the data type's (AMX-INT8 / AMX-BF16), then Linux's permission
// for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it AMX
// instructions raise SIGILL. Compiled without target flags: it runs on every CPU.
static bool amx_granted(unsigned type_bit) {
#if defined(__x86_64__) && defined(__linux__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << type_bit))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
#else
  (void)type_bit;
  return false;
#endif
}

bool amx_int8_supported() {
  static const bool ok = kInt8AmxGemm && amx_granted(25);
  return ok;
}

bool amx_bf16_supported() {
  static const bool ok = kBf16AmxGemm && amx_granted(22);
  return ok;
}

int active_isa() { return kernels().isa; }

}  // namespace tq

TQ_API int tq_abi_version() { return TQ_ABI_VERSION; }
TQ_API int tq_supported_isa() { return tq::g_supported; }
// The optional kernels the AVX-512 table uses (fixed at load): bit 0 the VNNI kernels (int8, int4a8 GEMM)
// (TORCHQ_NATIVE_VNNI), bit 1 the lut4 bf16 pair tables (TORCHQ_NATIVE_AVX512BF16), bit 2 the AMX
// int8 GEMM (the CPU has it, Linux granted it and tq_set_int8_amx leaves it on), bit 3 the AMX
// bf16 GEMM (likewise, tq_set_bf16_amx).
TQ_API int tq_features() {
  const tq::KernelTable& t = tq::g_tables.by_isa[tq::ISA_AVX512];
  return (t.int8.dynamic_rows != tq::kInt8Avx2.dynamic_rows ? 1 : 0) | (t.lut4.rows_bf16 ? 2 : 0) |
         (tq::kInt8AmxGemm && tq::int8_amx_gemm() == tq::kInt8AmxGemm ? 4 : 0) |
         (tq::bf16_amx_mode() == tq::BF16_AMX_ON && tq::bf16_amx_active() ? 8 : 0);
}
TQ_API int tq_active_isa() { return tq::active_isa(); }
// Use at most `isa` (clamped to what the CPU supports); returns the ISA now active.
TQ_API int tq_set_isa(int isa) {
  int v = isa < tq::ISA_SCALAR ? tq::ISA_SCALAR : isa;
  if (v > tq::g_supported) v = tq::g_supported;
  tq::g_active.store(&tq::g_tables.by_isa[v], std::memory_order_relaxed);
  return v;
}
