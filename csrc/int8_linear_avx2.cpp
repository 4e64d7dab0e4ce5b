// The int8 kernels (int8_linear_body.h) for AVX2 + FMA, with the AVX2 int8 dot product: |w|
// (unsigned) times sign(w) * x (signed) with vpmaddubsw; with |x| <= 127 and |w| <= 128 a pair
// sums to at most 32512, so the int16 step never saturates. Activation codes within [-64, 63]
// (7-bit ranges) take the narrow kernels instead: codes + 64 (unsigned, <= 127) times the signed
// weights straight into vpmaddubsw (pairs <= 2 * 127 * 128 = 32512), minus 64 * the weight row's
// sum: three instructions per 32 products instead of four. These dynamic kernels also serve
// AVX-512 CPUs without VNNI (see int8_linear.h). Linkage: as lut4_linear_avx2.cpp (everything
// internal but kInt8Avx2).
#pragma GCC target("avx2,fma")
#include <stdlib.h>
#include <string.h>

#include "simd_avx2.h"
#include "int8_linear_body.h"

namespace tq {
namespace {

struct Avx2SignDot {
  using Acc = __m256i;
  using X = __m256i;  // 32 activation codes
  struct Weights {
    __m256i w, abs_w;
  };
  struct RowSum {};  // nothing to correct
  static constexpr int kBytes = 32;

  static Acc zero() { return _mm256_setzero_si256(); }
  static RowSum rowsum_zero() { return {}; }
  static const uint8_t* activations(const Int8Params& p) { return reinterpret_cast<const uint8_t*>(p.xq); }
  static X load_activations(const uint8_t* x) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x)); }
  static Weights load_weights(const int8_t* w, RowSum&) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return {v, _mm256_abs_epi8(v)};
  }
  static Acc dot(Acc acc, X x, const Weights& w) {
    const __m256i pairs = _mm256_maddubs_epi16(w.abs_w, _mm256_sign_epi8(x, w.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static int32_t hsum(Acc v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
  static int32_t correction(const RowSum&) { return 0; }
};

// Narrow activations (int8_linear.h: Int8Kernels.narrow_rows): codes + 64 against the signed
// weights, the weight rows' sums kept alongside for the correction.
struct Avx2NarrowDot {
  using Acc = __m256i;
  using X = __m256i;  // 32 activation codes + 64
  using Weights = __m256i;
  using RowSum = __m256i;
  static constexpr int kBytes = 32;

  static Acc zero() { return _mm256_setzero_si256(); }
  static RowSum rowsum_zero() { return _mm256_setzero_si256(); }
  static const uint8_t* activations(const Int8Params& p) { return p.xu; }
  static X load_activations(const uint8_t* x) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(x)); }
  static Weights load_weights(const int8_t* w, RowSum& rowsum) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    rowsum = _mm256_add_epi32(rowsum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1)));
    return v;
  }
  static Acc dot(Acc acc, X x, Weights w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
  }
  static int32_t hsum(Acc v) { return Avx2SignDot::hsum(v); }
  static int32_t correction(RowSum rowsum) { return kNarrowOffset * hsum(rowsum); }
};

// ---- the dynamic GEMM forms (int8_linear.h: Int8Kernels.dynamic_gemm, narrow_gemm) ---------

constexpr int kPanelCols = 16;  // weight rows per panel: two vectors of 8 int32 lanes
// Activation rows per register tile: 8 accumulators, each step's two |w| vectors and a broadcast
// (at 2 rows the loop was bound by instruction issue: 34 instructions per 128 multiply-adds).
constexpr int kGemmRows = 4;

// Weight rows [n, n + rows) (rows <= 16, the others zero) for Kp positions: per step s of 4
// positions, 128 bytes: the 16 rows' 4 codes (64 bytes: row t at 4 t), then their absolute values
// (NARROW: 64 bytes, the codes only, and each row's sum of codes into rowsum[16]). Positions from
// K on are zero (a row's last partial 32 are copied, never read past the row).
template <bool NARROW>
void unpack_dynamic_panel(const Int8Params& p, int64_t n, int64_t rows, int8_t* panel, int32_t* rowsum) {
  constexpr int64_t kStep = NARROW ? 64 : 128;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // rows 0-7, 8-15
  const int64_t K = p.K, full = K / 32 * 32;
  for (int64_t t0 = 0; t0 < kPanelCols; t0 += 8) {
    for (int64_t k = 0; k < p.Kp; k += 32) {
      __m256i v[8];
      for (int r = 0; r < 8; ++r) {
        v[r] = _mm256_setzero_si256();
        if (t0 + r >= rows || k >= K) continue;
        const int8_t* src = p.w + (n + t0 + r) * K + k;
        if (k < full) {
          v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        } else {
          alignas(32) int8_t tail[32] = {};
          memcpy(tail, src, K - k);
          v[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
        }
      }
      transpose8_epi32(v);
      int8_t* dst = panel + (k / 4) * kStep + t0 * 4;
      for (int s = 0; s < 8; ++s) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + s * kStep), v[s]);
        if constexpr (NARROW)  // lane r: row t0 + r's 4 codes, summed exactly
          sums[t0 / 8] = _mm256_add_epi32(sums[t0 / 8], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v[s]), ones16));
        else
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst + s * kStep + 64), _mm256_abs_epi8(v[s]));
      }
    }
  }
  if constexpr (NARROW) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rowsum), sums[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rowsum + 8), sums[1]);
  }
}

// out[m0 .. m0 + R, n .. n + cols) (R <= 4) = (float(sum_k x q) * xs[m]) * scale[n]: per step, 4 broadcast
// activation codes against 16 rows' 4 codes with the sign trick (|w| x sign(x, w): pairs <= 2 *
// 128 * 127, no saturation), vpmaddwd to int32, summed exactly.
template <int R>
__attribute__((noinline)) void dynamic_gemm_tile(const Int8Params& p, const int8_t* panel, int64_t n, int64_t cols, int64_t m0) {
  const __m256i ones = _mm256_set1_epi16(1);
  // Named accumulators (row r, panel half v): GCC kept an array of them on the stack.
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  const int8_t* x = p.xq + m0 * p.Kp;
  const int64_t steps = p.Kp / 4, stride = p.Kp;
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* pw = panel + s * 128;
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 32));
    const __m256i a0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 64));
    const __m256i a1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 96));
    // One row: updated in place (the empty asm keeps GCC from computing every product of the
    // step first and rotating the accumulators through copies).
    auto row = [&](int r, __m256i& v0, __m256i& v1) __attribute__((always_inline)) {
      int32_t x4;
      memcpy(&x4, x + r * stride + 4 * s, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      v0 = _mm256_add_epi32(v0, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
      v1 = _mm256_add_epi32(v1, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
      asm("" : "+x"(v0), "+x"(v1));
    };
    row(0, c00, c01);
    if constexpr (R > 1) row(1, c10, c11);
    if constexpr (R > 2) row(2, c20, c21);
    if constexpr (R > 3) row(3, c30, c31);
  }
  const __m256i acc[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
  const __m256 s0 = _mm256_loadu_ps(p.scale + n), s1 = cols > 8 ? _mm256_loadu_ps(p.scale + n + 8) : s0;
  alignas(32) float row[kPanelCols];
  for (int r = 0; r < R; ++r) {
    const __m256 xs = _mm256_set1_ps(p.xs[m0 + r]);
    const __m256 o0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), xs), s0);
    const __m256 o1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), xs), s1);
    float* out = p.out + (m0 + r) * p.N + n;
    if (cols == kPanelCols) {
      _mm256_storeu_ps(out, o0);
      _mm256_storeu_ps(out + 8, o1);
    } else {
      _mm256_store_ps(row, o0);
      _mm256_store_ps(row + 8, o1);
      for (int64_t t = 0; t < cols; ++t) out[t] = row[t];
    }
  }
}

// The narrow form of the tile: out = (float(sum_k (x + 64) q - 64 rowsum) * xs[m]) * scale[n],
// per step 4 broadcast codes + 64 (unsigned) straight against the 16 rows' signed codes.
template <int R>
__attribute__((noinline)) void narrow_gemm_tile(const Int8Params& p, const int8_t* panel, const int32_t* rowsum, int64_t n, int64_t cols,
                                                int64_t m0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  const uint8_t* x = p.xu + m0 * p.Kp;
  const int64_t steps = p.Kp / 4, stride = p.Kp;
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* pw = panel + s * 64;
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 32));
    auto row = [&](int r, __m256i& v0, __m256i& v1) __attribute__((always_inline)) {
      int32_t x4;
      memcpy(&x4, x + r * stride + 4 * s, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      v0 = _mm256_add_epi32(v0, _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones));
      v1 = _mm256_add_epi32(v1, _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones));
      asm("" : "+x"(v0), "+x"(v1));
    };
    row(0, c00, c01);
    if constexpr (R > 1) row(1, c10, c11);
    if constexpr (R > 2) row(2, c20, c21);
    if constexpr (R > 3) row(3, c30, c31);
  }
  const __m256i acc[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
  const __m256i off = _mm256_set1_epi32(kNarrowOffset);
  const __m256i corr0 = _mm256_mullo_epi32(off, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowsum)));
  const __m256i corr1 = _mm256_mullo_epi32(off, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowsum + 8)));
  const __m256 s0 = _mm256_loadu_ps(p.scale + n), s1 = cols > 8 ? _mm256_loadu_ps(p.scale + n + 8) : s0;
  alignas(32) float row[kPanelCols];
  for (int r = 0; r < R; ++r) {
    const __m256 xs = _mm256_set1_ps(p.xs[m0 + r]);
    const __m256 o0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], corr0)), xs), s0);
    const __m256 o1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], corr1)), xs), s1);
    float* out = p.out + (m0 + r) * p.N + n;
    if (cols == kPanelCols) {
      _mm256_storeu_ps(out, o0);
      _mm256_storeu_ps(out + 8, o1);
    } else {
      _mm256_store_ps(row, o0);
      _mm256_store_ps(row + 8, o1);
      for (int64_t t = 0; t < cols; ++t) out[t] = row[t];
    }
  }
}

// A dynamic GEMM over output rows [n0, n1): a panel per 16 weight rows, unpacked once, then
// every kGemmRows activation rows over it. Falls back to the row kernel if the panel cannot be had.
template <bool NARROW>
void dynamic_gemm(const Int8Params& p, int64_t n0, int64_t n1) {
  int8_t* panel = static_cast<int8_t*>(aligned_alloc(64, (p.Kp / 4) * (NARROW ? 64 : 128)));
  if (!panel) {
    if (NARROW) Int8DotKernel<Avx2NarrowDot>::dynamic_rows(p, n0, n1);
    else Int8DotKernel<Avx2SignDot>::dynamic_rows(p, n0, n1);
    return;
  }
  alignas(32) int32_t rowsum[kPanelCols];
  for (int64_t n = n0; n < n1; n += kPanelCols) {
    const int64_t cols = n1 - n < kPanelCols ? n1 - n : kPanelCols;
    unpack_dynamic_panel<NARROW>(p, n, cols, panel, rowsum);
    tiles_then_remainder<kGemmRows>(0, p.M, [&](auto mt, int64_t m) {
      if constexpr (NARROW) narrow_gemm_tile<decltype(mt)::value>(p, panel, rowsum, n, cols, m);
      else dynamic_gemm_tile<decltype(mt)::value>(p, panel, n, cols, m);
    });
  }
  free(panel);
}

}  // namespace

extern const Int8Kernels kInt8Avx2 = {&Int8Kernel<Avx2>::weight_rows, &Int8DotKernel<Avx2SignDot>::dynamic_rows, 0,
                                      &Int8Kernel<Avx2>::quantize_rows, &Int8Kernel<Avx2>::dequant_rows, &dynamic_gemm<false>,
                                      &Int8Kernel<Avx2>::weight_gemm, kInt8WeightGemmMinMAvx2,
                                      &Int8DotKernel<Avx2NarrowDot>::dynamic_rows,
                                      &dynamic_gemm<true>};

}  // namespace tq
