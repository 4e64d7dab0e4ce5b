// The shape of one AMX tile register in a configuration (palette 1): rows (<= 16) and bytes per
// row (<= 64). Shared by the AMX tile operations (amx_tiles.h) and their emulation
// (amx_emulated_tiles.h).
#pragma once
#include <stdint.h>

namespace tq {
namespace {

struct AmxTileShape {
  uint8_t rows;
  uint8_t colsb;
};

}  // namespace
}  // namespace tq
