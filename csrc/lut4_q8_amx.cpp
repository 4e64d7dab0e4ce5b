// The int8-activation GEMM form of the codebook kind (nf4a8 / fp4a8) on AMX tiles
// (lut4_q8_amx_body.h: tdpbssd) for CPUs with AMX-INT8. Exports only the kernel's address (the
// detection and Linux's permission live in cpu.cpp); null where the compiler lacks the AMX
// intrinsics (as int8_amx.cpp). Linkage: as lut4_linear_avx2.cpp.
#include "common.h"
#include "lut4_linear.h"

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma")
#include <immintrin.h>

#include "amx_tiles.h"
#include "lut4_q8_amx_body.h"

namespace tq {
namespace {

struct AmxTiles : AmxTileOps<8> {
  // C += A . B: signed activation codes x signed table values
  template <int C, int A, int B>
  static void dot() { asm volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C)); }
};

// 16 fp32 lanes in one zmm.
struct V512 {
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static F cvt(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_load_si512(p)); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
};

}  // namespace

extern const Lut4RowsFn kLut4Q8AmxGemm = &q8_amx_gemm_on<AmxTiles, V512>;

}  // namespace tq
#else
namespace tq {
extern const Lut4RowsFn kLut4Q8AmxGemm = nullptr;
}  // namespace tq
#endif
