// The int8-activation AMX GEMM form's body (lut4_q8_amx_body.h) over an emulation of its tile
// operations and of its 16-lane fp32 epilogue in portable C++ (fmaf: fused, as vfmadd): the same
// tiling, padding and output as on AMX, for tests on every machine with AVX2 (the panels come from
// lut4_q8_gemm_panels' AVX2 unpacking). Not for speed. Linkage: as int8_amx.cpp.
#include "amx_emulated_tiles.h"
#include "common.h"
#include "lut4_q8_amx_body.h"

namespace tq {
namespace {

struct EmulatedTiles : EmulatedTileOps<8> {
  // tdpbssd: C[m][n] += sum_{q < A.colsb / 4} sum_{i < 4} A[m][4q + i] * B[q][4n + i], signed
  // bytes, int32 sums (modulo 2^32, as AMX)
  // A configuration AMX would refuse to multiply (#UD there) traps here too, so that tests on
  // emulated tiles catch it: C.rows == A.rows, B.rows == A.colsb / 4, C.colsb == B.colsb.
  template <int C, int A, int B>
  static void dot() {
    State& s = state();
    const int rows = s.shape[C].rows, cols = s.shape[C].colsb / 4, quads = s.shape[A].colsb / 4;
    if (rows != s.shape[A].rows || s.shape[B].rows != quads || s.shape[C].colsb != s.shape[B].colsb) __builtin_trap();
    for (int m = 0; m < rows; ++m)
      for (int n = 0; n < cols; ++n) {
        int32_t acc;
        memcpy(&acc, &s.t[C][m][4 * n], 4);
        uint32_t sum = static_cast<uint32_t>(acc);
        for (int q = 0; q < quads; ++q)
          for (int i = 0; i < 4; ++i) {
            const int32_t a = static_cast<int8_t>(s.t[A][m][4 * q + i]);
            const int32_t b = static_cast<int8_t>(s.t[B][q][4 * n + i]);
            sum += static_cast<uint32_t>(a * b);
          }
        acc = static_cast<int32_t>(sum);
        memcpy(&s.t[C][m][4 * n], &acc, 4);
      }
  }
};

// 16 fp32 lanes as an array, each operation lane by lane with one rounding (fmaf fused).
struct V16 {
  struct F {
    float v[16];
  };
  static F zero() { return F{}; }
  static F load(const float* p) {
    F r;
    memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static F cvt(const int32_t* p) {
    F r;
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static F set1(float x) {
    F r;
    for (int i = 0; i < 16; ++i) r.v[i] = x;
    return r;
  }
  static F mul(const F& a, const F& b) {
    F r;
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static F fma(const F& a, const F& b, const F& c) {
    F r;
    for (int i = 0; i < 16; ++i) r.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  static void store(float* p, const F& v) { memcpy(p, v.v, sizeof v.v); }
};

}  // namespace

extern const Lut4RowsFn kLut4Q8AmxEmulatedGemm = &q8_amx_gemm_on<EmulatedTiles, V16>;

}  // namespace tq
