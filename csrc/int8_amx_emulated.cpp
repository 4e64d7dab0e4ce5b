// The AMX int8 GEMM's body (int8_amx_body.h) over an emulation of its tile operations in portable
// C++: the same packing, tiling and output as on AMX, for tests on every machine
// (tq_set_int8_amx(INT8_AMX_EMULATED)). Not for speed. Linkage: as int8_amx.cpp.
#include "amx_emulated_tiles.h"
#include "common.h"
#include "int8_amx_body.h"

namespace tq {
namespace {

struct EmulatedTiles : EmulatedTileOps<6> {
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
          for (int j = 0; j < 4; ++j)
            sum += static_cast<uint32_t>(static_cast<int8_t>(s.t[A][m][4 * q + j]) * static_cast<int8_t>(s.t[B][q][4 * n + j]));
        acc = static_cast<int32_t>(sum);
        memcpy(&s.t[C][m][4 * n], &acc, 4);
      }
  }
};

void gemm(const Int8Params& p, int64_t n0, int64_t n1) { amx_int8_gemm<EmulatedTiles>(p, n0, n1, kInt8Scalar.dynamic_rows); }
void panel_gemm(const Int8Params& p, int64_t n0, int64_t n1) { amx_int8_gemm<EmulatedTiles, true>(p, n0, n1, nullptr); }

}  // namespace

extern const Int8RowsFn kInt8AmxEmulatedGemm = &gemm;
extern const Int8RowsFn kInt8AmxEmulatedPanelGemm = &panel_gemm;

}  // namespace tq
