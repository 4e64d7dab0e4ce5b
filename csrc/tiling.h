// Tile dispatch shared by the templated kernel bodies: runs a tile whose size is a template
// argument over a range, full tiles first, then one tile of the remainder. Templates in an
// anonymous namespace only (see common.h: each ISA unit gets its own copy).
#pragma once
#include <stdint.h>

#include <type_traits>

namespace tq {
namespace {

// A tile kernel stays a function of its own: its loop then gets the whole register file (inlined
// into the dispatching function, its pointers and counters competed with the caller's and spilled).
#define TQ_TILE __attribute__((noinline))

template <int R>
using TileSize = std::integral_constant<int, R>;

// tile(TileSize<r>{}, i) for the remainder r = rem in [1, R] (nothing for 0).
template <int R, class Fn>
inline void remainder_tile(int64_t rem, int64_t i, Fn& tile) {
  if constexpr (R > 0) {
    if (rem == R) tile(TileSize<R>{}, i);
    else remainder_tile<R - 1>(rem, i, tile);
  }
}

// fn(TileSize<r>{}) for a runtime size r in [1, R].
template <int R, class Fn>
inline void with_tile_size(int64_t r, Fn&& fn) {
  auto tile = [&](auto size, int64_t) { fn(size); };
  remainder_tile<R>(r, 0, tile);
}

// tile(TileSize<R>{}, i) for i = begin, begin + R, ... while a full tile fits, then one tile of
// the 1..R-1 indices left.
template <int R, class Fn>
inline void tiles_then_remainder(int64_t begin, int64_t end, Fn&& tile) {
  int64_t i = begin;
  for (; i + R <= end; i += R) tile(TileSize<R>{}, i);
  remainder_tile<R - 1>(end - i, i, tile);
}

// tile(TileSize<R>{}, i) while a full tile fits, then tile(TileSize<1>{}, i) for each index left.
template <int R, class Fn>
inline void tiles_then_singles(int64_t begin, int64_t end, Fn&& tile) {
  int64_t i = begin;
  for (; i + R <= end; i += R) tile(TileSize<R>{}, i);
  for (; i < end; ++i) tile(TileSize<1>{}, i);
}

}  // namespace
}  // namespace tq
