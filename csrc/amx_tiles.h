// The AMX tile operations the AMX units share (int8_amx.cpp, bf16_amx.cpp, lut4_q8_amx.cpp), each
// unit adding its multiply (tdpbssd, tdpbf16ps). Included only by units compiled with AMX target flags, inside
// their anonymous namespace use (see common.h on inline functions across ISA units).
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "amx_shapes.h"

namespace tq {
namespace {

// Palette 1 with tiles 0 .. kTiles - 1 of 16 rows x 64 bytes, or of the shapes given
// (shapes[t]: rows, bytes per row; amx_shapes.h).
template <int kTiles>
struct AmxTileOps {
  static void configure(const AmxTileShape* shapes = nullptr) {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;
    for (int t = 0; t < kTiles; ++t) {
      const int colsb = shapes ? shapes[t].colsb : 64;
      cfg[16 + 2 * t] = static_cast<uint8_t>(colsb);  // colsb (little-endian uint16, <= 64)
      cfg[48 + t] = shapes ? shapes[t].rows : 16;      // rows
    }
    _tile_loadconfig(cfg);
  }
  // GCC's tile intrinsics paste their tile numbers into the instruction as text, so they cannot
  // take template arguments: the same instructions as inline asm with immediate operands.
  template <int T>
  static void zero() { asm volatile("tilezero %%tmm%c0" ::"i"(T)); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  // 16 rows of 16 dwords at src (row stride src_stride bytes) transposed into dst[16][16] dwords
  // (dst[j][i] = src[i][j]): 3 rounds of 16 AVX-512 shuffles (every AMX CPU has AVX-512).
  static void transpose16(const void* src, int64_t src_stride, void* dst) {
    __m512i r[16], a[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(static_cast<const char*>(src) + i * src_stride);
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i + 1 interleaved by dword
      a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3
      r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    uint32_t* out = static_cast<uint32_t*>(dst);
    for (int j = 0; j < 4; ++j) {  // column 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
      const __m512i d0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), d1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
      const __m512i e0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), e1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
      _mm512_storeu_si512(out + j * 16, _mm512_shuffle_i32x4(d0, e0, 0x88));
      _mm512_storeu_si512(out + (4 + j) * 16, _mm512_shuffle_i32x4(d1, e1, 0x88));
      _mm512_storeu_si512(out + (8 + j) * 16, _mm512_shuffle_i32x4(d0, e0, 0xDD));
      _mm512_storeu_si512(out + (12 + j) * 16, _mm512_shuffle_i32x4(d1, e1, 0xDD));
    }
  }
  // Tile T (16 rows x 16 dwords) transposed into dst[16][16] dwords (dst[j][i] = T[i][j]).
  template <int T>
  static void store_transposed(void* dst) {
    alignas(64) uint32_t t[16][16];
    store<T>(t, 64);
    transpose16(t, 64, dst);
  }
  static void release() { _tile_release(); }
};

}  // namespace
}  // namespace tq
