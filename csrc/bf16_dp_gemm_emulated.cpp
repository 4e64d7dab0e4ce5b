// The bf16 dot-product GEMM's body (bf16_dp_gemm_body.h), decoded form, over dot_bf16_emulated.h's
// arrays: the same bits as the AVX512_BF16 kernel on any CPU (tq_set_bf16_dp_gemm(BF16_DP_EMULATED),
// tests); not for speed (the int8 form's emulation: int8_dot_emulated.cpp). Also the GEMM's portable
// half: its mode, selection, entry and call count. Compiled for the baseline ISA.
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "bf16_amx.h"  // bf16_amx_pack's activation guard, kept the same for both GEMMs
#include "bf16_dp_gemm_body.h"
#include "common.h"
#include "dot_bf16_emulated.h"
#include "kernels.h"
#include "lut4_linear.h"  // lut4_paths(): the GEMM switch

namespace tq {
namespace {

void gemm(const Bf16DpGemm& g, int64_t n0, int64_t n1) { Bf16DpBody<EmulatedDotOps, false>::gemm(g, n0, n1); }

// TORCHQ_NATIVE_BF16_DP=0 at load: off, =all: every row count (A/B runs of a whole process, e.g. a served model).
std::atomic<int> g_mode{[] {
  const char* s = getenv("TORCHQ_NATIVE_BF16_DP");
  return s && strcmp(s, "0") == 0 ? BF16_DP_OFF : s && strcmp(s, "all") == 0 ? BF16_DP_ALL : BF16_DP_ON;
}()};
std::atomic<int64_t> g_calls{0};

Bf16DpGemmFn for_mode(int mode, bool int8) {
  if (!(lut4_paths() & LUT4_GEMM)) return nullptr;
  if (mode == BF16_DP_EMULATED) return int8 ? kBf16DpEmulatedInt8Gemm : kBf16DpEmulatedGemm;
  return mode == BF16_DP_ON || mode == BF16_DP_ALL ? (int8 ? kernels().bf16_dp_int8_gemm : kernels().bf16_dp_gemm) : nullptr;
}

// The most rows of `mode` where it has a kernel (bf16_dp_gemm.h).
int64_t max_m(int mode) { return mode == BF16_DP_ON && amx_bf16_supported() ? kBf16DpAmxCpuMaxM : kBf16DpMaxM; }

struct Job {
  Bf16DpGemm g;
  Bf16DpGemmFn gemm;
};

void run_range(void* ctx, int64_t n0, int64_t n1) {
  const Job& j = *static_cast<const Job*>(ctx);
  j.gemm(j.g, n0, n1);
}

}  // namespace

extern const Bf16DpGemmFn kBf16DpEmulatedGemm = &gemm;

Bf16DpGemmFn bf16_dp_gemm(int64_t M, int64_t min_m, bool int8) {
  const int mode = g_mode.load(std::memory_order_relaxed);
  if (M < min_m || M > max_m(mode)) return nullptr;
  return for_mode(mode, int8);
}

int64_t bf16_dp_max_m() {
  const int mode = g_mode.load(std::memory_order_relaxed);
  return for_mode(mode, false) ? max_m(mode) : 0;
}

int bf16_dp_linear(Bf16DpGemmFn gemm, Bf16DpGemm g, const uint16_t* x, int64_t M, int64_t K_in, void* out, int threads, int spin_us) {
  if (!gemm) return -1;
  const int64_t K = g.K;
  uint16_t* xp = static_cast<uint16_t*>(aligned_alloc(64, static_cast<size_t>(bf16_amx_packed_bytes(M, K))));
  if (!xp) return -1;
  if (!bf16_amx_pack(x, M, K_in, K, xp)) {  // B tiles of 16 rows, rows past M zero (or an activation it cannot take)
    free(xp);
    return -1;
  }
  int failed = 0;
  g.M = M;
  g.x = xp;
  g.out = static_cast<uint16_t*>(out);
  g.failed = &failed;
  Job job{g, gemm};
  parallel_for(g.N, 16, threads, run_range, &job, spin_us, g.N * K + M * g.N * K / 16);  // ranges of whole panels
  if (!failed) g_calls.fetch_add(1, std::memory_order_relaxed);  // else the caller's paths rewrite every output
  free(xp);
  return failed ? -1 : OK;
}

}  // namespace tq

// The bf16 dot-product GEMM's mode (tq::Bf16Dp; negative: read); returns the mode before, or -1
// (unchanged) for a mode that is not one. BF16_DP_ON where the CPU lacks AVX512_BF16 (or the ISA is
// capped below AVX-512) leaves the other paths serving every call.
TQ_API int tq_set_bf16_dp_gemm(int mode) {
  if (mode < 0) return tq::g_mode.load();
  if (mode > tq::BF16_DP_ALL) return -1;
  return tq::g_mode.exchange(mode);
}
// How many calls have taken the bf16 dot-product GEMM (either kernel) since the library loaded.
TQ_API int64_t tq_bf16_dp_gemm_calls() { return tq::g_calls.load(); }
