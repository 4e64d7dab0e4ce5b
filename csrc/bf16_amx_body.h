// The bf16 weight-only GEMM's body over a Tiles trait (see bf16_amx.h).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "bf16_amx.h"
#include "common.h"

namespace tq {
namespace {

constexpr int kBf16Tile = 16;     // weight rows per A tile, activation rows per B tile
constexpr int kBf16Step = 32;     // positions per tile step
constexpr int64_t kBf16TileWords = kBf16Tile * 32;

// Whether every decoded weight of w[0, n) is 0, inf, NaN or of magnitude >= 2^-66 (bf16 exponent
// field >= 61): its products with admitted activations are 0 or normal.
// (magnitude bits - 1, as uint16: zero wraps to the top) is a min reduction that vectorizes.
inline bool bf16_weights_ok(const uint16_t* w, int64_t n) {
  uint16_t least = 0xFFFFu;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t a = static_cast<uint16_t>((w[i] & 0x7FFFu) - 1u);
    least = a < least ? a : least;
  }
  return least >= (61u << 7) - 1u;
}

// fp32 value of a bf16 word.
inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// A panel's outputs (weight rows n .. n + cols, decoded at w) without tiles: per output, the exact
// products summed in order in fp32, the activations read back from their B tiles.
inline void bf16_panel_portable(const Bf16AmxGemm& g, const uint16_t* w, int64_t n, int64_t cols) {
  const int64_t K = g.K, steps = K / kBf16Step;
  for (int64_t m = 0; m < g.M; ++m) {
    const uint16_t* x = g.xt + (m / kBf16Tile) * steps * kBf16TileWords + 2 * (m % kBf16Tile);
    for (int64_t t = 0; t < cols; ++t) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        acc += bf16_value(w[t * K + k]) * bf16_value(x[(k / kBf16Step) * kBf16TileWords + (k % kBf16Step) / 2 * 32 + (k & 1)]);
      g.out[m * g.N + n + t] = bf16_rne_nan(g.bias ? acc + g.bias[n + t] : acc);
    }
  }
}

// Calls f(std::integral_constant<int, i>) for i in [0, N).
template <int N, class Fn>
__attribute__((always_inline)) inline void bf16_static_for(Fn&& f) {
  if constexpr (N > 0) {
    bf16_static_for<N - 1>(f);
    f(std::integral_constant<int, N - 1>{});
  }
}

// One pass: P weight panels (decoded at w, [P * 16, K]) x Q activation blocks from i0 (all
// present), into C tiles j * Q + i (P * Q <= 4). Tiles 4 and 6 take the weights, 5 and 7 the
// activations (alternating, so a load need not wait for the previous tile's multiply): every
// pass runs P * Q independent accumulations (one panel and one block alone would wait on each
// tdpbf16ps in turn).
template <class Tiles, int P, int Q>
__attribute__((always_inline)) inline void bf16_pass(const Bf16AmxGemm& g, const uint16_t* w, int64_t i0, int64_t steps,
                                                     int64_t n, int64_t n1, float (&c)[kBf16Tile][kBf16Tile]) {
  static_assert(P * Q <= 4 && (P == 1 || Q <= 2), "tiles 0..3 accumulate; 4..7 hold operands");
  const int64_t K = g.K, N = g.N, M = g.M;
  bf16_static_for<P * Q>([&](auto t) { Tiles::template zero<decltype(t)::value>(); });
  for (int64_t s = 0; s < steps; ++s) {
    if constexpr (P == 1) {
      Tiles::template load<4>(w + s * kBf16Step, K * 2);
      bf16_static_for<Q>([&](auto i) {
        constexpr int I = decltype(i)::value, B = I % 2 ? 7 : 5;
        Tiles::template load<B>(g.xt + ((i0 + I) * steps + s) * kBf16TileWords, 64);
        Tiles::template dot<I, 4, B>();
      });
    } else {
      bf16_static_for<Q>([&](auto i) {
        constexpr int I = decltype(i)::value;
        Tiles::template load<I ? 7 : 5>(g.xt + ((i0 + I) * steps + s) * kBf16TileWords, 64);
      });
      bf16_static_for<P>([&](auto j) {
        constexpr int J = decltype(j)::value, A = J % 2 ? 6 : 4;
        Tiles::template load<A>(w + J * kBf16Tile * K + s * kBf16Step, K * 2);
        bf16_static_for<Q>([&](auto i) {
          constexpr int I = decltype(i)::value;
          Tiles::template dot<J * Q + I, A, I ? 7 : 5>();
        });
      });
    }
  }
  bf16_static_for<P>([&](auto j) {
    constexpr int J = decltype(j)::value;
    const int64_t n_j = n + J * kBf16Tile;
    const int64_t cols = n1 - n_j < kBf16Tile ? n1 - n_j : kBf16Tile;
    if (cols <= 0) return;
    bf16_static_for<Q>([&](auto i) {
      constexpr int I = decltype(i)::value;
      const int64_t first = (i0 + I) * kBf16Tile, rows = M - first < kBf16Tile ? M - first : kBf16Tile;
      Tiles::template store_transposed<J * Q + I>(&c[0][0]);  // c[r][t]: activation row r, weight row t
      alignas(64) float bias[kBf16Tile] = {};
      if (g.bias) memcpy(bias, g.bias + n_j, static_cast<size_t>(cols) * sizeof(float));
      for (int64_t r = 0; r < rows; ++r) {  // one 16-lane row: + bias, rounded to bf16
        alignas(64) uint16_t h[kBf16Tile];
        for (int t = 0; t < kBf16Tile; ++t) {
          uint32_t u;
          const float v = g.bias ? c[r][t] + bias[t] : c[r][t];
          memcpy(&u, &v, 4);
          const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
          h[t] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
        }
        if (cols == kBf16Tile) memcpy(g.out + (first + r) * N + n_j, h, sizeof h);  // one store, not a call
        else memcpy(g.out + (first + r) * N + n_j, h, static_cast<size_t>(cols) * sizeof(uint16_t));
      }
    });
  });
}

// Output columns [n0, n1) in passes of P panels (decoded once each) over every block of Q
// activation rows (the last pass of blocks with fewer).
template <class Tiles, int P, int Q>
void bf16_panels(const Bf16AmxGemm& g, int64_t n0, int64_t n1, uint16_t* w) {
  const int64_t K = g.K, steps = K / kBf16Step, blocks = (g.M + kBf16Tile - 1) / kBf16Tile;
  alignas(64) float c[kBf16Tile][kBf16Tile];
  for (int64_t n = n0; n < n1; n += P * kBf16Tile) {
    const int64_t rows = n1 - n < P * kBf16Tile ? n1 - n : P * kBf16Tile;
    g.decode(g.ctx, n, n + rows, w);
    if (rows < P * kBf16Tile) memset(w + rows * K, 0, static_cast<size_t>((P * kBf16Tile - rows) * K * 2));
    int64_t i0 = 0;
    for (; i0 + Q <= blocks; i0 += Q) bf16_pass<Tiles, P, Q>(g, w, i0, steps, n, n1, c);
    if constexpr (Q > 1)
      for (; i0 < blocks; ++i0) bf16_pass<Tiles, P, 1>(g, w, i0, steps, n, n1, c);
    for (int64_t j = 0; j * kBf16Tile < rows; ++j) {  // panels whose weights AMX could flush: their outputs again
      const int64_t cols = rows - j * kBf16Tile < kBf16Tile ? rows - j * kBf16Tile : kBf16Tile;
      if (!bf16_weights_ok(w + j * kBf16Tile * K, cols * K)) bf16_panel_portable(g, w + j * kBf16Tile * K, n + j * kBf16Tile, cols);
    }
  }
}

template <class Tiles>
void amx_bf16_gemm(const Bf16AmxGemm& g, int64_t n0, int64_t n1) {
  const int64_t blocks = (g.M + kBf16Tile - 1) / kBf16Tile;
  uint16_t* w = static_cast<uint16_t*>(aligned_alloc(64, static_cast<size_t>((4 * kBf16Tile * g.K * 2 + 63) / 64 * 64)));
  if (!w) {
    __atomic_store_n(g.failed, 1, __ATOMIC_RELAXED);
    return;
  }
  Tiles::configure();
  const int64_t panels = (n1 - n0 + kBf16Tile - 1) / kBf16Tile;  // a short range: no passes over zero panels
  if (blocks >= 4) bf16_panels<Tiles, 1, 4>(g, n0, n1, w);
  else if (blocks >= 2) panels >= 2 ? bf16_panels<Tiles, 2, 2>(g, n0, n1, w) : bf16_panels<Tiles, 1, 2>(g, n0, n1, w);
  else if (panels >= 3) bf16_panels<Tiles, 4, 1>(g, n0, n1, w);
  else if (panels >= 2) bf16_panels<Tiles, 2, 1>(g, n0, n1, w);
  else bf16_panels<Tiles, 1, 1>(g, n0, n1, w);
  Tiles::release();
  free(w);
}

}  // namespace
}  // namespace tq
