// Paged attention pieces for bf16 KV caches on CPUs with AVX512-BF16 (VDPBF16PS: 32 bf16
// products per instruction, fp32 accumulation): the scores q . k on q and k as stored, and the
// PV product with the probabilities rounded to bf16 (as torch's bf16 SDPA does before its PV
// GEMM) against V as stored. Nothing is widened to fp32 first. Included by paged_attention.h;
// empty on other ISA levels.
#pragma once

#include "simd.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

// tokens per softmax update (the scores of a chunk at once); a chunk spans cache blocks. 64 in
// place of one 16-token block, bf16, 2 Zen 5 cores: one request's decode over 9 heads / 3 KV heads
// of 64 (SmolLM2), cache warm, 34.2 -> 31.7 us at 1024 tokens, 289 -> 264 at 8192; 32 / 8 of 128
// at 8192 tokens 3.5-4.3 -> 3.1-3.2 ms; 4 / 2 of 256 the same within noise. SmolLM2's whole decode
// step: one request 10.99 -> 10.77 ms at 256 tokens, 13.19 -> 12.45 at 1024; 4 / 16 requests at
// 300 tokens 12.03 -> 11.81 / 21.30 -> 20.63
constexpr int64_t kAttnChunk = 64;

#if defined(BB_ISA_AVX512_BF16)
// bf16 caches with AVX512-BF16: s[g][j] = scale * (q_g . k_j) by the bf16 pair dot product
// (VDPBF16PS, 32 products per instruction, fp32 accumulation) on q and k as they are stored,
// without widening either (the reference's bf16 SDPA also multiplies bf16 q and k)
constexpr bool kBf16Dot = true;

template <int G>
inline void group_scores_bf16(const bf16* q, int64_t D, const bf16* const* krows, int64_t n, float scale,
                              float* s) {
  for (int64_t j = 0; j < n; ++j) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 mk = D - d >= 32 ? ~__mmask32(0) : __mmask32((1u << (D - d)) - 1u);
      const __m512i kv = _mm512_maskz_loadu_epi16(mk, krows[j] + d);
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_maskz_loadu_epi16(mk, q + g * D + d), (__m512bh)kv);
    }
    for (int g = 0; g < G; ++g) s[g * kAttnChunk + j] = _mm512_reduce_add_ps(acc[g]) * scale;
  }
}

inline void chunk_scores_bf16(const bf16* q, int64_t M, int64_t D, const bf16* const* krows, int64_t n,
                              float scale, float* s) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) group_scores_bf16<4>(q + m * D, D, krows, n, scale, s + m * kAttnChunk);
  for (; m < M; ++m) group_scores_bf16<1>(q + m * D, D, krows, n, scale, s + m * kAttnChunk);
}

// acc rows [G, D] = acc * alpha + P V over the chunk's n keys, 32 columns per pair of zmm
// accumulators: VPUNPCK{L,H}WD interleave the rows of keys j and j+1 into (v_j[c], v_j+1[c])
// pairs, which leaves each 32 columns in the order [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, ...]
// (unpermute_pair_columns restores it once at the end). Each key pair is unpacked once for G rows.
template <int G, int NC>
inline void pv_block_bf16(float* acc, int64_t D, const float* alpha, const uint32_t* pp, const bf16* const* v,
                          int64_t n, int64_t d0) {
  __m512 x[G][2 * NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NC; ++c)
      x[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d0 + 16 * c), _mm512_set1_ps(alpha[g]));
  for (int64_t j = 0; j < n; j += 2) {
    __m512i lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i va = _mm512_loadu_si512(v[j] + d0 + 32 * c);
      const __m512i vb = j + 1 < n ? _mm512_loadu_si512(v[j + 1] + d0 + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(va, vb);
      hi[c] = _mm512_unpackhi_epi16(va, vb);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(int(pp[g * (kAttnChunk / 2) + j / 2]));
      for (int c = 0; c < NC; ++c) {
        x[g][2 * c] = _mm512_dpbf16_ps(x[g][2 * c], (__m512bh)lo[c], pj);
        x[g][2 * c + 1] = _mm512_dpbf16_ps(x[g][2 * c + 1], (__m512bh)hi[c], pj);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, x[g][c]);
}

template <int G>
inline void pv_group_bf16(float* acc, const float* alpha, const float* p, const bf16* const* v, int64_t n,
                          int64_t D) {
  uint32_t pp[G * (kAttnChunk / 2)];                        // (p_j, p_j+1) as a bf16 pair
  for (int g = 0; g < G; ++g)
    for (int64_t j = 0; j < n; j += 2) {
      const float* pg = p + g * kAttnChunk;
      pp[g * (kAttnChunk / 2) + j / 2] =
          uint32_t(f32_to_bf16(pg[j])) | uint32_t(j + 1 < n ? f32_to_bf16(pg[j + 1]) : 0) << 16;
    }
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_block_bf16<G, 2>(acc, D, alpha, pp, v, n, d);
  if (d < D) pv_block_bf16<G, 1>(acc, D, alpha, pp, v, n, d);
}

// acc [M, D] (D % 32 == 0), p [M, kAttnChunk] probabilities, alpha [M], v: n key rows
inline void pv_rows_bf16(float* acc, const float* alpha, const float* p, int64_t M, const bf16* const* v,
                         int64_t n, int64_t D) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) pv_group_bf16<4>(acc + m * D, alpha + m, p + m * kAttnChunk, v, n, D);
  for (; m + 2 <= M; m += 2) pv_group_bf16<2>(acc + m * D, alpha + m, p + m * kAttnChunk, v, n, D);
  for (; m < M; ++m) pv_group_bf16<1>(acc + m * D, alpha + m, p + m * kAttnChunk, v, n, D);
}

// undo the unpack order of pv_block_bf16 in one accumulator row
inline void unpermute_pair_columns(float* row, int64_t D) {
  float tmp[32];
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    std::copy(row + d0, row + d0 + 32, tmp);
    for (int i = 0; i < 16; ++i) {
      row[d0 + 8 * (i / 4) + i % 4] = tmp[i];
      row[d0 + 8 * (i / 4) + 4 + i % 4] = tmp[16 + i];
    }
  }
}
#endif

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
