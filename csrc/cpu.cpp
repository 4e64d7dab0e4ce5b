// CPU feature detection and the ISA override (tq_set_isa, or TORCHQ_NATIVE_ISA at load).
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "common.h"

namespace tq {
namespace {

int detect() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return ISA_AVX2;
  return ISA_SCALAR;
}

int from_environment(int best) {
  const char* s = getenv("TORCHQ_NATIVE_ISA");
  if (s == nullptr || *s == 0) return best;
  int wanted = best;
  if (strcmp(s, "scalar") == 0) wanted = ISA_SCALAR;
  else if (strcmp(s, "avx2") == 0) wanted = ISA_AVX2;
  else if (strcmp(s, "avx512") == 0) wanted = ISA_AVX512;
  return wanted < best ? wanted : best;
}

const int g_supported = detect();
std::atomic<int> g_active{from_environment(g_supported)};

}  // namespace

int active_isa() { return g_active.load(std::memory_order_relaxed); }

bool has_avx512_vnni() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni"));
  return yes;
}

}  // namespace tq

// Bumped whenever an exported signature changes; torchq/native.py refuses a mismatch.
TQ_API int tq_abi_version() { return 3; }
TQ_API int tq_supported_isa() { return tq::g_supported; }
TQ_API int tq_active_isa() { return tq::active_isa(); }
// Use at most `isa` (clamped to what the CPU supports); returns the ISA now active.
TQ_API int tq_set_isa(int isa) {
  int v = isa < tq::ISA_SCALAR ? tq::ISA_SCALAR : isa;
  if (v > tq::g_supported) v = tq::g_supported;
  tq::g_active.store(v, std::memory_order_relaxed);
  return v;
}
