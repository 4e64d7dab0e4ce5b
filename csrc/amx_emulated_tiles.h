// The tile storage and moves of the emulated AMX units (int8_amx_emulated.cpp,
// bf16_amx_emulated.cpp, lut4_q8_amx_emulated.cpp), each adding its multiply: kTiles tiles per
// thread of up to 16 rows x 64 bytes, as the AMX tile registers are, shaped by configure (default
// 16 x 64). Portable C++, for tests on every machine.
#pragma once
#include <stdint.h>
#include <string.h>

#include "amx_shapes.h"

namespace tq {
namespace {

template <int kTiles>
struct EmulatedTileOps {
  struct State {
    alignas(64) uint8_t t[kTiles][16][64];
    AmxTileShape shape[kTiles];
    State() {
      for (auto& s : shape) s = AmxTileShape{16, 64};
    }
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  // As AMX's configuration: the tiles' shapes (default 16 rows x 64 bytes), every tile zeroed.
  static void configure(const AmxTileShape* shapes = nullptr) {
    State& s = state();
    memset(s.t, 0, sizeof s.t);
    for (int t = 0; t < kTiles; ++t) s.shape[t] = shapes ? shapes[t] : AmxTileShape{16, 64};
  }
  template <int T>
  static void zero() { memset(state().t[T], 0, sizeof state().t[T]); }
  // Loads read rows x colsb bytes only (as tileloadd); the rest of the tile is zeroed.
  template <int T>
  static void load(const void* p, int64_t stride) {
    State& s = state();
    memset(s.t[T], 0, sizeof s.t[T]);
    for (int r = 0; r < s.shape[T].rows; ++r) memcpy(s.t[T][r], static_cast<const char*>(p) + r * stride, s.shape[T].colsb);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    const State& s = state();
    for (int r = 0; r < s.shape[T].rows; ++r) memcpy(static_cast<char*>(p) + r * stride, s.t[T][r], s.shape[T].colsb);
  }
  // 16 rows of 16 dwords at src (row stride src_stride bytes) transposed into dst[16][16] dwords.
  static void transpose16(const void* src, int64_t src_stride, void* dst) {
    const uint8_t* in = static_cast<const uint8_t*>(src);
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) memcpy(out + (j * 16 + i) * 4, in + i * src_stride + 4 * j, 4);
  }
  // Tile T read as 16 x 16 dwords, transposed into dst[16][16] (dst[j][i] = T[i][j]).
  template <int T>
  static void store_transposed(void* dst) { transpose16(state().t[T], 64, dst); }
  static void release() {}
};

}  // namespace
}  // namespace tq
