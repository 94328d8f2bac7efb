// What the rows path's kernels (gemm.cpp's tiles, gemm_gemv.h) share: the output (Out), software
// prefetch, the store of a block's sums (scale, bias, fp32 or bf16) and the threads' split of the
// output channels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gemm_simd.h"

namespace bb {
namespace {

// software prefetch of weights PF_TILES tiles ahead, into L2 (into L1 it was slower: the L1 miss
// buffers fill up; measured on a Zen 4, 2x on the LM head's GEMV). On another Zen 4 (66 GB/s
// with 2 cores) distances of 8 to 128 KiB gave the same best-of-18 GEMV rate, 44 GB/s.
constexpr int PF_TILES = 2;
inline void prefetch(const void* p) {
#if defined(BB_SIMD_AVX512) || defined(BB_SIMD_AVX2)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// software prefetch of a weight line read once per call (the decode GEMVs' streams: gemm_gemv.h),
// non-temporal: the stream then leaves less of the rest of the step (activations, states, the
// interpreter's own working set) evicted from L2 / L3 behind it. Decode step of the CPU benchmark
// checkpoint on 2 Zen 5 cores, this vs `prefetch` above (into L2), 10 pairs at ~63-74 GB/s: one request
// 7.04 -> 6.70 ms (every pair faster), four 7.13 -> 6.67; after the 248320 x 512 LM head's GEMV
// a prepare_batch took 58-61 us in two of three tries (164 in the third) instead of 139-159 (and
// the GEMV itself 3.5-3.7 ms, 3.8-3.9)
inline void prefetch_once(const void* p) {
#if defined(BB_SIMD_AVX512) || defined(BB_SIMD_AVX2)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
#else
  __builtin_prefetch(p, 0, 0);
#endif
}

struct Out {                         // y [M, N] (fp32 or bf16), optional fp32 bias [N]
  float* yf; uint16_t* yb; int64_t ldy; const float* bias;
};

// y[m, n] = r (+ bias[n]) as fp32 or rounded to bf16: one output (the blocks' tails; whole groups of
// 4 go through store4)
inline void store1(float r, int64_t m, int64_t n, const Out& o) {
  r += o.bias ? o.bias[n] : 0.f;
  if (o.yf) o.yf[m * o.ldy + n] = r;
  else o.yb[m * o.ldy + n] = f32_to_bf16(r);
}

// store_sums without a K tail, 4 channels at a time (store4): the scalar loop below cost a fifth of
// a decode GEMV at 4 rows (a 4096 x 512 bf16 weight in cache: 43.5 us, 34.8 with the stores left out)
template <class F, int TM, int TN>
inline void store_sums4(const F& f, const float* sums, int64_t m0, int64_t n0, const Out& o) {
  for (int j0 = 0; j0 < TN; j0 += 4) {
    float sc[4];
    for (int j = 0; j < 4; ++j) sc[j] = f.row_scale(n0 + j0 + j);
    const float* bias = o.bias ? o.bias + n0 + j0 : nullptr;
    for (int i = 0; i < TM; ++i) {
      const int64_t at = (m0 + i) * o.ldy + n0 + j0;
      store4(sums + i * TN + j0, sc, bias, o.yf ? o.yf + at : nullptr, o.yb ? o.yb + at : nullptr);
    }
  }
}

// y[m0 + i, n0 + j] = sums[i * TN + j] + the K tail past kv, times the row scale, plus the bias
template <class F, int TM, int TN>
inline void store_sums(const F& f, const float* sums, const typename F::XT* xm, int64_t ldx, int64_t m0,
                       int64_t n0, int64_t K, int64_t kv, const Out& o) {
  if constexpr (TN % 4 == 0) {
    if (kv == K) return store_sums4<F, TM, TN>(f, sums, m0, n0, o);
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      const int64_t m = m0 + i, n = n0 + j;
      float s = sums[i * TN + j];
      for (int64_t k = kv; k < K; ++k) s += f.scalar(n, k) * F::xs(xm[i * ldx + k]);
      store1(s * f.row_scale(n), m, n, o);
    }
}

// every output channel in blocks of TN, threads over blocks: fn(n0, tn) with tn = TN, or 1 for
// each channel of the last, partial block
template <int TN, typename Fn>
inline void for_channel_blocks(int64_t N, int64_t K, Fn&& fn) {
  const int64_t nblocks = (N + TN - 1) / TN;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / (std::max<int64_t>(K, 1) * TN));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * TN;
      if (n0 + TN <= N) fn(n0, std::integral_constant<int, TN>{});
      else for (int64_t n = n0; n < N; ++n) fn(n, std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace
}  // namespace bb
