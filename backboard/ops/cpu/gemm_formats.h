// The weight formats of the CPU GEMMs (gemm.cpp): how each kernel loads NV vectors of weights per
// STEP elements of K, paired with the activations it multiplies them by.
#pragma once

#include <cstdint>

#include "gemm_simd.h"

namespace bb {
namespace {

// ---- weight formats: NV vectors (WV) of weights per STEP elements of K ----------------------------
// load(n, k, out)   the weights of channel n at k .. k+STEP, paired with loadx(x + k + v * XLANES)
// at(n, k)          the address of those weights (software prefetch)
// scalar(n, k)      one weight as fp32 (the K tail), row_scale(n) applied after the dot product
// widen(n, dst, K)  channel n as fp32 in natural order, row scale applied (the prefill panel)

// x permuted in blocks of 2 VW (even elements, then odd: permute_x): a bf16 pair is widened by a
// shift and an and, half the work of widening element by element
struct Bf16W {                       // bf16 weights, fp32 activations
  static constexpr int STEP = 2 * VW, NV = 2, XLANES = VW;
  static constexpr bool WIDENED_TWO_ROW = true;   // gemv_rows up to GemvRows::widened_max_m rows
  using XT = float; using WV = VF; using XV = VF;
  const uint16_t* w; int64_t ldw;
  void load(int64_t n, int64_t k, WV* o) const { vload_bf16x2(w + n * ldw + k, o[0], o[1]); }
  const void* at(int64_t n, int64_t k) const { return w + n * ldw + k; }
  static XV loadx(const float* p) { return vload(p); }
  static VF fma(VF acc, WV a, XV b) { return vfma(a, b, acc); }
  static float xs(float v) { return v; }
  float scalar(int64_t n, int64_t k) const { return bf16_to_f32(w[n * ldw + k]); }
  float row_scale(int64_t) const { return 1.f; }
  int64_t vector_k(int64_t K) const { return K - K % STEP; }
  void widen(int64_t n, float* dst, int64_t K) const {
    const uint16_t* s = w + n * ldw;
    int64_t k = 0;
    for (; k + VW <= K; k += VW) vstore(dst + k, vload_bf16(s + k));
    for (; k < K; ++k) dst[k] = bf16_to_f32(s[k]);
  }
};

struct Int8W {                       // int8 weights, fp32 scale per output channel
  static constexpr int STEP = VW, NV = 1, XLANES = VW;
#if defined(BB_SIMD_AVX2)
  static constexpr bool TWO_ROW_GEMV = true;   // AVX2's 4 x 2 tiles lost to gemv_rows here (gemm.cpp)
#endif
  using XT = float; using WV = VF; using XV = VF;
  const int8_t* q; int64_t ldq; const float* scale;
  void load(int64_t n, int64_t k, WV* o) const { o[0] = vload_i8(q + n * ldq + k); }
  const void* at(int64_t n, int64_t k) const { return q + n * ldq + k; }
  static XV loadx(const float* p) { return vload(p); }
  static VF fma(VF acc, WV a, XV b) { return vfma(a, b, acc); }
  static float xs(float v) { return v; }
  float scalar(int64_t n, int64_t k) const { return float(q[n * ldq + k]); }
  float row_scale(int64_t n) const { return scale[n]; }
  int64_t vector_k(int64_t K) const { return K - K % STEP; }
  void widen(int64_t n, float* dst, int64_t K) const {
    const int8_t* s = q + n * ldq;
    const float sc = scale[n];
    for (int64_t k = 0; k < K; ++k) dst[k] = float(s[k]) * sc;
  }
};

// int4: byte j holds element 2j (low nibble) and 2j+1 (high), stored as q + 8; one fp32 scale per
// group of G elements. A step of 2*VW elements is one load of VW bytes giving the even elements
// (lo) and the odd ones (hi), paired with x permuted as for Bf16W. Steps never straddle a group
// when G % STEP == 0.
struct Int4W {
  static constexpr int STEP = 2 * VW, NV = 2, XLANES = VW;
  using XT = float; using WV = VF; using XV = VF;
  const uint8_t* q; int64_t ldq; const float* sc; int64_t lds; int64_t G;
  void load(int64_t n, int64_t k, WV* o) const {
    VF s = vset1(sc[n * lds + k / G]);
    VF m8 = vset1(-8.f * sc[n * lds + k / G]);
    vload_u4(q + n * ldq + k / 2, o[0], o[1]);
    o[0] = vfma(o[0], s, m8);         // (u - 8) * s
    o[1] = vfma(o[1], s, m8);
  }
  const void* at(int64_t n, int64_t k) const { return q + n * ldq + k / 2; }
  static XV loadx(const float* p) { return vload(p); }
  static VF fma(VF acc, WV a, XV b) { return vfma(a, b, acc); }
  static float xs(float v) { return v; }
  float scalar(int64_t n, int64_t k) const {
    uint8_t b = q[n * ldq + k / 2];
    int u = (k & 1) ? (b >> 4) : (b & 15);
    return float(u - 8) * sc[n * lds + k / G];
  }
  float row_scale(int64_t) const { return 1.f; }
  int64_t vector_k(int64_t K) const { return G % STEP == 0 ? K - K % STEP : 0; }
  void widen(int64_t n, float* dst, int64_t K) const {
    const uint8_t* s = q + n * ldq;
    for (int64_t j = 0; j < K / 2; ++j) {
      float g = sc[n * lds + (2 * j) / G];
      dst[2 * j] = float((s[j] & 15) - 8) * g;
      dst[2 * j + 1] = float((s[j] >> 4) - 8) * g;
    }
  }
};

#if defined(BB_ISA_AVX512_BF16)
struct Bf16Dp {                      // bf16 weights, bf16 activations: VDPBF16PS
  static constexpr int STEP = 32, NV = 1, XLANES = 32;
  static constexpr bool TWO_ROW_GEMV = true;   // gemm.cpp's gemv_rows pays for this format only
  using XT = uint16_t; using WV = __m512i; using XV = __m512i;
  const uint16_t* w; int64_t ldw;
  void load(int64_t n, int64_t k, WV* o) const {
    o[0] = _mm512_loadu_si512(w + n * ldw + k);
    asm volatile("" : "+v"(o[0]));   // keep it in a register: GCC otherwise reloads it for every row
  }
  const void* at(int64_t n, int64_t k) const { return w + n * ldw + k; }
  static XV loadx(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static VF fma(VF acc, WV a, XV b) { return {_mm512_dpbf16_ps(acc.v, (__m512bh)b, (__m512bh)a)}; }
  static float xs(uint16_t v) { return bf16_to_f32(v); }
  float scalar(int64_t n, int64_t k) const { return bf16_to_f32(w[n * ldw + k]); }
  float row_scale(int64_t) const { return 1.f; }
  int64_t vector_k(int64_t K) const { return K - K % STEP; }
};
#endif

}  // namespace
}  // namespace bb
