// y = x @ W^T for bf16 x and bf16 W on CPUs with AMX-BF16 (Intel Sapphire Rapids and later),
// the weight's channels as the rows of AMX tiles.
//
//   x  [M, K] bf16 (row stride ldx), K % 32 == 0
//   W  [N, K] bf16 as nn.Linear stores it (never repacked: the LM head is the embedding)
//   y  [M, N] fp32 or bf16 (+ fp32 bias [N]); only whole blocks of 32 channels here, the
//      caller computes the N % 32 tail on the rows path
//
// One TDPBF16PS adds a 16 x 32 bf16 tile A times a 32 x 16 bf16 tile B (held in K pairs,
// B[kp][j][2]) into a 16 x 16 fp32 tile C: 8192 exact products with fp32 sums, where VDPBF16PS
// does 32. W's rows are already A's layout (16 channels x 32 K elements, row stride ldw), and x
// packed as for the lanes kernel (xp [K/2][Mp], lane m of pair kp = x[m][2kp .. 2kp+1]) is B's,
// so a tile computes C^T = W x^T: 16 channels x 16 rows, transposed on the way out. A task owns
// 32 channels (two A tiles), walks down M two 16-row blocks at a time (four C tiles, two B
// tiles: all 8 tile registers) and reads its weights from memory once per call; from the second
// pair of row blocks on they come from L1/L2. Tasks over channel blocks share the threads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"       // ready, Tiles
#include "gemm_lanes.h"      // pack_x
#include "transpose.h"

namespace bb {
namespace amx {

constexpr int KT = 32;         // K elements per A tile row (64 bytes)
constexpr int NT = 2 * L;      // channels per task
// rows per chunk of packed x: a B tile's 16 rows lie MC * 4 bytes apart; at the whole M's stride
// (4-8 KiB from 1024 rows on) they all fell into one L1 set and prefill ran at a third of the rate
constexpr int64_t MC = 128;
constexpr auto PF_HINT = _MM_HINT_T1;   // the next task's weights into L2 (T0 measured no better)

struct Args {
  const uint32_t* xp; int64_t mp;          // packed x: rows padded to mp (% 16 == 0) in blocks of
                                           // MC rows [mp / MC][K/2][MC] (one block [K/2][mp] when
                                           // mp <= MC: lanes::pack_x with ld = min(mp, MC))
  const uint16_t* w; int64_t ldw;          // W [N, K]
  int64_t M, N, K;                         // N % 32 == 0, K % 32 == 0
  float* yf; uint16_t* yb; int64_t ldy; const float* bias;
};

// c [16 channels][16 rows] (a stored C tile) -> y[m0 + i][n0 .. n0 + 16] + bias, rows past M skipped
inline void store_block(const Args& a, const float* c, int64_t m0, int64_t n0) {
  __m512 r[16];
  for (int j = 0; j < L; ++j) r[j] = _mm512_load_ps(c + j * L);
  simd16::transpose16(r);
  const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
  for (int i = 0; i < L && m0 + i < a.M; ++i) {
    const __m512 v = _mm512_add_ps(r[i], bias);
    const int64_t off = (m0 + i) * a.ldy + n0;
    if (a.yf) _mm512_storeu_ps(a.yf + off, v);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.yb + off), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// K .. k1 of rows m0 .. m0 + 16 * TM and channels n0 .. n0 + 32: C tiles 0, 1 (rows m0..) and
// 2, 3 (the next 16 rows), A tiles 4, 5 (the two channel halves), B tiles 6, 7. The sums start
// at zero for k0 = 0, else from part (4 tiles, stored there by the span before); they go back
// to part unless k1 = K, where they are stored to y. pf: the next task's weights (nullptr:
// none), fetched into L2 while this span computes.
template <int TM>
inline void task_rows(const Args& a, int64_t n0, int64_t m0, int64_t k0, int64_t k1, float* part,
                      const uint16_t* pf) {
  static_assert(TM == 1 || TM == 2, "one or two row blocks");
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TM == 2) { _tile_zero(2); _tile_zero(3); }
  } else {
    _tile_loadd(0, part, 64);
    _tile_loadd(1, part + L * L, 64);
    if constexpr (TM == 2) { _tile_loadd(2, part + 2 * L * L, 64); _tile_loadd(3, part + 3 * L * L, 64); }
  }
  const uint16_t* w0 = a.w + n0 * a.ldw;
  const uint16_t* w1 = w0 + L * a.ldw;
  const int64_t ld = std::min(a.mp, MC), sw = a.ldw * 2, sx = ld * 4;
  const uint32_t* xk = a.xp + (m0 / ld) * (a.K / 2) * ld + (k0 / 2) * ld + m0 % ld;
  for (int64_t k = k0; k < k1; k += KT, xk += (KT / 2) * ld) {
    if (pf)
      for (int r = 0; r < NT; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * a.ldw + k), PF_HINT);
    _tile_loadd(4, w0 + k, sw);
    _tile_loadd(5, w1 + k, sw);
    _tile_loadd(6, xk, sx);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (TM == 2) {
      _tile_loadd(7, xk + L, sx);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, part, 64);
  _tile_stored(1, part + L * L, 64);
  if constexpr (TM == 2) { _tile_stored(2, part + 2 * L * L, 64); _tile_stored(3, part + 3 * L * L, 64); }
  if (k1 < a.K) return;
  for (int t = 0; t < 2 * TM; ++t) store_block(a, part + t * L * L, m0 + (t / 2) * L, n0 + (t % 2) * L);
}

// K in spans of KB: a span's 32 weight rows (32 KiB) stay in L1 for every pair of row blocks,
// where a whole row of K = 2048 (128 KiB) came from L2 for each (down_proj 512 x 2048 at 64
// rows: 649 -> ... GFLOP/s). The first pass over the weights also fetches the next task's (the
// last task has none). part: 4 tiles of partial sums per pair of row blocks.
constexpr int64_t KB = 512;

inline void task(const Args& a, int64_t n0, float* part, int64_t v0, int64_t v1) {
  const uint16_t* next = n0 + 2 * NT <= a.N ? a.w + (n0 + NT) * a.ldw : nullptr;
  for (int64_t k0 = 0; k0 < a.K; k0 += KB) {
    const int64_t k1 = std::min(a.K, k0 + KB);
    const uint16_t* pf = next;
    int64_t v = v0;
    for (; v + 2 <= v1; v += 2, pf = nullptr) task_rows<2>(a, n0, v * L, k0, k1, part + (v - v0) * 2 * L * L, pf);
    if (v < v1) task_rows<1>(a, n0, v * L, k0, k1, part + (v - v0) * 2 * L * L, pf);
  }
}

// Rows in chunks of MC (prefill sizes): a K span of x for MC rows (128 KiB) stays in L2 while
// every task reads it. Within a chunk threads share tasks of 32 channels, each thread setting
// up its tiles once.
inline void run(const Args& a) {
  const int64_t tasks = a.N / NT, vecs = a.mp / L, chunk = MC / L;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / (std::max<int64_t>(a.K, 1) * NT));
  for (int64_t c0 = 0; c0 < vecs; c0 += chunk) {
    const int64_t c1 = std::min(vecs, c0 + chunk);
    at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
      Tiles tiles;
      alignas(64) float part[(MC / L + 1) * 2 * L * L];
      for (int64_t t = t0; t < t1; ++t) task(a, t * NT, part, c0, c1);
    });
  }
}

}  // namespace amx
}  // namespace bb
