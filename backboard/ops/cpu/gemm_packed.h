// GEMM on bf16 weights kept a second time, K-interleaved, for CPUs that widen bf16 in registers
// (no VDPBF16PS: the avx2 and avx512 builds): every row count, decode's batches and prefill. The
// row-major weight [N, K] stays the weight of every other path (the tied embedding, the draft
// heads' quantization, a model too large for the copy).
//
//   packed [T, K, TN] bf16, TN = 2 VW channels a tile, T = ceil(N / TN) (zeros past N): at tile t,
//   step k, position 2j holds channel t TN + j and position 2j + 1 channel t TN + VW + j, so one
//   load widened by a shift and an and (vload_bf16x2) gives the tile's two vectors of channels at k
//
// y[m, tile] += x[m, k] broadcast * those two vectors: TM rows x 2 vector accumulators, no
// horizontal sums, one weight load and TM broadcasts for 2 TM FMAs, each tile one stream in
// address order. Bf16W's gemv_rows (gemm_gemv.h) does a channel at a time along K: 1 + 2 TM loads
// for the same FMAs and a transposing reduction per channel block. On 2 Zen 3 cores, the LM head
// 248320 x 512, min ms of 10 interleaved, gemv_rows vs this: 4 rows cold 13.2 vs 11.0, in L3
// (16392 x 512) 0.60 vs 0.38; 8 rows cold 20.5 vs 17.1.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "gemm_out.h"
#include "gemm_simd.h"

namespace bb {
namespace {
namespace packed {

constexpr int TN = 2 * VW;
// software prefetch distance along a tile's stream (2 Zen 3 cores, LM head at 4 rows cold, min ms,
// measured with a T0 hint: none 13.35, 512 B 12.15, 1 KiB 11.34, 2 KiB 10.97; 4 KiB even with 2).
// The hint is prefetch_once's NTA, as the other decode streams: even with T0 (min / median of 12
// interleaved, LM head at 4 rows 9.59 / 10.64 vs 9.76 / 10.54 ms, 64 rows 98.6 / 119.5 vs 96.7 / 125.4)
constexpr std::ptrdiff_t PF_BYTES = 2048;

// w [N, K] (row stride ldw) -> dst [T, K, TN]
inline void pack(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* dst) {
  const int64_t T = (N + TN - 1) / TN;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int j = 0; j < TN; ++j) {
        const int64_t n = t * TN + j;
        const int pos = j < VW ? 2 * j : 2 * (j - VW) + 1;
        uint16_t* d = dst + t * K * TN + pos;
        for (int64_t k = 0; k < K; ++k) d[k * TN] = n < N ? w[n * ldw + k] : uint16_t(0);
      }
  });
}

template <int TM>
inline void step(const uint16_t* wk, const float* x, int64_t ldx, int64_t k, VF (&a)[TM][2]) {
  VF lo, hi;
  vload_bf16x2(wk, lo, hi);
  for (int i = 0; i < TM; ++i) {
    const VF xb = vset1(x[i * ldx + k]);
    a[i][0] = vfma(lo, xb, a[i][0]);
    a[i][1] = vfma(hi, xb, a[i][1]);
  }
}

// rows m0 .. m0 + TM of one tile (wt: its [K, TN] weights) -> TM x TN sums in s
template <int TM>
inline void tile(const uint16_t* wt, const float* x, int64_t ldx, int64_t K, float* s) {
  VF a[TM][2];
  for (int i = 0; i < TM; ++i) a[i][0] = a[i][1] = vzero();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const char* p = reinterpret_cast<const char*>(wt + k * TN);
    for (int b = 0; b < 4 * TN; b += 64) prefetch_once(p + PF_BYTES + b);   // 2 steps' bytes
    step<TM>(wt + k * TN, x, ldx, k, a);
    step<TM>(wt + (k + 1) * TN, x, ldx, k + 1, a);
  }
  if (k < K) step<TM>(wt + k * TN, x, ldx, k, a);
  for (int i = 0; i < TM; ++i) {
    vstore(s + i * TN, a[i][0]);
    vstore(s + i * TN + VW, a[i][1]);
  }
}

// the sums of rows m0 .. m0 + TM, channels n0 .. n0 + nn (+ bias) into y
template <int TM>
inline void store(const float* s, int64_t m0, int64_t n0, int64_t nn, const Out& o) {
  static const float ones[4] = {1.f, 1.f, 1.f, 1.f};
  for (int i = 0; i < TM; ++i) {
    const int64_t at = (m0 + i) * o.ldy + n0;
    int64_t j = 0;
    for (; j + 4 <= nn; j += 4)
      store4(s + i * TN + j, ones, o.bias ? o.bias + n0 + j : nullptr, o.yf ? o.yf + at + j : nullptr,
             o.yb ? o.yb + at + j : nullptr);
    for (; j < nn; ++j) store1(s[i * TN + j], m0 + i, n0 + j, o);
  }
}

template <int TM>
inline void rows_at(const uint16_t* wt, const float* x, int64_t ldx, int64_t m0, int64_t K, int64_t n0,
                    int64_t nn, const Out& o) {
  float s[TM * TN];
  tile<TM>(wt, x + m0 * ldx, ldx, K, s);
  store<TM>(s, m0, n0, nn, o);
}

// rows m0 .. m0 + M of one tile: groups of 4 (the first from memory, the rest from L1 / L2), the
// last 1-3 rows a group
inline void rows_of(const uint16_t* wt, const float* x, int64_t ldx, int64_t m0, int64_t M, int64_t K,
                    int64_t n0, int64_t nn, const Out& o) {
  const int64_t end = m0 + M - M % 4;
  for (; m0 < end; m0 += 4) rows_at<4>(wt, x, ldx, m0, K, n0, nn, o);
  if (M % 4 == 3) rows_at<3>(wt, x, ldx, end, K, n0, nn, o);
  else if (M % 4 == 2) rows_at<2>(wt, x, ldx, end, K, n0, nn, o);
  else if (M % 4 == 1) rows_at<1>(wt, x, ldx, end, K, n0, nn, o);
}

// x's rows a thread takes through its tiles at a time: a block of about X_BLOCK bytes stays in L2
// while the tiles stream past it (whole, x was re-read from L3 per tile: 2 MiB at 1024 rows of K
// 512). Decode batches of K 512 are one block. On 2 Zen 3 cores (512 KiB L2), cold, min ms of 4-8
// interleaved, whole x vs 256 KiB blocks: 1544 x 512 at 1024 rows 10.47 vs 9.73, 2048 rows 25.5 vs
// 23.9; 4096 x 512 at 2048 rows 55.4 vs 53.6; 512 x 2048 at 2048 rows 33.2 vs 30.5, and its decode
// batches, now in blocks of 32 rows, at 64 rows 0.842 vs 0.802, 128 rows 1.660 vs 1.623 (128 KiB
// blocks within noise of 256)
constexpr int64_t X_BLOCK = 256 << 10;

inline int64_t row_block(int64_t K) {
  return std::max<int64_t>(4, X_BLOCK / (4 * std::max<int64_t>(K, 1)) / 4 * 4);
}

// x [M, K] fp32 (row stride ldx) on packed (N channels) -> y: threads over tiles, each thread
// taking its tiles through a block of rows at a time (row_block)
inline void run(const uint16_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t M, const Out& o) {
  const int64_t T = (N + TN - 1) / TN, MB = row_block(K);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / (std::max<int64_t>(K, 1) * TN));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t b0 = 0; b0 < M; b0 += MB)
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * TN;
        rows_of(w + t * K * TN, x, ldx, b0, std::min(MB, M - b0), K, n0, std::min<int64_t>(TN, N - n0), o);
      }
  });
}

}  // namespace packed
}  // namespace
}  // namespace bb
