// The AMX int8 GEMM's body (int8_amx_body.h) over an emulation of its tile operations in portable
// C++: the same packing, tiling and output as on AMX, for tests on every machine
// (tq_set_int8_amx(INT8_AMX_EMULATED)). Not for speed. Linkage: as int8_amx.cpp.
#include "common.h"
#include "int8_amx_body.h"

namespace tq {
namespace {

// Six tiles of 16 rows x 64 bytes, per thread (as the AMX tile registers are).
struct EmulatedTiles {
  struct State {
    alignas(64) int8_t t[6][16][64];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure() {}
  template <int T>
  static void zero() { memset(state().t[T], 0, sizeof state().t[T]); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(state().t[T][r], static_cast<const char*>(p) + r * stride, 64);
  }
  // tdpbssd: C[m][n] += sum_{q < 16} sum_{j < 4} A[m][4q + j] * B[q][4n + j] (signed bytes, int32 sums)
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t acc;
        memcpy(&acc, &s.t[C][m][4 * n], 4);
        uint32_t sum = static_cast<uint32_t>(acc);
        for (int q = 0; q < 16; ++q)
          for (int j = 0; j < 4; ++j) sum += static_cast<uint32_t>(s.t[A][m][4 * q + j] * s.t[B][q][4 * n + j]);
        acc = static_cast<int32_t>(sum);
        memcpy(&s.t[C][m][4 * n], &acc, 4);
      }
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(static_cast<char*>(p) + r * stride, state().t[T][r], 64);
  }
  static void release() {}
};

void gemm(const Int8Params& p, int64_t n0, int64_t n1) { amx_int8_gemm<EmulatedTiles>(p, n0, n1, kInt8Scalar.dynamic_rows); }

}  // namespace

extern const Int8RowsFn kInt8AmxEmulatedGemm = &gemm;

}  // namespace tq
