// A 16 x 16 transpose of 32-bit elements in AVX-512 registers (any 32-bit payload: the shuffles
// move bits, so bf16 pairs pass through unchanged). Used to pack activations for the lanes and
// AMX GEMMs (gemm_lanes.h) and K panels for prefill attention (prefill_attention.h).
#pragma once

#include <immintrin.h>

namespace bb {
namespace simd16 {

// r[0..15] -> r[j][i] = old r[i][j] (a 16 x 16 fp32 transpose in 64 shuffles)
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];           // u[4b + c], 128-bit lane l: column 4l + c of rows 4b .. 4b + 3
  for (int i = 0; i < 16; i += 4) {
    const __m512d t0 = _mm512_castps_pd(t[i]), t1 = _mm512_castps_pd(t[i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[i + 2]), t3 = _mm512_castps_pd(t[i + 3]);
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int c = 0; c < 4; ++c) {             // a 4 x 4 transpose of 128-bit lanes per c
    const __m512 p0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 p2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 p3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(p0, p2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(p0, p2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(p1, p3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(p1, p3, 0xDD);
  }
}

}  // namespace simd16
}  // namespace bb
