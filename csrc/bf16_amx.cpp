// The bf16 weight-only GEMM on AMX tiles (tdpbf16ps; bf16_amx_body.h) for CPUs with AMX-BF16
// (Sapphire Rapids and later). As int8_amx.cpp: compiled with AMX and AVX-512 flags, so it exports
// only data (the kernel's address); the detection and Linux's permission live in cpu.cpp.
#include "bf16_amx.h"

#include "common.h"

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16_amx_body.h"

namespace tq {
namespace {

// Tiles 0..7 (C 0..3, weights 4 and 6, activations 5 and 7).
struct AmxTiles : AmxTileOps<8> {
  template <int C, int A, int B>
  static void dot() { asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C)); }
};

void gemm(const Bf16AmxGemm& g, int64_t n0, int64_t n1) { amx_bf16_gemm<AmxTiles>(g, n0, n1); }

}  // namespace

extern const Bf16AmxGemmFn kBf16AmxGemm = &gemm;

}  // namespace tq
#else
namespace tq {
extern const Bf16AmxGemmFn kBf16AmxGemm = nullptr;
}  // namespace tq
#endif
