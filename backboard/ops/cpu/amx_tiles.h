// AMX tiles on Linux (amx_bf16 builds): whether this process may use them, and the per-thread
// tile configuration every AMX kernel here shares (gemm_amx.h, prefill_attention.h).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>
#include <cstdint>

namespace bb {
namespace amx {

constexpr int L = 16;          // rows per tile (and columns of an fp32 C tile)

// The CPU has AMX-BF16 and Linux granted this process the tile state (arch_prctl: since 5.16
// a process must ask before its first tile instruction, or it gets SIGILL). Asked once.
inline bool ready() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// palette 1, all 8 tiles 16 rows x 64 bytes (C: 16 x 16 fp32; A: 16 x 32 bf16; B: 16 K pairs x 16)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile configuration is per thread: every parallel chunk sets it and releases it after.
class Tiles {
 public:
  Tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) { c.rows[t] = L; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
};

}  // namespace amx
}  // namespace bb
