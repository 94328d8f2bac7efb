// One fp32 vector type per ISA level (chosen by the BB_ISA_<LEVEL> macro that build.py passes),
// with the loads the GEMM kernels need: bf16 / int8 / packed-int4 weights widened to fp32 in
// registers (and vsum_vw / vsum_8: the sums of many vectors at once). VW: fp32 lanes.
//
//   AVX-512 (avx512, avx512_bf16): __m512, 16 lanes
//   AVX2:                          __m256, 8 lanes
//   portable:                      float[8] in plain loops (the compiler vectorises what it can)
#pragma once

#include <cstdint>
#include <cstring>

#if defined(BB_ISA_AVX512_BF16) || defined(BB_ISA_AVX512)
#define BB_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(BB_ISA_AVX2)
#define BB_SIMD_AVX2 1
#include <immintrin.h>
#endif

namespace bb {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest even, NaN stays NaN (what torch's .to(bfloat16) does)
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

#if defined(BB_SIMD_AVX512)
constexpr int VW = 16;
struct VF { __m512 v; };
inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vset1(float s) { return {_mm512_set1_ps(s)}; }
inline VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
inline VF vfma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF vadd(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
// keep v (a VF or a raw vector: Bf16Dp's __m512i) in a register where it is used several times
// (GCC otherwise folds a reload into each use)
inline void vpin(VF& v) { asm volatile("" : "+v"(v.v)); }
template <class T>
inline void vpin(T& v) { asm volatile("" : "+v"(v)); }
inline float vsum(VF a) { return _mm512_reduce_add_ps(a.v); }
// 16 bf16 -> fp32 (a bf16 is the top half of an fp32)
inline VF vload_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// 2 VW bf16 -> the even elements (0, 2, ..) and the odd ones as fp32: one shift, one and
inline void vload_bf16x2(const uint16_t* p, VF& even, VF& odd) {
  __m512i r = _mm512_loadu_si512(p);
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline VF vload_i8(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
// 16 bytes = 32 nibbles: lo = the low nibbles (elements 0, 2, .., 30), hi = the high ones, as floats
inline void vload_u4(const uint8_t* p, VF& lo, VF& hi) {
  __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(u, _mm512_set1_epi32(15)));
  hi.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(u, 4));
}
// the sums of VW (or 8) vectors at once (out[i] = vsum(v[i])): a transposing add tree, 45
// instructions for 16 vectors where one vsum each takes ~9
// per 128-bit lane L of the result: the partial sums over lane L of v[0], v[1], v[2], v[3]
inline __m512 vsum4_lanes(const VF* v) {
  __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(v[0].v, v[1].v), _mm512_unpackhi_ps(v[0].v, v[1].v));
  __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(v[2].v, v[3].v), _mm512_unpackhi_ps(v[2].v, v[3].v));
  return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
}
inline void vsum_8(const VF* v, float* out) {
  __m512 t0 = vsum4_lanes(v), t1 = vsum4_lanes(v + 4);
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x44), _mm512_shuffle_f32x4(t0, t1, 0xEE));
  __m512 r = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0xB1));   // lane 0: t0's sums, lane 2: t1's
  _mm_storeu_ps(out, _mm512_castps512_ps128(r));
  _mm_storeu_ps(out + 4, _mm512_extractf32x4_ps(r, 2));
}
inline void vsum_vw(const VF* v, float* out) {
  __m512 t[4];
  for (int g = 0; g < 4; ++g) {
    t[g] = vsum4_lanes(v + 4 * g);
  }
  __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x44), _mm512_shuffle_f32x4(t[0], t[1], 0xEE));
  __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x44), _mm512_shuffle_f32x4(t[2], t[3], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));
  _mm512_storeu_ps(out, r);
}
#elif defined(BB_SIMD_AVX2)
constexpr int VW = 8;
struct VF { __m256 v; };
inline VF vzero() { return {_mm256_setzero_ps()}; }
inline VF vset1(float s) { return {_mm256_set1_ps(s)}; }
inline VF vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, VF a) { _mm256_storeu_ps(p, a.v); }
inline VF vfma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vmul(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VF vadd(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline void vpin(VF& v) { asm volatile("" : "+x"(v.v)); }
template <class T>
inline void vpin(T& v) { asm volatile("" : "+x"(v)); }
inline float vsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void vsum_vw(const VF* v, float* out);
inline void vsum_8(const VF* v, float* out) { vsum_vw(v, out); }
inline void vsum_vw(const VF* v, float* out) {       // 8 vectors -> their 8 sums
  __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0].v, v[1].v), _mm256_hadd_ps(v[2].v, v[3].v));
  __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4].v, v[5].v), _mm256_hadd_ps(v[6].v, v[7].v));
  // h0: per 128-bit half, [v0 v1 v2 v3] partial sums over that half
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                      _mm256_permute2f128_ps(h0, h1, 0x31)));
}
inline VF vload_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline void vload_bf16x2(const uint16_t* p, VF& even, VF& odd) {
  // one load in a register: GCC otherwise folds a second load of p into the and (20 loads a
  // 4-row gemv_rows iteration instead of 18, for 16 FMAs; on 2 Zen 3 cores the LM head at 4 rows
  // in cache 7.87 -> 7.21 ms, 16 rows 31.5 -> 29.2; 4- and 16-request steps 3-5% faster)
  __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  vpin(r);
  even.v = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
  odd.v = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline VF vload_i8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
}
// 8 bytes = 16 nibbles
inline void vload_u4(const uint8_t* p, VF& lo, VF& hi) {
  __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo.v = _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15)));
  hi.v = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4));
}
#else
constexpr int VW = 8;
struct VF { float v[VW]; };
inline VF vzero() { VF r; for (int i = 0; i < VW; ++i) r.v[i] = 0.f; return r; }
inline VF vset1(float s) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = s; return r; }
inline VF vload(const float* p) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = p[i]; return r; }
inline void vstore(float* p, VF a) { for (int i = 0; i < VW; ++i) p[i] = a.v[i]; }
inline VF vfma(VF a, VF b, VF c) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
inline VF vmul(VF a, VF b) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
inline VF vadd(VF a, VF b) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
template <class T>
inline void vpin(T&) {}
inline float vsum(VF a) { float s = 0.f; for (int i = 0; i < VW; ++i) s += a.v[i]; return s; }
inline void vsum_vw(const VF* v, float* out) { for (int i = 0; i < VW; ++i) out[i] = vsum(v[i]); }
inline void vsum_8(const VF* v, float* out) { for (int i = 0; i < 8; ++i) out[i] = vsum(v[i]); }
inline VF vload_bf16(const uint16_t* p) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = bf16_to_f32(p[i]); return r; }
inline void vload_bf16x2(const uint16_t* p, VF& even, VF& odd) {
  for (int i = 0; i < VW; ++i) { even.v[i] = bf16_to_f32(p[2 * i]); odd.v[i] = bf16_to_f32(p[2 * i + 1]); }
}
inline VF vload_i8(const int8_t* p) { VF r; for (int i = 0; i < VW; ++i) r.v[i] = float(p[i]); return r; }
inline void vload_u4(const uint8_t* p, VF& lo, VF& hi) {
  for (int i = 0; i < VW; ++i) { lo.v[i] = float(p[i] & 15); hi.v[i] = float(p[i] >> 4); }
}
#endif

// 4 outputs s * scale (+ bias, when not null) stored as fp32 (yf) or as bf16 (yb), rounded as
// f32_to_bf16 rounds them (to nearest even, a NaN stays a NaN)
#if defined(BB_SIMD_AVX512) || defined(BB_SIMD_AVX2)
inline __m128i bf16x4(__m128 r) {            // in the low 64 bits
  const __m128i u = _mm_castps_si128(r);
  const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  const __m128i up = _mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff)));
  const __m128i quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
  const __m128i h = _mm_blendv_epi8(_mm_srli_epi32(up, 16), quiet, nan);
  return _mm_packus_epi32(h, h);
}

inline void store4(const float* s, const float* scale, const float* bias, float* yf, uint16_t* yb) {
  __m128 r = _mm_mul_ps(_mm_loadu_ps(s), _mm_loadu_ps(scale));
  if (bias) r = _mm_add_ps(r, _mm_loadu_ps(bias));
  if (yf) _mm_storeu_ps(yf, r);
  else _mm_storel_epi64(reinterpret_cast<__m128i*>(yb), bf16x4(r));
}
#else
inline void store4(const float* s, const float* scale, const float* bias, float* yf, uint16_t* yb) {
  for (int j = 0; j < 4; ++j) {
    const float r = s[j] * scale[j] + (bias ? bias[j] : 0.f);
    if (yf) yf[j] = r;
    else yb[j] = f32_to_bf16(r);
  }
}
#endif

}  // namespace bb
