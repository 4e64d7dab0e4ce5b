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
  static void release() { _tile_release(); }
};

}  // namespace
}  // namespace tq
