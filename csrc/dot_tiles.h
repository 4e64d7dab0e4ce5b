// The tile schedule of the bf16 dot paths (int8_dot_body.h, lut4_scaled_dot_body.h): weight rows in
// blocks, activation rows in chunks, tiles of up to 16 accumulators. Kernel provides Params (with
// M: the activation rows), tile<NT, MT>(p, ctx, n, m0) (NT weight rows from n x MT activation
// rows from m0, NT * MT <= 16) and tile_ok(p, ctx, n, rows) (whether weight rows [n, n + rows) may take
// the path, called before their tiles run: it may prepare them in ctx; else `fallback` runs them for every activation row). Templates in an anonymous
// namespace only (see common.h).
#pragma once
#include <stdint.h>

#include "tiling.h"

namespace tq {
namespace {

template <class Kernel>
struct DotSchedule {
  using Params = typename Kernel::Params;

  // The activation rows a tile runs at once: up to 8 (x loaded once per 2 weight rows: int8, 16 rows,
  // 0.85-0.94x bf16 F.linear in chunks of 8 against 0.80-0.93x in chunks of 16 and 0.71-0.78x in
  // chunks of 4, one Zen 4 core, SmolLM2's shapes), fewer where their positions would exceed
  // kChunkBytes (they are read once per weight tile: from L1 while they fit there; int8 576 x 1536
  // at 16 rows took 313 us in chunks of 16, 48 KB, and 220 in chunks of 8), but at least 4.
  static constexpr int64_t kChunkBytes = 24 << 10, kChunkMaxRows = 8;

  // The weight rows a block holds: as many as keep their codes within kBlockBytes (a multiple of 8
  // rows, at least 8). Above one chunk of activation rows, each chunk runs over a block before the
  // next chunk does, so the block's codes (and the chunk's activations) are read from L1.
  static constexpr int64_t kBlockBytes = 16 << 10;

  // Activation rows [m0, m0 + mt) (mt <= the chunk) against the NT weight rows from n, in tiles of
  // up to 16 accumulators.
  template <int NT, class Ctx>
  static void weight_rows(const Params& p, const Ctx& ctx, int64_t n, int64_t m0, int64_t mt) {
    with_tile_size<kChunkMaxRows>(mt, [&](auto size) {
      constexpr int MT = decltype(size)::value;
      constexpr int fit = 16 / MT < NT ? 16 / MT : NT;  // the most weight rows per tile at MT
      for (int t = 0; t < NT; t += fit) {
        if (t + fit <= NT) Kernel::template tile<fit, MT>(p, ctx, n + t, m0);
        else with_tile_size<fit>(NT - t, [&](auto rest) { Kernel::template tile<decltype(rest)::value, MT>(p, ctx, n + t, m0); });
      }
    });
  }

  // Weight rows [n0, n1) in tiles of NT: blocks of rows, each block's tiles for one chunk of
  // activation rows at a time.
  template <int NT, class Ctx, class Fallback>
  static void blocks(const Params& p, const Ctx& ctx, int64_t n0, int64_t n1, int64_t chunk, int64_t weight_row_bytes, Fallback fallback) {
    int64_t block = kBlockBytes / weight_row_bytes / 8 * 8;
    if (block < 8) block = 8;
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
      for (int64_t m0 = 0; m0 < p.M; m0 += chunk) {
        const int64_t mt = p.M - m0 < chunk ? p.M - m0 : chunk;
        tiles_then_singles<NT>(b0, b1, [&](auto r, int64_t n) {
          constexpr int R = decltype(r)::value;
          if (Kernel::tile_ok(p, ctx, n, R)) weight_rows<R>(p, ctx, n, m0, mt);
          else if (m0 == 0) fallback(p, n, n + R);
        });
      }
    }
  }

  // Output rows [n0, n1) for all p.M activation rows of act_row_bytes each (as the tiles read them),
  // weight rows of weight_row_bytes; weight tiles of as many rows as 16 accumulators allow at the
  // call's widest chunk.
  template <class Ctx, class Fallback>
  static void rows(const Params& p, const Ctx& ctx, int64_t n0, int64_t n1, int64_t act_row_bytes, int64_t weight_row_bytes,
                   Fallback fallback) {
    int64_t chunk = kChunkBytes / act_row_bytes;
    chunk = chunk < 4 ? 4 : chunk > kChunkMaxRows ? kChunkMaxRows : chunk;
    if (chunk > p.M) chunk = p.M;
    if (chunk <= 2) blocks<8>(p, ctx, n0, n1, chunk, weight_row_bytes, fallback);
    else if (chunk <= 4) blocks<4>(p, ctx, n0, n1, chunk, weight_row_bytes, fallback);
    else if (chunk <= 5) blocks<3>(p, ctx, n0, n1, chunk, weight_row_bytes, fallback);
    else blocks<2>(p, ctx, n0, n1, chunk, weight_row_bytes, fallback);
  }
};

}  // namespace
}  // namespace tq
