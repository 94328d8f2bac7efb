// y = x @ W^T for bf16 x and bf16 W on CPUs with AVX512-BF16, rows of x in the vector lanes.
//
//   x  [M, K] bf16 (row stride ldx, K even), M >= 16 worth filling the lanes
//   W  [N, K] bf16 as nn.Linear stores it (never repacked: the LM head is the embedding)
//   y  [M, N] fp32 or bf16 (+ fp32 bias [N])
//
// The rows path of gemm.cpp puts K in the lanes: every output is a horizontal sum, and with
// K = 512 its reduction and scalar stores cost as much as a third of the dot products (about
// 205 GFLOP/s of oneDNN's 270 at M = 64 on a Zen 4). Here x is repacked once per call into
// xp [K/2][Mp] (Mp = M rounded up to 16; lane m of pair kp holds x[m][2kp], x[m][2kp+1]) and a
// weight pair is broadcast to all lanes: VDPBF16PS then adds, for 16 rows at once, the two
// products of one K pair of one channel. Accumulators hold 16 outputs each and need no reduction;
// weights stream once per 64 rows (a 4 x 6 tile), read 4 bytes at a time straight from their rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm_out.h"
#include "transpose.h"

namespace bb {
namespace lanes {

constexpr int L = 16;      // rows per vector (fp32 lanes)

struct Args {
  const uint32_t* xp; int64_t mp;          // packed x [K/2][mp]
  const uint16_t* w; int64_t ldw;          // W [N, K]
  int64_t M, N, K;
  float* yf; uint16_t* yb; int64_t ldy; const float* bias;
};

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// rows m0 .. m0 + 16 of x into xp, packed in blocks of mp rows: xp[blk][kp][m % mp] = the bf16
// pair x[m][2kp .. 2kp+1] with blk = m / mp (mp % 16 == 0; rows past M are zero). 16 x 16
// blocks of pairs transposed in registers (pair by pair, the strided stores took as long as a
// K = 2048 layer's AMX GEMM at 64 rows).
inline void pack_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xp, int64_t mp, int64_t m0) {
  const int64_t KP = K / 2, kpv = KP - KP % 16;
  const int rows = int(std::clamp<int64_t>(M - m0, 0, L));
  const uint16_t* xr = x + std::min(m0, M) * ldx;
  uint32_t* d = xp + (m0 / mp) * KP * mp + m0 % mp;
  for (int64_t kp = 0; kp < kpv; kp += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(xr + i * ldx + 2 * kp)) : _mm512_setzero_ps();
    simd16::transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(d + (kp + j) * mp), r[j]);
  }
  for (int64_t kp = kpv; kp < KP; ++kp)
    for (int i = 0; i < L; ++i) d[kp * mp + i] = i < rows ? pair_at(xr + i * ldx + 2 * kp) : 0u;
}

// rows padded to rows_total (a multiple of 16) in blocks of mp rows (mp % 16 == 0; the lanes
// kernel takes one block, mp = rows_total), in parallel over 16-row blocks
inline void pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xp, int64_t mp,
                   int64_t rows_total) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (std::max<int64_t>(K, 1) * L));
  at::parallel_for(0, rows_total / L, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pack_rows(x, ldx, M, K, xp, mp, i * L);
  });
}

// r[0..7] (8 channels, 8 rows each) -> r[l] = row l's 8 channels
inline void transpose8(__m256* r) {
  __m256 t[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  __m256 u[8];
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}

// acc[j] lane l = y[m0 + l][n0 + j] for NC <= 8 channels: transposed 8 rows at a time and
// stored with a channel mask (+ bias), rows past M skipped
template <int NC>
inline void store_rows(const Args& a, const __m512* acc, int64_t m0, int64_t n0) {
  static_assert(NC <= 8, "store_rows: at most 8 channels");
  const __mmask8 mask = __mmask8((1u << NC) - 1);
  const __m256 bias = a.bias ? _mm256_maskz_loadu_ps(mask, a.bias + n0) : _mm256_setzero_ps();
  for (int h = 0; h < 2; ++h) {
    __m256 r[8];
    for (int j = 0; j < 8; ++j)
      r[j] = j < NC ? (h ? _mm512_extractf32x8_ps(acc[j], 1) : _mm512_castps512_ps256(acc[j]))
                    : _mm256_setzero_ps();
    transpose8(r);
    for (int l = 0; l < 8 && m0 + 8 * h + l < a.M; ++l) {
      const int64_t off = (m0 + 8 * h + l) * a.ldy + n0;
      const __m256 v = _mm256_add_ps(r[l], bias);
      if (a.yf) _mm256_mask_storeu_ps(a.yf + off, mask, v);
      else _mm_mask_storeu_epi16(a.yb + off, mask, (__m128i)_mm256_cvtneps_pbh(v));
    }
  }
}

// store_rows for NC <= 16 channels (two stores past 8)
template <int NC>
inline void store_any(const Args& a, const __m512* acc, int64_t m0, int64_t n0) {
  if constexpr (NC > 8) {
    store_rows<8>(a, acc, m0, n0);
    store_rows<NC - 8>(a, acc + 8, m0, n0 + 8);
  } else {
    store_rows<NC>(a, acc, m0, n0);
  }
}

// acc[i][j] (lane l) = sum over k of x[m0 + 16 i + l][k] * W[n0 + j][k], then stored. ONCE: the
// weights are fetched non-temporally (gemm_out.h's prefetch_once), as the GEMVs' streams are: at
// one row vector each weight line is read once per call. Zen 5's 1 x 12 tiles take it (the
// benchmark checkpoint's 16-request decode step 12.44 -> 12.18 ms, 10 pairs on 2 Zen 5 cores); the
// 4 x 6 tiles keep the L2 prefetch: on a Zen 4 (their 1 x 6 tails at one row vector) the same step
// took 22.3-23.5 ms with it and 16.9-17.4 without (4 interleaved runs each); at 64 rows on Zen 5
// it cost too (38.5 -> 39.1).
template <int NV, int NC, bool ONCE = false>
inline void tile(const Args& a, int64_t m0, int64_t n0) {
  __m512 acc[NV][NC];
  for (int i = 0; i < NV; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* wr[NC];
  for (int j = 0; j < NC; ++j) wr[j] = a.w + (n0 + j) * a.ldw;
  const uint32_t* xk = a.xp + m0;
  for (int64_t kp = 0; kp < a.K / 2; ++kp, xk += a.mp) {
    if ((kp & 15) == 0)                                 // the next tile's weights, a line ahead
      for (int j = 0; j < NC; ++j) {
        const char* p = reinterpret_cast<const char*>(wr[j] + NC * a.ldw + 2 * kp);
        if constexpr (ONCE) prefetch_once(p);
        else prefetch(p);
      }
    __m512i xv[NV];
    for (int i = 0; i < NV; ++i) xv[i] = _mm512_loadu_si512(xk + i * L);
    for (int j = 0; j < NC; ++j) {
      const __m512i b = _mm512_set1_epi32(int(pair_at(wr[j] + 2 * kp)));
      for (int i = 0; i < NV; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv[i], (__m512bh)b);
    }
  }
  for (int i = 0; i < NV; ++i) store_any<NC>(a, acc[i], m0 + i * L, n0);
}

// a tile of nv <= NV row vectors and nc <= NC channels (tails take smaller instances)
template <int NV, int NC, bool ONCE>
inline void tile_any(const Args& a, int nv, int nc, int64_t m0, int64_t n0) {
  if constexpr (NV > 1) {
    if (nv < NV) return tile_any<NV - 1, NC, ONCE>(a, nv, nc, m0, n0);
  }
  if constexpr (NC > 1) {
    if (nc < NC) return tile_any<NV, NC - 1, ONCE>(a, nv, nc, m0, n0);
  }
  tile<NV, NC, ONCE>(a, m0, n0);
}

// threads over blocks of NC channels; each block walks down M, NV row vectors at a time
template <int NV, int NC, bool ONCE = false>
inline void run_tiles(const Args& a) {
  const int64_t nblocks = (a.N + NC - 1) / NC, vecs = a.mp / L;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / (std::max<int64_t>(a.K, 1) * NC));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NC;
      const int nc = int(std::min<int64_t>(NC, a.N - n0));
      for (int64_t v = 0; v < vecs; v += NV)
        tile_any<NV, NC, ONCE>(a, int(std::min<int64_t>(NV, vecs - v)), nc, v * L, n0);
    }
  });
}

// Channels per tile at 16 rows or fewer (one row vector): 6, or 12 where set (set_lanes_channels:
// Zen 5). A 1 x 6 tile is 6 accumulator chains, one VDPBF16PS a cycle at its latency; Zen 5 issues
// two a cycle at full width. 2 Zen 5 cores, ms, 6 vs 12 channels: 16 rows over a 248320 x 512 LM
// head 7.6 vs 5.6 (the read alone 4.7), over 49152 x 576 1.78 vs 1.22, 4096 x 512 0.132 vs 0.096;
// 12 rows 7.5 vs 5.4. Two row vectors already hold 12 chains: 2 x 12 was slower there (20-32
// rows over the large LM head 10 vs 12 ms).
inline int& wide_channels() {
  static int nc = 6;
  return nc;
}

// 4 x 6 tiles (their tails for fewer rows): more channels per tile for 16 or 32 rows were no
// faster on a Zen 4 (8, 12, 16 measured: the extra weight rows in flight cost more than the
// broadcasts save); 1 x 12 for one row vector where wide_channels() is 12, its weights non-temporal
inline void run(const Args& a) {
  if (wide_channels() == 12 && a.mp == L) return run_tiles<1, 12, true>(a);
  run_tiles<4, 6>(a);
}

}  // namespace lanes
}  // namespace bb
