// The int8 GEMM on AMX tiles (tdpbssd; int8_amx_body.h) for CPUs with AMX-INT8 (Sapphire Rapids
// and later). This unit compiles with AMX and AVX-512 flags, so it exports only data (the kernel's
// address): the detection and Linux's permission, which run on every CPU, live in cpu.cpp.
// Built only by x86-64 compilers with the AMX intrinsics (GCC 11, clang 12); else kInt8AmxGemm
// is null and the CPU is treated as having no AMX. Linkage: as lut4_linear_avx2.cpp.
#include "common.h"
#include "int8_linear.h"

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>

#include "amx_tiles.h"
#include "int8_amx_body.h"

namespace tq {
namespace {

// Tiles 0..5 (C 0..3, A 4, B 5).
struct AmxTiles : AmxTileOps<6> {
  template <int C, int A, int B>
  static void dot() { asm volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C)); }
};

void gemm(const Int8Params& p, int64_t n0, int64_t n1) { amx_int8_gemm<AmxTiles>(p, n0, n1, kInt8Scalar.dynamic_rows); }
void panel_gemm(const Int8Params& p, int64_t n0, int64_t n1) { amx_int8_gemm<AmxTiles, true>(p, n0, n1, nullptr); }

}  // namespace

extern const Int8RowsFn kInt8AmxGemm = &gemm;
extern const Int8RowsFn kInt8AmxPanelGemm = &panel_gemm;

}  // namespace tq
#else
namespace tq {
extern const Int8RowsFn kInt8AmxGemm = nullptr;
extern const Int8RowsFn kInt8AmxPanelGemm = nullptr;
}  // namespace tq
#endif
