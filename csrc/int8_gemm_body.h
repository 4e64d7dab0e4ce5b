// The int8 dynamic kernels' GEMM forms (int8_linear.h: Int8Kernels.dynamic_gemm, narrow_gemm),
// written once over a dot-product policy D and instantiated by int8_linear_avx2.cpp (the sign
// trick; narrow activations) and int8_linear_avx512.cpp (VNNI). 256-bit registers throughout:
// on the AMD cores that have AVX-512 a 512-bit operation issues as two 256-bit halves anyway.
//
// Panels of 16 weight rows are unpacked once per call: per step of 4 positions, the 16 rows' 4
// codes (64 bytes: row t at 4 t; with D::kAbs their absolute values after them), and with
// D::kOffset each row's sum of codes. Register tiles of up to 4 activation rows x 16 weight rows
// then take 4 broadcast activation codes per step (D::step: 2 x 8 int32 sums, exact):
//   out[m, n] = (float(sum_k x q  [- kOffset * rowsum_n] [- z * p.row_sums[n]]) * xs[m]) * scale[n]
// the same int32 sum as the row kernels, so the same bits as torchq's reference (static
// activations with a zero point: for K <= kInt8StaticGemmMaxK, where the int32 sum cannot wrap).
//
// D provides: kAbs (panel steps carry |w|: 128 bytes, else 64), kOffset (0: signed codes p.xq;
// else codes + kOffset in p.xu, and the panels keep their row sums), and
//   static __m256i step(__m256i acc, __m256i xb, const int8_t* pw, int half)
// adding the products of the 4 broadcast codes xb with half `half` (rows 8 half .. 8 half + 7) of
// the panel step at pw.
//
// In an anonymous namespace (see common.h). Include after the unit's `#pragma GCC target`.
#pragma once
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "int8_linear.h"
#include "tiling.h"
#include "transpose_avx2.h"

namespace tq {
namespace {

constexpr int kInt8PanelCols = 16;  // weight rows per panel: two vectors of 8 int32 lanes
// Activation rows per register tile: 8 accumulators, each step's two weight vectors and a
// broadcast (at 2 rows the sign-trick loop was bound by instruction issue: 34 instructions per 128
// multiply-adds).
constexpr int kInt8GemmTileRows = 4;

// Weight rows [n, n + rows) (rows <= 16, the others zero) for Kp positions into `panel` (layout
// above); with ROWSUMS each row's sum of codes into rowsum[16]. Positions from K on are zero (a
// row's last partial 32 are copied, never read past the row).
template <bool ABS, bool ROWSUMS>
void unpack_int8_panel(const Int8Params& p, int64_t n, int64_t rows, int8_t* panel, int32_t* rowsum) {
  constexpr int64_t kStep = ABS ? 128 : 64;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // rows 0-7, 8-15
  const int64_t K = p.K, full = K / 32 * 32;
  for (int64_t t0 = 0; t0 < kInt8PanelCols; t0 += 8) {
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
        if constexpr (ABS) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + s * kStep + 64), _mm256_abs_epi8(v[s]));
        if constexpr (ROWSUMS)  // lane r: row t0 + r's 4 codes, summed exactly
          sums[t0 / 8] = _mm256_add_epi32(sums[t0 / 8], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v[s]), ones16));
      }
    }
  }
  if constexpr (ROWSUMS) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rowsum), sums[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rowsum + 8), sums[1]);
  }
}

// A software prefetch of a byte range spread over a tile's loop: one line (into L2) every `every`
// steps, from `at` while below `end`.
struct SpreadPrefetch {
  const char* at;
  const char* end;
  int64_t every;
};

// out[m0 .. m0 + R, n .. n + cols) (R <= 4), see above; prefetching pf as it goes. correction[16]:
// what each column's int32 sum loses (kOffset * its row sum, + z * p.row_sums[n + t] for static
// activations; 0 past cols), read only with kOffset or p.row_sums.
template <class D, int R>
__attribute__((noinline)) void int8_gemm_tile(const Int8Params& p, const int8_t* panel, const int32_t* correction, int64_t n,
                                              int64_t cols, int64_t m0, SpreadPrefetch pf) {
  constexpr int64_t kStep = D::kAbs ? 128 : 64;
  // Named accumulators (row r, panel half v): GCC kept an array of them on the stack.
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  const uint8_t* x = D::kOffset ? p.xu + m0 * p.Kp : reinterpret_cast<const uint8_t*>(p.xq) + m0 * p.Kp;
  const int64_t steps = p.Kp / 4, stride = p.Kp;
  int64_t countdown = pf.every;
  for (int64_t s = 0; s < steps; ++s) {
    if (--countdown == 0) {
      countdown = pf.every;
      if (pf.at < pf.end) {
        _mm_prefetch(pf.at, _MM_HINT_T1);
        pf.at += 64;
      }
    }
    const int8_t* pw = panel + s * kStep;
    // One row: updated in place (the empty asm keeps GCC from computing every product of the
    // step first and rotating the accumulators through copies).
    auto row = [&](int r, __m256i& v0, __m256i& v1) __attribute__((always_inline)) {
      int32_t x4;
      memcpy(&x4, x + r * stride + 4 * s, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      v0 = D::step(v0, xb, pw, 0);
      v1 = D::step(v1, xb, pw, 1);
      asm("" : "+x"(v0), "+x"(v1));
    };
    row(0, c00, c01);
    if constexpr (R > 1) row(1, c10, c11);
    if constexpr (R > 2) row(2, c20, c21);
    if constexpr (R > 3) row(3, c30, c31);
  }
  const __m256i acc[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
  __m256i corr0 = _mm256_setzero_si256(), corr1 = corr0;
  if (D::kOffset != 0 || p.row_sums) {
    corr0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction));
    corr1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction + 8));
  }
  const __m256 s0 = _mm256_loadu_ps(p.scale + n), s1 = cols > 8 ? _mm256_loadu_ps(p.scale + n + 8) : s0;
  alignas(32) float row[kInt8PanelCols];
  for (int r = 0; r < R; ++r) {
    const __m256 xs = _mm256_set1_ps(p.xs[m0 + r]);
    const __m256 o0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], corr0)), xs), s0);
    const __m256 o1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], corr1)), xs), s1);
    float* out = p.out + (m0 + r) * p.N + n;
    if (cols == kInt8PanelCols) {
      _mm256_storeu_ps(out, o0);
      _mm256_storeu_ps(out + 8, o1);
    } else {
      _mm256_store_ps(row, o0);
      _mm256_store_ps(row + 8, o1);
      for (int64_t t = 0; t < cols; ++t) out[t] = row[t];
    }
  }
}

// A dynamic GEMM over output rows [n0, n1): a panel per 16 weight rows, unpacked once, then every
// kInt8GemmTileRows activation rows over it. fallback(p, n0, n1): the unit's row kernel for the
// same activations, if the panel cannot be had.
template <class D, class Fallback>
void int8_gemm(const Int8Params& p, int64_t n0, int64_t n1, Fallback&& fallback) {
  int8_t* panel = static_cast<int8_t*>(aligned_alloc(64, (p.Kp / 4) * (D::kAbs ? 128 : 64)));
  if (!panel) {
    fallback(p, n0, n1);
    return;
  }
  alignas(32) int32_t rowsum[kInt8PanelCols], correction[kInt8PanelCols];
  for (int64_t n = n0; n < n1; n += kInt8PanelCols) {
    const int64_t cols = n1 - n < kInt8PanelCols ? n1 - n : kInt8PanelCols;
    unpack_int8_panel<D::kAbs, D::kOffset != 0>(p, n, cols, panel, rowsum);
    if (D::kOffset != 0 || p.row_sums) {  // modulo 2^32, as the int32 sums
      for (int64_t t = 0; t < kInt8PanelCols; ++t) {
        uint32_t c = D::kOffset != 0 ? static_cast<uint32_t>(D::kOffset) * static_cast<uint32_t>(rowsum[t]) : 0u;
        if (p.row_sums && t < cols) c += static_cast<uint32_t>(p.zero_point) * static_cast<uint32_t>(p.row_sums[n + t]);
        correction[t] = static_cast<int32_t>(c);
      }
    }
    // The next panel's rows (contiguous codes) stream in from memory while the tiles run over this
    // one, each tile fetching its share of the lines, spread over its steps: the next unpacking
    // then finds them in L2 instead of waiting on DRAM (AVX2, 2 threads, r7 activations, weights
    // from DRAM: 576 x 1536 M = 16 0.156 -> 0.106-0.113 ms, M = 64 0.41 -> 0.33-0.35; 4096^2 M = 16
    // 1.96-2.18 -> 1.67, M = 64 6.5 -> 5.5).
    const int64_t next = n + kInt8PanelCols, next_end = next + kInt8PanelCols < n1 ? next + kInt8PanelCols : n1;
    const int64_t lines = next < next_end ? ((next_end - next) * p.K + 63) / 64 : 0;
    const int64_t tiles = (p.M + kInt8GemmTileRows - 1) / kInt8GemmTileRows, steps = p.Kp / 4;
    const int64_t per_tile = (lines + tiles - 1) / tiles;
    const int64_t every = per_tile ? (steps / per_tile > 1 ? steps / per_tile : 1) : steps + 1;
    const char* next_rows = lines ? reinterpret_cast<const char*>(p.w + next * p.K) : nullptr;
    int64_t first_line = 0;  // of the current tile's share
    tiles_then_remainder<kInt8GemmTileRows>(0, p.M, [&](auto mt, int64_t m) {
      const int64_t from = first_line < lines ? first_line : lines, to = from + per_tile < lines ? from + per_tile : lines;
      const SpreadPrefetch pf{next_rows + from * 64, next_rows + to * 64, every};
      int8_gemm_tile<D, decltype(mt)::value>(p, panel, correction, n, cols, m, pf);
      first_line += per_tile;
    });
  }
  free(panel);
}

}  // namespace
}  // namespace tq
