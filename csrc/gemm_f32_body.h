// The fp32 panel GEMM shared by the weight-only kernels' GEMM forms (lut4_linear_body.h,
// int8_linear_body.h), written once over ISA traits T (simd_avx2.h, simd_avx512.h).
//
// A format supplies only its unpacker: panel[k * NR + t] = the exact fp32 weight of row n + t at
// activation position k0 + k, for NR = 2W rows (rows past `rows` zero) and kc <= KC positions.
// Blocks of kPanels panels (kPanels * KC * NR * 4 bytes = 256 KiB: L2) are unpacked once per call;
// every MR-row tile of activations (L1) then runs over all of them as MR x NR register tiles of
// broadcast-activation FMAs (MR = T::kGemmRows). Per output: fp32 sums over each KC block in
// order, the blocks added in order, the bias added after the last: the fp32 bound of sum_k w_k x_k,
// exact for a one-hot row of x.
//
// In an anonymous namespace, with T's types in one too: each ISA unit has its own internal copy
// (see common.h).
#pragma once
#include <immintrin.h>
#include <stdlib.h>

#include "tiling.h"

namespace tq {
namespace {

// The activations and output of one panel GEMM call: out[M, N] (row stride N) from x[M, ldx]
// (the first K positions of each row, in the order the unpacker writes the panel's positions).
struct PanelGemmArgs {
  const float* x;
  int64_t ldx, M, K, N;
  const float* bias;  // [N] or null
  float* out;
};

template <class T>
struct PanelGemm {
  using F = typename T::F;
  static constexpr int W = T::kLanes;
  static constexpr int NR = 2 * W;    // weight rows per panel
  static constexpr int64_t KC = 256;  // positions per panel
  static constexpr int kPanels = 256 / NR;
  static constexpr size_t kBufferBytes = kPanels * KC * NR * sizeof(float);

  // 8x8 transpose of rows r[0..8) (8 floats each, `stride` apart) into columns:
  // out[l * out_stride + i] = rows[i * stride + l].
  static void transpose8(const float* rows, int64_t stride, float* out, int64_t out_stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + i * stride);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m256 u[8];
    for (int i = 0; i < 2; ++i) {
      u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    // u[0..4): rows 0-3, columns (0,4) (1,5) (2,6) (3,7) in 128-bit halves; u[4..8): rows 4-7
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(out + i * out_stride, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
      _mm256_storeu_ps(out + (i + 4) * out_stride, _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
    }
  }

  // out[m0..m0+MT, n..n+cols] (+)= x[m0.., k0..k0+kc] panel; the last block adds the bias.
  template <int MT>
  TQ_TILE static void tile(const PanelGemmArgs& a, const float* panel, int64_t n, int64_t cols, int64_t m0, int64_t k0, int64_t kc) {
    const int64_t N = a.N;
    F acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = T::zero();
    const float* x = a.x + m0 * a.ldx + k0;
    for (int64_t k = 0; k < kc; ++k) {
      const F w0 = T::load(panel + NR * k), w1 = T::load(panel + NR * k + W);
      for (int i = 0; i < MT; ++i) {
        const F xv = T::set1(x[i * a.ldx + k]);
        acc[i][0] = T::fmadd(xv, w0, acc[i][0]);
        acc[i][1] = T::fmadd(xv, w1, acc[i][1]);
      }
    }
    const bool first = k0 == 0, last = k0 + kc == a.K;
    if (cols == NR) {
      F b0 = T::zero(), b1 = T::zero();
      if (last && a.bias) b0 = T::loadu(a.bias + n), b1 = T::loadu(a.bias + n + W);
      for (int i = 0; i < MT; ++i) {
        float* o = a.out + (m0 + i) * N + n;
        F s0 = first ? acc[i][0] : T::add(T::loadu(o), acc[i][0]);
        F s1 = first ? acc[i][1] : T::add(T::loadu(o + W), acc[i][1]);
        if (last && a.bias) s0 = T::add(s0, b0), s1 = T::add(s1, b1);
        T::storeu(o, s0);
        T::storeu(o + W, s1);
      }
      return;
    }
    alignas(64) float row[NR];
    for (int i = 0; i < MT; ++i) {
      float* o = a.out + (m0 + i) * N + n;
      T::store(row, acc[i][0]);
      T::store(row + W, acc[i][1]);
      for (int64_t j = 0; j < cols; ++j) {
        float s = first ? row[j] : o[j] + row[j];
        if (last && a.bias) s = s + a.bias[n + j];
        o[j] = s;
      }
    }
  }

  // Output columns [n0, n1) for every activation row; unpack(n, rows, k0, kc, panel) fills one
  // panel (see above). False when the panel buffer cannot be had (the caller takes another path).
  template <class Unpack>
  static bool run(const PanelGemmArgs& a, int64_t n0, int64_t n1, Unpack&& unpack) {
    float* panels = static_cast<float*>(aligned_alloc(64, kBufferBytes));
    if (!panels) return false;
    constexpr int MR = T::kGemmRows;
    for (int64_t nb = n0; nb < n1; nb += kPanels * NR) {
      const int64_t nb1 = nb + kPanels * NR < n1 ? nb + kPanels * NR : n1;
      for (int64_t k0 = 0; k0 < a.K; k0 += KC) {
        const int64_t kc = k0 + KC <= a.K ? KC : a.K - k0;
        for (int64_t n = nb; n < nb1; n += NR) unpack(n, n + NR <= nb1 ? NR : nb1 - n, k0, kc, panels + (n - nb) / NR * KC * NR);
        tiles_then_remainder<MR>(0, a.M, [&](auto mt, int64_t m) {
          for (int64_t n = nb; n < nb1; n += NR)
            tile<decltype(mt)::value>(a, panels + (n - nb) / NR * KC * NR, n, n + NR <= nb1 ? NR : nb1 - n, m, k0, kc);
        });
      }
    }
    free(panels);
    return true;
  }
};

}  // namespace
}  // namespace tq
