// The decode GEMVs of gemm.cpp's rows path that read the weights in address order: one row of x
// (gemv) and 2-4 rows (gemv_rows; on AVX2 Zen 3s up to 48, in groups of 4), each channel start to
// end before the next.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gemm_out.h"
#include "gemm_simd.h"

namespace bb {
namespace {

// One row of x (the decode GEMV): TN channels one after another, each read start to end with U
// accumulators along K, so the weights stream in address order. The 1 x 8 tile, which reads 8
// channels side by side, ran the LM head's GEMV at 0.55-0.75x this order's rate on a Zen 4 (the
// prefetchers follow one stream, not eight 1 KiB rows interleaved), and at M = 1 it was slower
// than the 4 x 4 tile at M = 4.
constexpr int GEMV_U = 4;
// software prefetch distance along the stream: 2 KiB measured on Zen 4 / 5 (AVX-512 builds); on a
// Zen 3 (AVX2) 1 KiB, 48 cold layer-sized GEMVs (75 MB) / the 248320 x 512 LM head, best of 18, ms:
// 1 KiB 4.18 / 8.66, 512 B 4.25 / 9.01, 1.5 KiB 4.58 / 9.64, 2 KiB 5.16 / 9.85, none 4.85 / 10.04
#if defined(BB_SIMD_AVX2)
constexpr std::ptrdiff_t GEMV_PF_BYTES = 1024;
#else
constexpr std::ptrdiff_t GEMV_PF_BYTES = 2048;
#endif

// the lines of channel n's weights at k .. k_end, `ahead` bytes ahead along the stream
template <class F>
inline void prefetch_stream(const F& f, int64_t n, int64_t k, int64_t k_end, std::ptrdiff_t ahead = GEMV_PF_BYTES) {
  const char* p = static_cast<const char*>(f.at(n, k));
  const std::ptrdiff_t span = static_cast<const char*>(f.at(n, k_end)) - p;
  for (std::ptrdiff_t b = 0; b < span; b += 64) prefetch_once(p + ahead + b);
}

// acc + w(n, k ..) . x(k ..): one STEP of channel n
template <class F>
inline VF gemv_step(const F& f, const typename F::XT* x, int64_t n, int64_t k, VF acc) {
  typename F::WV w[F::NV];
  f.load(n, k, w);
  for (int v = 0; v < F::NV; ++v) acc = F::fma(acc, w[v], F::loadx(x + k + v * F::XLANES));
  return acc;
}

template <class F>
inline VF gemv_channel(const F& f, const typename F::XT* x, int64_t n, int64_t kv) {
  constexpr int64_t S = F::STEP;
  VF a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t k = 0;
  for (; k + GEMV_U * S <= kv; k += GEMV_U * S) {
    prefetch_stream(f, n, k, k + GEMV_U * S);
    a0 = gemv_step(f, x, n, k, a0);
    a1 = gemv_step(f, x, n, k + S, a1);
    a2 = gemv_step(f, x, n, k + 2 * S, a2);
    a3 = gemv_step(f, x, n, k + 3 * S, a3);
  }
  for (; k < kv; k += S) a0 = gemv_step(f, x, n, k, a0);
  return vadd(vadd(a0, a1), vadd(a2, a3));
}

template <class F, int TN>
inline void gemv_block(const F& f, const typename F::XT* x, int64_t n0, int64_t K, int64_t kv, const Out& o) {
  static_assert(GEMV_U == 4, "gemv_channel sums four accumulators");
  VF acc[TN];
  for (int j = 0; j < TN; ++j) acc[j] = gemv_channel(f, x, n0 + j, kv);
  float sums[TN];
  if constexpr (TN == 8) vsum_8(acc, sums);
  else for (int j = 0; j < TN; ++j) sums[j] = vsum(acc[j]);
  store_sums<F, 1, TN>(f, sums, x, 0, 0, n0, K, kv, o);
}

template <class F>
void gemv(const F& f, const typename F::XT* x, int64_t N, int64_t K, const Out& o) {
  const int64_t kv = f.vector_k(K);
  for_channel_blocks<8>(N, K, [&](int64_t n0, auto tn) { gemv_block<F, decltype(tn)::value>(f, x, n0, K, kv, o); });
}

// Two rows over a large weight (the LM head at decode of two requests or a k = 1 verify): the
// GEMV's address order with each weight vector feeding both rows. The MB x NB tile reads NB
// channels side by side; A/B on a Zen 4 (bf16): LM head 248320 x 512 9.2 -> 5.1 ms (the GEMV at
// one row: 4.0), 49152 x 576 1.72 -> 1.24 ms; on layer-sized weights (3 MB and less) no
// difference, and at 3-4 rows this order lost to the tiles (LM head 4 rows 10.4 vs 7.5 ms).
// Only for bf16 x on bf16 weights (VDPBF16PS) and short rows: A/B on a Zen 4 at two rows, gemv_rows
// vs tiles, us: bf16 x 49152 x 576 1564 vs 1768, 248320 x 512 7996 vs 9700, but 8192 x 2048 762 vs
// 442 and 2048 x 8192 978 vs 542; fp32 x lost on every shape (49152 x 576 1983 vs 1035), and int8
// weights too (49152 x 576 1311 vs 1081, 248320 x 512 5237 vs 4028). The avx2 build (on the same
// Zen 4): bf16 weights lost 25-44% to the tiles; int8 weights won by 5-11% at K <= 576 (AVX2's
// 4 x 2 tile), lost 12% at K = 8192
constexpr int64_t GEMV_ROWS_MIN_WEIGHTS = int64_t(8) << 20;    // elements
constexpr int64_t GEMV_ROWS_MAX_K = 1024;
// steps of K in flight per row: 4 rows x 4 accumulators + 4 weight vectors fit the 32 registers (2
// steps: 4 rows over a 4096 x 512 weight in cache at 181 G MAC/s on 2 Zen 5 cores, 4 steps: 196)
constexpr int GEMV_ROWS_U = 4;
// gemv_rows prefetches further ahead than the one-row GEMV: with 2-4 rows of arithmetic per weight
// byte, 2 KiB ahead left the LM head's 4-row GEMV short of the memory rate (248320 x 512 on 2 Zen 5
// cores reading ~81 GB/s, ms at 2 / 4 / 8 / 16 KiB: 2 rows 4.27 / 3.97 / 3.96 / 4.09, 3 rows
// 3.86 / 3.60 / 3.33 / 3.55, 4 rows 3.77 / 3.40 / 3.03 / 3.03; one row at 2 KiB: 3.35; at ~53 GB/s
// the 4-row GEMV took 4.9 ms at 2 and 8 KiB alike; measured with the L2 prefetch, before prefetch_once).
// AVX2 builds 1 KiB, as their one-row GEMV: on 2 Zen 3 cores, the LM head min / median ms of 8-10
// interleaved, 8 KiB vs 1 KiB: 2 rows 9.70 / 10.07 vs 7.33 / 7.89 and 10.32 / 10.55 vs 8.23 / 9.03,
// 3 rows 10.60 / 11.54 vs 9.38 / 10.22, 4 rows 11.29 / 11.80 vs 10.64 / 11.84 (512 B - 16 KiB
// tried; the hint, NTA or T0, the same), 8-32 rows within noise
#if defined(BB_SIMD_AVX2)
constexpr std::ptrdiff_t GEMV_ROWS_PF_BYTES = 1024;
#else
constexpr std::ptrdiff_t GEMV_ROWS_PF_BYTES = 8192;
#endif

template <class F, class = void>
struct two_row_gemv : std::false_type {};           // formats opt in with TWO_ROW_GEMV
template <class F>
struct two_row_gemv<F, std::void_t<decltype(F::TWO_ROW_GEMV)>> : std::bool_constant<F::TWO_ROW_GEMV> {};

// Where the address order pays more widely, Python sets these at load (gemm.GEMV_ROWS_WIDE: on a
// Zen 5, 2 to 4 rows over every short-row weight; the tiles streamed a decode step's weights at
// 29-31 GB/s there, this order at 39-42, one row's GEMV at 44)
// Bf16 weights widened in registers (Bf16W: builds without VDPBF16PS, and fp32 x) take gemv_rows
// only up to widened_max_m rows, 0 (never) unless set at load: the avx2 build on a Zen 4 lost
// 25-44% to the tiles at two rows (above), on an AVX2-only Zen 3 it won (gemm.WIDENED_GEMV_ROWS)
struct GemvRows {
  int64_t max_m = 2, min_weights = GEMV_ROWS_MIN_WEIGHTS, max_k = GEMV_ROWS_MAX_K;
  int64_t widened_max_m = 0;
};
inline GemvRows& gemv_rows_setting() {
  static GemvRows s;
  return s;
}

template <class F, class = void>
struct widened_two_row : std::false_type {};        // formats under widened_max_m: WIDENED_TWO_ROW
template <class F>
struct widened_two_row<F, std::void_t<decltype(F::WIDENED_TWO_ROW)>> : std::bool_constant<F::WIDENED_TWO_ROW> {};

// gemv_rows: M rows in groups of 4 (the last 1-3 rows a group of their own; 2-4 rows are one
// group), each block of 8 channels through every group before the next: the block's weights come
// from memory once, then from L1 (those later groups 2 channels at a time: gemv_rows_pair). Beyond
// 4 rows (up to GEMV_ROW_GROUPS_MAX) only for bf16 weights widened in registers where widened_max_m
// is 4 (AVX2 Zen 3s: gemv_rows_pays), in place of the 4 x 2 tiles (2 channels read side by side,
// each 4 x 2 outputs reduced on their own). On 2 Zen 3 cores, the LM head 248320 x 512, min /
// median ms of 12 interleaved, tiles vs groups: 13 rows 31.20 / 31.78 vs 28.26 / 28.63, 16 rows
// 36.66 / 37.26 vs 33.34 / 34.98, 32 rows 72.33 / 73.22 vs 66.11 / 67.62, 48 rows 107.2 / 112.1 vs
// 96.9 / 99.4; the benchmark checkpoint's 16-request decode step 53.00 / 54.24 -> 50.04 / 51.13 and
// 52.67 / 54.35 -> 49.18 / 50.78 (8 and 12 requests within 1-3%)
constexpr int64_t GEMV_ROW_GROUPS_MAX = 48;

template <class F>
inline bool gemv_rows_pays(int64_t M, int64_t N, int64_t K) {
  const GemvRows& s = gemv_rows_setting();
  int64_t max_m = widened_two_row<F>::value ? s.widened_max_m : two_row_gemv<F>::value ? s.max_m : 0;
  if (widened_two_row<F>::value && max_m == 4) max_m = GEMV_ROW_GROUPS_MAX;   // and on in groups of 4
  return M >= 2 && M <= max_m && K <= s.max_k && N * K >= s.min_weights;
}

// AVX2 has 16 registers: 4 rows x 4 steps of accumulators spilled (the bf16 weights' 4-row
// gemv_rows lost to the tiles on a Zen 3); 4 rows keep 2 steps (8 FMA chains, one weight step of
// 2 vectors loaded at a time). LM head 248320 x 512 on 2 Zen 3 cores, min / median ms of 14,
// interleaved: 4 rows 12.8-13.3 / 15.3 (4 steps: 15.5 / 17.9, tiles 15.0 / 17.3; 3 steps 13.8 /
// 15.6); 3 rows the same at 3 or 4 steps (13.7-13.8 / 14.9-15.3)
template <int TM>
constexpr int gemv_rows_u() {
#if defined(BB_SIMD_AVX2)
  return TM <= 3 ? GEMV_ROWS_U : 2;
#else
  return GEMV_ROWS_U;
#endif
}

template <class F, int TM>
inline void gemv_rows_channel(const F& f, const typename F::XT* x, int64_t ldx, int64_t n, int64_t kv, VF* acc) {
  constexpr int64_t S = F::STEP;
  constexpr int U = gemv_rows_u<TM>();
  VF a[TM][U];
  for (int i = 0; i < TM; ++i)
    for (int u = 0; u < U; ++u) a[i][u] = vzero();
  int64_t k = 0;
  for (; k + U * S <= kv; k += U * S) {
    prefetch_stream(f, n, k, k + U * S, GEMV_ROWS_PF_BYTES);
    for (int u = 0; u < U; ++u) {
      typename F::WV w[F::NV];
      f.load(n, k + u * S, w);
      for (int v = 0; v < F::NV; ++v)
        for (int i = 0; i < TM; ++i)
          a[i][u] = F::fma(a[i][u], w[v], F::loadx(x + i * ldx + k + u * S + v * F::XLANES));
    }
  }
  for (; k < kv; k += S) {
    typename F::WV w0[F::NV];
    f.load(n, k, w0);
    for (int v = 0; v < F::NV; ++v)
      for (int i = 0; i < TM; ++i) a[i][0] = F::fma(a[i][0], w0[v], F::loadx(x + i * ldx + k + v * F::XLANES));
  }
  for (int i = 0; i < TM; ++i) {
    VF t = a[i][0];
    for (int u = 1; u < U; ++u) t = vadd(t, a[i][u]);
    acc[i] = t;
  }
}

// 4 rows x 2 channels side by side, each x vector loaded once for both channels: 10 loads for 16
// FMAs a step, where one channel at a time (gemv_rows_channel) issues 9 for 8. Two streams side
// by side are what the prefetchers follow worse, so only for the groups after a block's first,
// whose weights come from L1 (gemv_rows). On 2 Zen 3 cores, the LM head min ms of 8 interleaved,
// cold / in cache: 8 rows 17.8 / 14.1 -> 17.3 / 13.0, 16 rows 31.3 / 29.7 -> 28.7 / 26.0, 32 rows
// 62.6 / 60.7 -> 53.5 / 53.5 (pairs in the first group too: 4 rows cold 10.5 -> 14.8); decode
// steps, median of 16 interleaved: 16 requests 48.4 -> 44.1 and 48.4 -> 45.7 ms, 32 requests
// 98.7 -> 81.8, 8 requests 28.8 -> 28.2
template <class F>
inline void gemv_rows_pair_step(const F& f, const typename F::XT* x, int64_t ldx, int64_t n, int64_t k,
                                VF (*a)[2]) {
  typename F::WV w0[F::NV], w1[F::NV];
  f.load(n, k, w0);
  f.load(n + 1, k, w1);
  for (int v = 0; v < F::NV; ++v)
    for (int i = 0; i < 4; ++i) {
      typename F::XV xv = F::loadx(x + i * ldx + k + v * F::XLANES);
      vpin(xv);
      a[i][0] = F::fma(a[i][0], w0[v], xv);
      a[i][1] = F::fma(a[i][1], w1[v], xv);
    }
}

template <class F>
inline void gemv_rows_pair(const F& f, const typename F::XT* x, int64_t ldx, int64_t n, int64_t kv, VF* acc0,
                           VF* acc1) {
  constexpr int64_t S = F::STEP;
  VF a[4][2];
  for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = vzero();
  int64_t k = 0;
  for (; k + 2 * S <= kv; k += 2 * S) {
    gemv_rows_pair_step(f, x, ldx, n, k, a);
    gemv_rows_pair_step(f, x, ldx, n, k + S, a);
  }
  for (; k < kv; k += S) gemv_rows_pair_step(f, x, ldx, n, k, a);
  for (int i = 0; i < 4; ++i) {
    acc0[i] = a[i][0];
    acc1[i] = a[i][1];
  }
}

// a row's TN = 8 sums in one transposing reduction (vsum_8), as the one-row GEMV does (summed one
// vector at a time: the LM head at 4 rows 4.2 -> 3.9 ms on 2 Zen 5 cores reading ~80 GB/s)
template <class F, int TM, int TN, bool PAIRS = false>
inline void gemv_rows_block(const F& f, const typename F::XT* x, int64_t ldx, int64_t n0, int64_t K, int64_t kv,
                            const Out& o) {
  VF acc[TN][TM], row[TN];
  if constexpr (PAIRS && TM == 4 && TN % 2 == 0) {
    for (int j = 0; j < TN; j += 2) gemv_rows_pair<F>(f, x, ldx, n0 + j, kv, acc[j], acc[j + 1]);
  } else {
    for (int j = 0; j < TN; ++j) gemv_rows_channel<F, TM>(f, x, ldx, n0 + j, kv, acc[j]);
  }
  float sums[TM * TN];
  for (int i = 0; i < TM; ++i) {
    for (int j = 0; j < TN; ++j) row[j] = acc[j][i];
    if constexpr (TN == 8) vsum_8(row, sums + i * TN);
    else for (int j = 0; j < TN; ++j) sums[i * TN + j] = vsum(row[j]);
  }
  store_sums<F, TM, TN>(f, sums, x, ldx, 0, n0, K, kv, o);
}

template <class F, int TM, int TN, bool PAIRS = false>
inline void gemv_rows_at(const F& f, const typename F::XT* x, int64_t ldx, int64_t m0, int64_t n0, int64_t K,
                         int64_t kv, const Out& o) {
  const Out om{o.yf ? o.yf + m0 * o.ldy : nullptr, o.yb ? o.yb + m0 * o.ldy : nullptr, o.ldy, o.bias};
  gemv_rows_block<F, TM, TN, PAIRS>(f, x + m0 * ldx, ldx, n0, K, kv, om);
}

template <class F>
void gemv_rows(const F& f, const typename F::XT* x, int64_t ldx, int64_t M, int64_t N, int64_t K,
               const Out& o) {
  const int64_t kv = f.vector_k(K), whole = M - M % 4;
  for_channel_blocks<8>(N, K, [&](int64_t n0, auto tn) {
    constexpr int TN = decltype(tn)::value;
    if (whole > 0) gemv_rows_at<F, 4, TN>(f, x, ldx, 0, n0, K, kv, o);   // the block from memory
    for (int64_t m0 = 4; m0 < whole; m0 += 4) gemv_rows_at<F, 4, TN, true>(f, x, ldx, m0, n0, K, kv, o);
    if (M % 4 == 3) gemv_rows_at<F, 3, TN>(f, x, ldx, whole, n0, K, kv, o);
    else if (M % 4 == 2) gemv_rows_at<F, 2, TN>(f, x, ldx, whole, n0, K, kv, o);
    else if (M % 4 == 1) gemv_rows_at<F, 1, TN>(f, x, ldx, whole, n0, K, kv, o);
  });
}

}  // namespace
}  // namespace bb
