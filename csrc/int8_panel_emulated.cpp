// The VNNI panel kernel's body (int8_panel_body.h) on emulated instructions: vpdpbusd on arrays of
// 16 int32 lanes, the outputs as the AVX-512 form computes them (the int32 sums converted to fp32
// with nearest-even rounding, times the activation scale, times the weight row's scale, each an fp32
// rounding; bf16 by bf16_rne_nan). The same bits as the VNNI kernel on any CPU:
// tq_set_int8_panel(INT8_PANEL_EMULATED) runs it (tests). Compiled for the baseline ISA.
#include <string.h>

#include "common.h"
#include "int8_panel_body.h"

namespace tq {
namespace {

struct EmulatedPanelOps {
  struct V {
    uint32_t u[16];  // int32 lanes, added modulo 2^32 as vpdpbusd adds
  };
  static V zero() { return V{}; }
  static V load(const int8_t* w) {
    V v;
    memcpy(v.u, w, 64);
    return v;
  }
  static V broadcast(int32_t x4) {
    V v;
    for (int i = 0; i < 16; ++i) v.u[i] = static_cast<uint32_t>(x4);
    return v;
  }
  // per lane: + the 4 products of the unsigned bytes of x and the signed bytes of w
  static V dpbusd(V acc, const V& x, const V& w) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 4; ++j) {
        const int32_t a = static_cast<uint8_t>(x.u[i] >> (8 * j)), b = static_cast<int8_t>(w.u[i] >> (8 * j));
        acc.u[i] += static_cast<uint32_t>(a * b);
      }
    return acc;
  }
  static void pin(V&) {}
  static void finish(const Int8Params& p, const V& acc, int64_t m, int64_t first, int64_t count) {
    int32_t d[16];
    float f[16];
    for (int64_t t = 0; t < count; ++t)  // minus 128 * the row sums, modulo 2^32 as the sums
      d[t] = static_cast<int32_t>(acc.u[t] - (static_cast<uint32_t>(p.code_sums[first + t]) << 7));
    if (!p.row_sums) {
      for (int64_t t = 0; t < count; ++t) f[t] = (static_cast<float>(d[t]) * p.xs[m]) * p.scale[first + t];
    } else {
      int8_panel_static_outputs(p, d, m, first, count, f);
    }
    for (int64_t t = 0; t < count; ++t) {
      if (p.out_bf16) p.out_bf16[m * p.N + first + t] = bf16_rne_nan(f[t]);
      else p.out[m * p.N + first + t] = f[t];
    }
  }
};

void panel_rows(const Int8Params& p, int64_t n0, int64_t n1) { int8_panel_rows<EmulatedPanelOps>(p, n0, n1); }

}  // namespace

extern const Int8RowsFn kInt8EmulatedPanelRows = &panel_rows;

}  // namespace tq
