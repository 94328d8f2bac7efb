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
// tiles: all 8 tile registers) and reads its weights from memory once per chunk of MC rows; from
// the second pair of row blocks on they come from L1/L2. Tasks over channel blocks share the
// threads.
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

// rows m0 .. m0 + 16 * TM and channels n0 .. n0 + 32: C tiles 0, 1 (rows m0..) and 2, 3 (the
// next 16 rows), A tiles 4, 5 (the two channel halves), B tiles 6, 7; stored through c (4 tiles)
// to y. pf: the next task's weights (nullptr: none), fetched into L2 while this one computes.
template <int TM>
inline void task_rows(const Args& a, int64_t n0, int64_t m0, float* c, const uint16_t* pf) {
  static_assert(TM == 1 || TM == 2, "one or two row blocks");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TM == 2) { _tile_zero(2); _tile_zero(3); }
  const uint16_t* w0 = a.w + n0 * a.ldw;
  const uint16_t* w1 = w0 + L * a.ldw;
  const int64_t ld = std::min(a.mp, MC), sw = a.ldw * 2, sx = ld * 4;
  const uint32_t* xk = a.xp + (m0 / ld) * (a.K / 2) * ld + m0 % ld;
  for (int64_t k = 0; k < a.K; k += KT, xk += (KT / 2) * ld) {
    if (pf)
      for (int r = 0; r < NT; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * a.ldw + k), _MM_HINT_T1);
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
  _tile_stored(0, c, 64);
  _tile_stored(1, c + L * L, 64);
  if constexpr (TM == 2) { _tile_stored(2, c + 2 * L * L, 64); _tile_stored(3, c + 3 * L * L, 64); }
  for (int t = 0; t < 2 * TM; ++t) store_block(a, c + t * L * L, m0 + (t / 2) * L, n0 + (t % 2) * L);
}

// row blocks v0 .. v1 of one task, two at a time; with more than one pair the first pass also
// fetches the next task's weights into L2 (LM head 248320 x 512 at 64 rows 20.1 -> 17.0 ms; at
// 16 rows, one pass, the fetches slowed it 11.3 -> 12.6 ms: the hardware prefetcher keeps up)
inline void task(const Args& a, int64_t n0, float* c, int64_t v0, int64_t v1) {
  const bool fetch = v1 - v0 > 2 && n0 + 2 * NT <= a.N;
  const uint16_t* pf = fetch ? a.w + (n0 + NT) * a.ldw : nullptr;
  int64_t v = v0;
  for (; v + 2 <= v1; v += 2, pf = nullptr) task_rows<2>(a, n0, v * L, c, pf);
  if (v < v1) task_rows<1>(a, n0, v * L, c, pf);
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
      alignas(64) float c[4 * L * L];
      for (int64_t t = t0; t < t1; ++t) task(a, t * NT, c, c0, c1);
    });
  }
}

}  // namespace amx
}  // namespace bb
