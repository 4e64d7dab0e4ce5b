// Panel-order int8 weights (int8_linear.h, "Panel order") unpacked into row-major rows with AVX2
// (Int8Kernels.unpack_panels of int8_linear_avx2.cpp and int8_linear_avx512.cpp): per whole panel of
// 16 rows and 32 positions, two 8 x 8 dword transposes (8 steps of 8 rows' 4 codes -> 8 rows' 32
// codes); rows of a partial panel position by position. Include after the unit's `#pragma GCC
// target` (AVX2 or wider). In an anonymous namespace (see common.h).
#pragma once
#include <immintrin.h>
#include <string.h>

#include "int8_linear.h"
#include "transpose_avx2.h"

namespace tq {
namespace {

// One row of a panel-order weight, gathered 4 codes at a time.
inline void unpack_panel_row(const int8_t* panels, int64_t K, int64_t Kp, int64_t n, int8_t* dst) {
  const int8_t* src = panels + int8_panel_offset(n, Kp) + (n % 16) * 4;
  const int64_t full = K / 4 * 4;
  for (int64_t k = 0; k < full; k += 4) memcpy(dst + k, src + k * 16, 4);
  if (full < K) memcpy(dst + full, src + full * 16, static_cast<size_t>(K - full));
}

void unpack_panels_avx2(const int8_t* panels, int64_t K, int64_t n0, int64_t n1, int8_t* dst) {
  const int64_t Kp = int8_panel_k(K), full = K / 32 * 32;
  int64_t n = n0;
  for (; n < n1 && n % 16; ++n) unpack_panel_row(panels, K, Kp, n, dst + (n - n0) * K);
  for (; n + 16 <= n1; n += 16) {
    const int8_t* panel = panels + int8_panel_offset(n, Kp);
    for (int half = 0; half < 2; ++half) {
      int8_t* rows = dst + (n - n0 + 8 * half) * K;
      for (int64_t k = 0; k < Kp && k < K; k += 32) {
        __m256i v[8];  // step s: rows 8 half .. 8 half + 7, 4 codes each
        for (int s = 0; s < 8; ++s)
          v[s] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (k / 4 + s) * 64 + 32 * half));
        transpose8_epi32(v);  // v[r]: row 8 half + r, positions k .. k + 31
        if (k < full) {
          for (int r = 0; r < 8; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + r * K + k), v[r]);
        } else {
          alignas(32) int8_t tail[32];
          for (int r = 0; r < 8; ++r) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(tail), v[r]);
            memcpy(rows + r * K + k, tail, static_cast<size_t>(K - k));
          }
        }
      }
    }
  }
  for (; n < n1; ++n) unpack_panel_row(panels, K, Kp, n, dst + (n - n0) * K);
}

}  // namespace
}  // namespace tq
