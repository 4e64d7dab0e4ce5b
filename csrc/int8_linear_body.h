// The int8 vector kernels (see int8_linear.h), written once over ISA traits and instantiated by
// int8_linear_<isa>.cpp: T the float traits (simd_avx2.h, simd_avx512.h), D the int8 x int8 dot
// product traits of the unit (the AVX2 sign trick, VNNI).
//
// A tile of 4 weight rows x up to 4 activation rows keeps its dot products in registers; the
// next tile's rows (which follow in memory) are prefetched while it computes. A row tail shorter
// than a vector runs once more on zero-padded copies of the weights (the activations are padded).
//
// In an anonymous namespace, with the traits' types in one too: each ISA unit has its own
// internal copy (see common.h, lut4_linear_avx2.cpp).
#pragma once
#include <immintrin.h>
#include <string.h>

#include "common.h"
#include "gemm_f32_body.h"
#include "int8_linear.h"
#include "stream_prefetch.h"
#include "tiling.h"

namespace tq {
namespace {

constexpr int kInt8Rows = 4;   // weight rows per tile
constexpr int kInt8MTile = 4;  // activation rows per tile

// Weight-only kernels, dequantization and activation quantization over float traits T.
template <class T>
struct Int8Kernel {
  using F = typename T::F;
  using I = typename T::I;
  static constexpr int W = T::kLanes;

  template <int NT, int MT>
  TQ_TILE static void weight_tile(const Int8Params& p, int64_t n, int64_t m0) {
    const int64_t K = p.K, kfull = K / W * W;
    F acc[NT][MT], s[NT];
    const int8_t* w[NT];
    for (int t = 0; t < NT; ++t) {
      s[t] = T::set1(p.scale[n + t]);
      w[t] = p.w + (n + t) * K;
      for (int m = 0; m < MT; ++m) acc[t][m] = T::zero();
    }
    const char* ahead = reinterpret_cast<const char*>(p.w + (n + NT) * K);
    const char* ahead_end = reinterpret_cast<const char*>(p.w + (p.w_rows < 0 ? p.N : p.w_rows) * K);
    auto step = [&](const int8_t* const* src, int64_t k, int64_t xk) {
      for (int t = 0; t < NT; ++t) {
        const F wv = T::mul(T::load_i8(src[t] + k), s[t]);
        for (int m = 0; m < MT; ++m) acc[t][m] = T::fmadd(wv, T::load(p.x + (m0 + m) * p.Kp + xk), acc[t][m]);
      }
    };
    for (int64_t k = 0; k < kfull; k += W) {
      // one line of the next tile per 16 weights of each row: NT lines per 64 weights
      if (W >= 16 || !(k & 15)) prefetch_next(ahead, ahead_end);
      ahead += W * NT;
      step(w, k, k);
    }
    if (kfull < K) {  // tail: zero-padded copies (the activations are zero padded too)
      alignas(16) int8_t tail[NT][W];
      const int8_t* src[NT];
      for (int t = 0; t < NT; ++t) {
        memset(tail[t], 0, W);
        memcpy(tail[t], w[t] + kfull, K - kfull);
        src[t] = tail[t];
      }
      step(src, 0, kfull);
    }
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float v = T::hsum(acc[t][m]);
        p.out[(m0 + m) * p.N + n + t] = p.bias ? v + p.bias[n + t] : v;
      }
  }

  static void weight_rows(const Int8Params& p, int64_t n0, int64_t n1) {
    tiles_then_singles<kInt8Rows>(n0, n1, [&](auto nt, int64_t n) {
      tiles_then_remainder<kInt8MTile>(0, p.M, [&](auto mt, int64_t m) { weight_tile<decltype(nt)::value, decltype(mt)::value>(p, n, m); });
    });
  }

  // ---- the weight-only GEMM form (M >= Int8Kernels.weight_gemm_min_m; int8_linear.h) ----
  using Gemm = PanelGemm<T>;
  static constexpr int NR = Gemm::NR;

  // panel[k * NR + t] = q * s of row n + t at position k0 + k (zero for t >= rows and k >= K):
  // 8 rows x 32 positions into `rows8`, then 8x8 transposes.
  static void unpack_weight_panel(const Int8Params& p, int64_t n, int64_t rows, int64_t k0, int64_t kc, float* panel) {
    const int64_t K = p.K;
    alignas(64) float rows8[8 * 32];
    for (int64_t t0 = 0; t0 < NR; t0 += 8) {
      __m256 s[8];
      for (int r = 0; r < 8; ++r) s[r] = _mm256_set1_ps(t0 + r < rows ? p.scale[n + t0 + r] : 0.0f);
      for (int64_t k = k0; k < k0 + kc; k += 32) {
        for (int r = 0; r < 8; ++r) {
          float* dst = rows8 + 32 * r;
          if (t0 + r >= rows) {
            for (int i = 0; i < 32; ++i) dst[i] = 0.0f;
            continue;
          }
          const int8_t* src = p.w + (n + t0 + r) * K + k;
          if (k + 32 <= K) {
            for (int i = 0; i < 4; ++i) {
              const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
              _mm256_store_ps(dst + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s[r]));
            }
          } else {  // the row's last positions: the same single rounding, zeros past K
            const float sr = p.scale[n + t0 + r];
            for (int64_t i = 0; i < 32; ++i) dst[i] = k + i < K ? static_cast<float>(src[i]) * sr : 0.0f;
          }
        }
        const int64_t left = k0 + kc - k, groups = left >= 32 ? 4 : (left + 7) / 8;  // of 8 positions
        for (int64_t i = 0; i < groups; ++i) Gemm::transpose8(rows8 + 8 * i, 32, panel + (k - k0 + 8 * i) * NR + t0, NR);
      }
    }
  }

  // Output rows [n0, n1) through the fp32 panel GEMM: each weight converted once per call.
  static void weight_gemm(const Int8Params& p, int64_t n0, int64_t n1) {
    const PanelGemmArgs a{p.x, p.Kp, p.M, p.K, p.N, p.bias, p.out};
    const bool ran = Gemm::run(a, n0, n1, [&](int64_t n, int64_t rows, int64_t k0, int64_t kc, float* panel) {
      unpack_weight_panel(p, n, rows, k0, kc, panel);
    });
    if (!ran) weight_rows(p, n0, n1);
  }

  static void dequant_rows(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
    const int64_t kfull = K / W * W;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* row = w + n * K;
      const F s = T::set1(scale[n]);
      const int64_t base = (n - n0) * K;
      for (int64_t k = 0; k < kfull; k += W) {
        const F v = T::mul(T::load_i8(row + k), s);
        if (bf16) T::store_bf16(static_cast<uint16_t*>(out) + base + k, v);
        else T::storeu(static_cast<float*>(out) + base + k, v);
      }
      for (int64_t k = kfull; k < K; ++k) {  // the same single rounding per element as the vectors
        const float v = static_cast<float>(row[k]) * scale[n];
        if (bf16) static_cast<uint16_t*>(out)[base + k] = bf16_rne(v);
        else static_cast<float*>(out)[base + k] = v;
      }
    }
  }

  static void quantize_rows(const float* x, int64_t K, int64_t Kp, const Int8Quant& q, int offset, void* codes, float* xs,
                            int64_t m0, int64_t m1) {
    const int64_t kfull = K / W * W;
    const I lo = T::set1_i32(q.qmin), hi = T::set1_i32(q.qmax), off = T::set1_i32(offset);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      F amax = T::zero();
      bool nan = false;
      for (int64_t k = 0; k < kfull; k += W) {
        const F a = T::abs(T::loadu(row + k));
        nan |= T::any_nan(a);
        amax = T::max(amax, a);
      }
      alignas(64) float lanes[W];
      T::store(lanes, amax);
      float a = 0.0f;
      for (float v : lanes) a = v > a ? v : a;
      for (int64_t k = kfull; k < K; ++k) {  // max is exact: the order of the elements does not matter
        const float v = row[k] < 0 ? -row[k] : row[k];
        nan |= v != v;
        a = v > a ? v : a;
      }
      float s = nan ? __builtin_nanf("") : a / q.denom;
      s = s < q.eps ? q.eps : s;  // a NaN scale stays NaN, as torch.clamp
      xs[m] = s;
      const F r = T::set1(1.0f / s);
      uint8_t* dst = static_cast<uint8_t*>(codes) + m * Kp;
      for (int64_t k = 0; k < Kp; k += W) {
        alignas(64) float in[W];
        const float* src = row + k;
        if (k + W > K) {  // the row's end and the padding: a zero-filled copy
          for (int j = 0; j < W; ++j) in[j] = k + j < K ? row[k + j] : 0.0f;
          src = in;
        }
        T::quantize_store(dst + k, T::loadu(src), r, lo, hi, off, offset != 0);
      }
    }
  }

  // Static activations (int8_linear.h: Int8QuantizeFn's static form): v = x * r (r the fp32
  // reciprocal of the scale, as the reference's), NaN -> 0 (flagging the row), clamped in fp32 to
  // [qmin - z, qmax - z] (integers: clamping before the rounding gives the same codes), rounded half
  // to even, + z + offset.
  static void quantize_static_rows(const float* x, int64_t K, int64_t Kp, const Int8Quant& q, int offset, void* codes,
                                   float* xs, int64_t m0, int64_t m1) {
    const F r = T::set1(1.0f / q.scale);
    const F lo = T::set1(static_cast<float>(q.qmin - q.zero)), hi = T::set1(static_cast<float>(q.qmax - q.zero));
    const I add = T::set1_i32(q.zero + offset);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      uint8_t* dst = static_cast<uint8_t*>(codes) + m * Kp;
      int nan = 0;
      for (int64_t k = 0; k < Kp; k += W) {
        alignas(64) float in[W];
        const float* src = row + k;
        if (k + W > K) {  // the row's end and the padding: a zero-filled copy
          for (int j = 0; j < W; ++j) in[j] = k + j < K ? row[k + j] : 0.0f;
          src = in;
        }
        nan |= T::quantize_static_store(dst + k, T::loadu(src), r, lo, hi, add, offset != 0);
      }
      xs[m] = nan ? __builtin_nanf("") : q.scale;
    }
  }
};

// Dynamic (int8 x int8) kernels over dot-product traits D: D::kBytes codes per step,
// D::Weights / D::RowSum what a step keeps of each weight row, D::dot accumulating exactly in
// int32, D::total the final int32 dot product.
template <class D>
struct Int8DotKernel {
  using Acc = typename D::Acc;
  static constexpr int kBytes = D::kBytes;

  template <int NT, int MT>
  TQ_TILE static void dynamic_tile(const Int8Params& p, int64_t n, int64_t m0) {
    const int64_t K = p.K, kfull = K / kBytes * kBytes;
    const uint8_t* xcodes = D::activations(p);
    Acc acc[NT][MT];
    typename D::RowSum rowsum[NT];
    const int8_t* w[NT];
    for (int t = 0; t < NT; ++t) {
      w[t] = p.w + (n + t) * K;
      rowsum[t] = D::rowsum_zero();
      for (int m = 0; m < MT; ++m) acc[t][m] = D::zero();
    }
    const char* ahead = reinterpret_cast<const char*>(p.w + (n + NT) * K);
    const char* ahead_end = reinterpret_cast<const char*>(p.w + (p.w_rows < 0 ? p.N : p.w_rows) * K);
    auto step = [&](const int8_t* const* src, int64_t k, int64_t xk) {
      typename D::Weights wv[NT];
      for (int t = 0; t < NT; ++t) wv[t] = D::load_weights(src[t] + k, rowsum[t]);
      for (int m = 0; m < MT; ++m) {
        const typename D::X xv = D::load_activations(xcodes + (m0 + m) * p.Kp + xk);
        for (int t = 0; t < NT; ++t) acc[t][m] = D::dot(acc[t][m], xv, wv[t]);
      }
    };
    for (int64_t k = 0; k < kfull; k += kBytes) {
      if (kBytes >= 64 || !(k & 63)) {  // one line of each of the next tile's rows per 64 codes
        for (int t = 0; t < NT; ++t)
          if (ahead + 64 * t < ahead_end) _mm_prefetch(ahead + 64 * t, _MM_HINT_T0);
        ahead += 64 * NT;
      }
      step(w, k, k);
    }
    if (kfull < K) {  // tail: zero weight codes (the activation codes are padded)
      alignas(kBytes) int8_t tail[NT][kBytes];
      const int8_t* src[NT];
      for (int t = 0; t < NT; ++t) {
        memset(tail[t], 0, kBytes);
        memcpy(tail[t], w[t] + kfull, K - kfull);
        src[t] = tail[t];
      }
      step(src, 0, kfull);
    }
    for (int t = 0; t < NT; ++t) {
      const int32_t correction = D::correction(rowsum[t]);
      // static activations: minus z * the row's sum, in int64 as the reference (no int32 wrap at large K)
      const int64_t zero_correction = p.row_sums ? static_cast<int64_t>(p.zero_point) * p.row_sums[n + t] : 0;
      for (int m = 0; m < MT; ++m) {
        // modulo 2^32: sum_k q w exactly (its offset's correction may wrap in between)
        const int32_t dot = static_cast<int32_t>(static_cast<uint32_t>(D::hsum(acc[t][m])) - static_cast<uint32_t>(correction));
        const int64_t total = static_cast<int64_t>(dot) - zero_correction;
        p.out[(m0 + m) * p.N + n + t] = (static_cast<float>(total) * p.xs[m0 + m]) * p.scale[n + t];
      }
    }
  }

  static void dynamic_rows(const Int8Params& p, int64_t n0, int64_t n1) {
    tiles_then_singles<kInt8Rows>(n0, n1, [&](auto nt, int64_t n) {
      tiles_then_remainder<kInt8MTile>(0, p.M, [&](auto mt, int64_t m) { dynamic_tile<decltype(nt)::value, decltype(mt)::value>(p, n, m); });
    });
  }
};

}  // namespace
}  // namespace tq
