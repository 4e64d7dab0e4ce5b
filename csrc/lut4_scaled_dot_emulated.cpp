// The lut4 scaled dot path on emulated instructions (lut4_scaled_dot_body.h over
// dot_bf16_emulated.h, plus the codebook lookup of lut4_linear_avx512bf16.cpp's Lut4ScaledDotOps on
// arrays). The same bits as the AVX512_BF16 kernel, on any CPU: tq_set_lut4_scaled_dot(
// LUT4_SCALED_DOT_EMULATED) runs it (tests), with the active ISA's table path for the weight rows
// that fall back. Compiled for the baseline ISA.
#include <initializer_list>

#include "dot_bf16_emulated.h"
#include "kernels.h"
#include "lut4_scaled_dot_body.h"

namespace tq {
namespace {

struct Lut4EmulatedDotOps : EmulatedDotOps {
  static constexpr bool kConstantBlocks = false;  // Lut4ScaledDot::tile
  struct Tab {
    uint16_t h[16];
  };

  static Tab table(const float* codebook) {
    Tab t;
    for (int c = 0; c < 16; ++c) t.h[c] = bf16_word(codebook[c]);
    return t;
  }

  static void weights(const Tab& tab, const uint8_t* w, int bytes, B (&q)[4]) {
    for (int j = 0; j < 32; ++j) {
      const unsigned word = (2 * j < bytes ? w[2 * j] : 0u) | (2 * j + 1 < bytes ? w[2 * j + 1] : 0u) << 8;
      for (int i = 0; i < 4; ++i) q[i].h[j] = tab.h[(word >> (4 * i)) & 15];
    }
  }

  // weights() of bytes <= 32 on lanes 0-7 (words 0-15), words 16-31 zero, as the kernel's 256-bit
  // vpermw; and dp() on lanes 0-7, lanes 8-15 of the result +0.
  static void weights_low(const Tab& tab, const uint8_t* w, int bytes, B (&q)[4]) {
    weights(tab, w, bytes < 32 ? bytes : 32, q);
    for (int i = 0; i < 4; ++i)
      for (int j = 16; j < 32; ++j) q[i].h[j] = 0;
  }
  static V dp_low(const V& acc, const B& a, const B& b) {
    V r{};
    for (int i = 0; i < 8; ++i) {
      r.f[i] = acc.f[i] + f32(a.h[2 * i + 1]) * f32(b.h[2 * i + 1]);
      r.f[i] = r.f[i] + f32(a.h[2 * i]) * f32(b.h[2 * i]);
    }
    return r;
  }

  // Whether each of v[0..count) and w[0..count) (w may be null) lets its weight row take the path:
  // 0, or normal and at most 2^100 (so that no weight c s is subnormal or overflows where the
  // reference's would not; inf / NaN scales would give NaN where the reference's weights give inf).
  static bool values_ok(const float* v, const float* w, int64_t count) {
    for (const float* a : {v, w})
      for (int64_t i = 0; a && i < count; ++i) {
        uint32_t u;
        memcpy(&u, a + i, sizeof u);
        const uint32_t m = u & 0x7FFFFFFFu;
        if (m != 0u && (m < 0x00800000u || m > 0x71800000u)) return false;
      }
    return true;
  }

  static V spread(const float* v, int per, int count) {
    V r;
    for (int l = 0; l < 16; ++l) r.f[l] = l / per < count ? v[l / per] : 0.0f;
    return r;
  }
};

void scaled_dot_rows(const Lut4Params& p, int64_t n0, int64_t n1) {
  Lut4ScaledDot<Lut4EmulatedDotOps>::rows(p, n0, n1, kernels().lut4.rows);
}

}  // namespace

extern const Lut4RowsFn kLut4EmulatedScaledDot = &scaled_dot_rows;
extern const Lut4ValuesOkFn kLut4EmulatedScaledDotValuesOk = &Lut4EmulatedDotOps::values_ok;

}  // namespace tq
