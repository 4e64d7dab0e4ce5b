// The tile storage and moves of the emulated AMX units (int8_amx_emulated.cpp,
// bf16_amx_emulated.cpp), each adding its multiply: kTiles tiles of 16 rows x 64 bytes per thread,
// as the AMX tile registers are. Portable C++, for tests on every machine.
#pragma once
#include <stdint.h>
#include <string.h>

namespace tq {
namespace {

template <int kTiles>
struct EmulatedTileOps {
  struct State {
    alignas(64) uint8_t t[kTiles][16][64];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure() {}
  template <int T>
  static void zero() { memset(state().t[T], 0, sizeof state().t[T]); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(state().t[T][r], static_cast<const char*>(p) + r * stride, 64);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(static_cast<char*>(p) + r * stride, state().t[T][r], 64);
  }
  static void release() {}
};

}  // namespace
}  // namespace tq
