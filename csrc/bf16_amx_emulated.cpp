// The bf16 AMX GEMM's body (bf16_amx_body.h) over an emulation of its tile operations in portable
// C++, for tests on every machine (tq_set_bf16_amx(BF16_AMX_EMULATED)); not for speed. Also the
// portable half of the GEMM: its mode, activation packing and entry points. Linkage: as
// int8_amx.cpp.
#include <string.h>

#include <atomic>
#include <stdlib.h>

#include "bf16_amx_body.h"
#include "amx_emulated_tiles.h"
#include "common.h"
#include "lut4_linear.h"  // lut4_paths(): the GEMM switch

namespace tq {
namespace {

struct EmulatedTiles : EmulatedTileOps<8> {
  // bf16 word i of a tile row as fp32 (exact), subnormals read as zero (as AMX reads them)
  static float word(const uint8_t* row, int i) {
    uint16_t h;
    memcpy(&h, row + 2 * i, 2);
    return bf16_value((h & 0x7F80u) == 0 ? static_cast<uint16_t>(h & 0x8000u) : h);
  }
  // a subnormal result flushed to zero (as AMX flushes them)
  static float flush(float v) { return __builtin_fabsf(v) < 0x1p-126f ? __builtin_copysignf(0.0f, v) : v; }
  // tdpbf16ps as Intel's pseudocode orders it: C[m][n] += A[m][2k] B[k][2n], then
  // += A[m][2k + 1] B[k][2n + 1], for k = 0..15 (fp32 products of bf16 values are exact), with
  // AMX's treatment of subnormals: inputs read as zero, products and sums flushed, so that the
  // callers' guards against them are tested on every machine.
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float acc;
        memcpy(&acc, &s.t[C][m][4 * n], 4);
        for (int k = 0; k < 16; ++k) {
          acc = flush(acc + flush(word(s.t[A][m], 2 * k) * word(s.t[B][k], 2 * n)));
          acc = flush(acc + flush(word(s.t[A][m], 2 * k + 1) * word(s.t[B][k], 2 * n + 1)));
        }
        memcpy(&s.t[C][m][4 * n], &acc, 4);
      }
  }
};

void gemm(const Bf16AmxGemm& g, int64_t n0, int64_t n1) { amx_bf16_gemm<EmulatedTiles>(g, n0, n1); }

// The mode (Bf16Amx), and the calls that took the GEMM (either tiles), for tests.
std::atomic<int> g_mode{[] {
  const char* s = getenv("TORCHQ_NATIVE_AMX");
  return s && strcmp(s, "0") == 0 ? BF16_AMX_OFF : BF16_AMX_ON;
}()};
std::atomic<int64_t> g_calls{0};

}  // namespace

extern const Bf16AmxGemmFn kBf16AmxEmulatedGemm = &gemm;

int bf16_amx_mode() { return g_mode.load(std::memory_order_relaxed); }

// The kernel for `mode` now, or null (one read of the mode decides both whether and which). A GEMM
// form: the GEMM switch (lut4_paths' LUT4_GEMM, TORCHQ_NATIVE_GEMM=0) turns it off with the others.
static Bf16AmxGemmFn gemm_for(int mode) {
  if (!(lut4_paths() & LUT4_GEMM)) return nullptr;
  if (mode == BF16_AMX_EMULATED) return kBf16AmxEmulatedGemm;
  return mode == BF16_AMX_ON && active_isa() == ISA_AVX512 && amx_bf16_supported() ? kBf16AmxGemm : nullptr;
}

bool bf16_amx_active() { return gemm_for(g_mode.load(std::memory_order_relaxed)) != nullptr; }

Bf16AmxGemmFn bf16_amx_gemm() { return gemm_for(g_mode.load(std::memory_order_relaxed)); }

int64_t bf16_amx_packed_bytes(int64_t M, int64_t K) {
  return (M + kBf16Tile - 1) / kBf16Tile * (K / kBf16Step) * kBf16TileWords * 2;
}

bool bf16_amx_pack(const uint16_t* x, int64_t M, int64_t K_in, int64_t K, uint16_t* dst) {
  const int64_t steps = K / kBf16Step;
  // finite, below 2^64, 0 or of magnitude >= 2^-59: magnitude bits 0 or in [68 << 7, 191 << 7)
  // (exponent fields 68 .. 190); (bits - 1) as uint16 takes 0 to the top, so one min and one max
  uint16_t least = 0xFFFFu, most = 0;
  for (int64_t i = 0; i < M * K_in; ++i) {
    const uint16_t a = static_cast<uint16_t>(x[i] & 0x7FFFu);
    const uint16_t b = static_cast<uint16_t>(a - 1u);
    least = b < least ? b : least;
    most = a > most ? a : most;
  }
  if (least < (68u << 7) - 1u || most >= (191u << 7)) return false;
  memset(dst, 0, static_cast<size_t>(bf16_amx_packed_bytes(M, K)));
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = m / kBf16Tile, r = m % kBf16Tile;
    for (int64_t k = 0; k < K_in; ++k) {
      const int64_t s = k / kBf16Step, q = (k % kBf16Step) / 2;
      dst[(i * steps + s) * kBf16TileWords + q * 32 + 2 * r + (k & 1)] = x[m * K_in + k];
    }
  }
  return true;
}

namespace {

struct Job {
  Bf16AmxGemm g;
  Bf16AmxGemmFn gemm;
};

void run_range(void* ctx, int64_t n0, int64_t n1) {
  const Job& j = *static_cast<const Job*>(ctx);
  j.gemm(j.g, n0, n1);
}

}  // namespace

int bf16_amx_linear(const uint16_t* x, int64_t M, int64_t K_in, int64_t K, int64_t N, const float* bias,
                    void (*decode)(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst), const void* ctx, void* out,
                    int threads, int spin_us) {
  const size_t xt_bytes = static_cast<size_t>(bf16_amx_packed_bytes(M, K));
  char* buf = static_cast<char*>(aligned_alloc(64, xt_bytes));
  if (!buf) return -1;
  uint16_t* xt = reinterpret_cast<uint16_t*>(buf);
  const Bf16AmxGemmFn gemm = bf16_amx_pack(x, M, K_in, K, xt) ? bf16_amx_gemm() : nullptr;
  if (!gemm) {
    free(buf);
    return -1;
  }
  int failed = 0;
  Job job{{M, N, K, xt, static_cast<uint16_t*>(out), bias, decode, ctx, &failed}, gemm};
  parallel_for(N, kBf16Tile, threads, run_range, &job, spin_us, N * K + M * N * K / 16);  // ranges of whole panels
  if (!failed) g_calls.fetch_add(1, std::memory_order_relaxed);  // else the caller's paths rewrite every output
  free(buf);
  return failed ? -1 : OK;
}

}  // namespace tq

// The bf16 AMX mode (tq::Bf16Amx; negative: read); returns the mode before, or -1 (unchanged) for
// a mode that is not one. BF16_AMX_ON where the CPU has no AMX-BF16 (or Linux refuses it) leaves
// the other paths serving every call.
TQ_API int tq_set_bf16_amx(int mode) {
  if (mode < 0) return tq::g_mode.load();
  if (mode > tq::BF16_AMX_EMULATED) return -1;
  return tq::g_mode.exchange(mode);
}
// How many calls have taken the bf16 AMX GEMM (on AMX or emulated tiles) since the library loaded.
TQ_API int64_t tq_amx_bf16_calls() { return tq::g_calls.load(); }
// Whether this process may run the AMX bf16 kernel (the CPU has AMX-BF16, Linux granted the tile state).
TQ_API int tq_amx_bf16_supported() { return tq::amx_bf16_supported() ? 1 : 0; }
