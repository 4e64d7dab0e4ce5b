// The lut4 bf16 dot path on emulated instructions (lut4_dot_body.h over dot_bf16_emulated.h, plus
// lut4_linear_avx512bf16.cpp's Lut4DotOps on arrays: vcvtne2ps2bf16's rounding, the zeros' second
// rounding, vpermw's lookups). The same bits as the AVX512_BF16 kernel, on any CPU:
// tq_set_lut4_dot(LUT4_DOT_EMULATED) runs it (tests), with the active ISA's table path for the weight
// rows that fall back. Compiled for the baseline ISA.
#include <math.h>
#include <string.h>

#include "dot_bf16_emulated.h"
#include "kernels.h"
#include "lut4_dot_body.h"

namespace tq {
namespace {

struct Lut4DotEmulatedOps : EmulatedDotOps {
  struct Tab {
    uint16_t h[32];
  };

  // vcvtne2ps2bf16 on one value: NaN quieted, subnormals read as (signed) zero, else nearest even.
  static uint16_t cvtne(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }

  static uint16_t entry(const Lut4Params& p, int64_t i, int c) {
    float a = p.codebook[c];
    if (p.shifts) a = a + p.shifts[i];
    uint16_t h = cvtne(a * p.absmax[i]);
    if (p.zeros) h = cvtne(f32(h) + p.zeros[i]);
    return h;
  }

  static Tab table(const Lut4Params& p, int64_t i, int64_t j) {
    Tab t;
    for (int c = 0; c < 16; ++c) {
      t.h[c] = entry(p, i, c);
      t.h[16 + c] = j >= 0 ? entry(p, j, c) : p.zeros ? cvtne(0.0f + 0.0f) : 0;
    }
    return t;
  }

  static void weights(const Tab& tab, const uint8_t* w, int bytes, B& lo, B& hi) {
    for (int j = 0; j < 32; ++j) {
      const uint8_t v = j < bytes ? w[j] : 0;
      const int half = j >= 16 ? 16 : 0;
      lo.h[j] = tab.h[(v & 15) | half];
      hi.h[j] = tab.h[(v >> 4) | half];
    }
  }
};

void dot_rows(const Lut4Params& p, int64_t n0, int64_t n1) { Lut4DotBody<Lut4DotEmulatedOps>::rows(p, n0, n1, kernels().lut4.rows); }

}  // namespace

extern const Lut4RowsFn kLut4EmulatedDot = &dot_rows;

}  // namespace tq
