// The int8 weight-only bf16 dot path on emulated instructions (int8_dot_body.h): vdpbf16ps, the
// code conversion and the shuffle tree of int8_linear_avx512bf16.cpp done on arrays, in the order
// the instructions define (Intel's VDPBF16PS: per lane, the odd pair's product added first, then the
// even pair's, each an fp32 rounding; the dot path's inputs never make a product or a sum
// subnormal, so its DAZ / FTZ never acts). The same bits as the AVX512_BF16 kernel, on any CPU:
// tq_set_int8_dot(INT8_DOT_EMULATED) runs it (tests), with the active ISA's fp32 row kernel for
// the weight rows that fall back. Compiled for the baseline ISA.
#include <string.h>

#include "int8_dot_body.h"
#include "kernels.h"

namespace tq {
namespace {

struct EmulatedDotOps {
  struct V {
    float f[16];
  };
  struct B {
    uint16_t h[32];
  };

  static V zero() { return V{}; }

  static float f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }

  static uint16_t bf16_of_code(int8_t q) {  // exact: |q| <= 128 has at most 8 significant bits
    const float f = static_cast<float>(q);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return static_cast<uint16_t>(u >> 16);
  }

  static B codes(const int8_t* w) {
    B b;
    for (int j = 0; j < 32; ++j) b.h[j] = bf16_of_code(w[j]);
    return b;
  }

  static B codes_tail(const int8_t* w, int64_t count) {
    B b{};
    for (int64_t j = 0; j < count; ++j) b.h[j] = bf16_of_code(w[j]);
    return b;
  }

  static B x32(const uint16_t* p) {
    B b;
    memcpy(b.h, p, sizeof b.h);
    return b;
  }

  static V dp(V acc, const B& a, const B& b) {
    for (int i = 0; i < 16; ++i) {
      acc.f[i] = acc.f[i] + f32(a.h[2 * i + 1]) * f32(b.h[2 * i + 1]);
      acc.f[i] = acc.f[i] + f32(a.h[2 * i]) * f32(b.h[2 * i]);
    }
    return acc;
  }

  static void keep(B&) {}

  // _mm512_shuffle_f32x4 and _mm512_shuffle_ps on arrays.
  static V shuffle_quarters(const V& a, const V& b, int imm) {
    V r;
    for (int q = 0; q < 4; ++q) {
      const V& s = q < 2 ? a : b;
      const int from = (imm >> (2 * q)) & 3;
      for (int i = 0; i < 4; ++i) r.f[4 * q + i] = s.f[4 * from + i];
    }
    return r;
  }
  static V shuffle_within(const V& a, const V& b, int imm) {
    V r;
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i) r.f[4 * q + i] = (i < 2 ? a : b).f[4 * q + ((imm >> (2 * i)) & 3)];
    return r;
  }
  static V add(const V& a, const V& b) {
    V r;
    for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] + b.f[i];
    return r;
  }

  static void sum16(const V (&v)[16], float* out) {  // the tree of Avx512Bf16DotOps::sum16
    V c[8], e[4], g[2];
    for (int i = 0; i < 8; ++i) c[i] = add(shuffle_quarters(v[2 * i], v[2 * i + 1], 0x44), shuffle_quarters(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; ++j) e[j] = add(shuffle_quarters(c[2 * j], c[2 * j + 1], 0x88), shuffle_quarters(c[2 * j], c[2 * j + 1], 0xDD));
    for (int l = 0; l < 2; ++l) g[l] = add(shuffle_within(e[2 * l], e[2 * l + 1], 0x44), shuffle_within(e[2 * l], e[2 * l + 1], 0xEE));
    const V r = add(shuffle_within(g[0], g[1], 0x88), shuffle_within(g[0], g[1], 0xDD));
    memcpy(out, r.f, sizeof r.f);
  }
};

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) { Int8Dot<EmulatedDotOps>::rows(p, n0, n1, kernels().int8.weight_rows); }

}  // namespace

extern const Int8RowsFn kInt8EmulatedDot = &dot_rows;

}  // namespace tq
