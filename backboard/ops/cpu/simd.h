// A small fp32 SIMD vector for the CPU kernels, one implementation per ISA level (build.py
// compiles each level with its own -m flags and one BB_ISA_<LEVEL> macro):
//   BB_ISA_AVX512_BF16 / BB_ISA_AVX512: 16 lanes (BB_ISA_AMX_BF16 builds define AVX512_BF16 too) (__m512; native bf16 rounding with AVX512-BF16)
//   BB_ISA_AVX2:                        8 lanes (__m256)
//   otherwise (portable):               8 lanes in a plain array (the compiler's baseline SIMD)
//
// Element types: float, and bf16 held as its raw bits (uint16_t). Loads widen bf16 to fp32,
// stores round fp32 to bf16 to nearest-even exactly as torch does (c10::BFloat16), so a kernel
// that rounds where the torch reference rounds produces the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// every level's symbols in their own namespace: one process loads several levels side by side
#if defined(BB_ISA_AMX_BF16)
#define BB_ISA_NAMESPACE isa_amx_bf16
#elif defined(BB_ISA_AVX512_BF16)
#define BB_ISA_NAMESPACE isa_avx512_bf16
#elif defined(BB_ISA_AVX512)
#define BB_ISA_NAMESPACE isa_avx512
#elif defined(BB_ISA_AVX2)
#define BB_ISA_NAMESPACE isa_avx2
#else
#define BB_ISA_NAMESPACE isa_portable
#endif

#if defined(BB_ISA_AVX512_BF16) || defined(BB_ISA_AVX512)
#define BB_VEC_AVX512 1
#include <immintrin.h>
#elif defined(BB_ISA_AVX2)
#define BB_VEC_AVX2 1
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace bb {
inline namespace BB_ISA_NAMESPACE {

using bf16 = uint16_t;

// While alive, the calling thread flushes denormal floats to zero (x86 MXCSR FTZ + DAZ): a
// recurrent state that decays by exp(g) per token passes through the denormal range, where some
// CPUs take a microcode assist per operation. Values below 1.2e-38 are zero to the model.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
 private:
  unsigned saved_;
#endif
};

// ---- scalar conversions ------------------------------------------------------------------
inline float bf16_to_f32(bf16 h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f32_to_bf16(float f) {            // round to nearest even; NaN -> 0x7FC0 (as c10)
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return bf16((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bf16_to_f32(x); }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { return f32_to_bf16(x); }

// x rounded to T and widened back: where the torch reference stores an intermediate in T
template <typename T> inline float round_to(float x) { return to_f32(from_f32<T>(x)); }

// Cephes-style exp polynomial on [-ln2/2, ln2/2] (about 1 ulp); exp(x) = 0 below -87.3
constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365478515625f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if BB_VEC_AVX512
// ================================ AVX-512: 16 lanes ========================================
struct VF {
  static constexpr int N = 16;
  __m512 v;
  VF() = default;
  VF(__m512 x) : v(x) {}
  static VF zero() { return _mm512_setzero_ps(); }
  static VF set1(float x) { return _mm512_set1_ps(x); }
  static VF load(const float* p) { return _mm512_loadu_ps(p); }
  static VF load(const bf16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static VF load(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static VF load(const bf16* p, int n) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(n), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const { _mm256_storeu_si256((__m256i*)p, to_bf16()); }
  void store(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  void store(bf16* p, int n) const { _mm256_mask_storeu_epi16(p, mask(n), to_bf16()); }
  void stream(float* p) const { _mm512_stream_ps(p, v); }     // p 64-byte aligned
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  friend VF operator+(VF a, VF b) { return _mm512_add_ps(a.v, b.v); }
  friend VF operator-(VF a, VF b) { return _mm512_sub_ps(a.v, b.v); }
  friend VF operator*(VF a, VF b) { return _mm512_mul_ps(a.v, b.v); }
  friend VF operator/(VF a, VF b) { return _mm512_div_ps(a.v, b.v); }
  friend VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }   // a * b + c
  friend VF vmax(VF a, VF b) { return _mm512_max_ps(a.v, b.v); }
  friend VF vmin(VF a, VF b) { return _mm512_min_ps(a.v, b.v); }
  friend VF vround(VF a) { return _mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  friend VF pow2n(VF n) {             // 2^n for integral n in [-126, 127]
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
  }
  friend VF zero_below(VF r, VF x, float lo) {   // r where x >= lo, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(lo), _CMP_GE_OQ), r.v);
  }

 private:
  static __mmask16 mask(int n) { return __mmask16((1u << n) - 1u); }
  __m256i to_bf16() const {
#if defined(BB_ISA_AVX512_BF16)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
#endif
  }
};

#elif BB_VEC_AVX2
// ================================ AVX2: 8 lanes ============================================
struct VF {
  static constexpr int N = 8;
  __m256 v;
  VF() = default;
  VF(__m256 x) : v(x) {}
  static VF zero() { return _mm256_setzero_ps(); }
  static VF set1(float x) { return _mm256_set1_ps(x); }
  static VF load(const float* p) { return _mm256_loadu_ps(p); }
  static VF load(const bf16* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  template <typename T> static VF load(const T* p, int n) {
    T tmp[N] = {};
    std::memcpy(tmp, p, n * sizeof(T));
    return load(tmp);
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const { _mm_storeu_si128((__m128i*)p, to_bf16()); }
  void stream(float* p) const { _mm256_stream_ps(p, v); }     // p 32-byte aligned
  template <typename T> void store(T* p, int n) const {
    T tmp[N];
    store(tmp);
    std::memcpy(p, tmp, n * sizeof(T));
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  friend VF operator+(VF a, VF b) { return _mm256_add_ps(a.v, b.v); }
  friend VF operator-(VF a, VF b) { return _mm256_sub_ps(a.v, b.v); }
  friend VF operator*(VF a, VF b) { return _mm256_mul_ps(a.v, b.v); }
  friend VF operator/(VF a, VF b) { return _mm256_div_ps(a.v, b.v); }
  friend VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
  friend VF vmax(VF a, VF b) { return _mm256_max_ps(a.v, b.v); }
  friend VF vmin(VF a, VF b) { return _mm256_min_ps(a.v, b.v); }
  friend VF vround(VF a) { return _mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  friend VF pow2n(VF n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
  }
  friend VF zero_below(VF r, VF x, float lo) {
    return _mm256_and_ps(r.v, _mm256_cmp_ps(x.v, _mm256_set1_ps(lo), _CMP_GE_OQ));
  }

 private:
  __m128i to_bf16() const {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
};

#else
// ================================ portable: 8 lanes in an array ============================
struct VF {
  static constexpr int N = 8;
  float v[N];
  static VF zero() { return set1(0.f); }
  static VF set1(float x) { VF r; for (int i = 0; i < N; ++i) r.v[i] = x; return r; }
  template <typename T> static VF load(const T* p) { return load(p, N); }
  template <typename T> static VF load(const T* p, int n) {
    VF r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = to_f32(p[i]);
    return r;
  }
  template <typename T> void store(T* p) const { store(p, N); }
  template <typename T> void store(T* p, int n) const {
    for (int i = 0; i < n; ++i) p[i] = from_f32<T>(v[i]);
  }
  void stream(float* p) const { store(p); }
  float sum() const { float s = 0.f; for (int i = 0; i < N; ++i) s += v[i]; return s; }
  float max() const { float s = v[0]; for (int i = 1; i < N; ++i) s = std::fmax(s, v[i]); return s; }
#define BB_PORTABLE_BINOP(name, expr)                                 \
  friend VF name(VF a, VF b) {                                        \
    VF r;                                                             \
    for (int i = 0; i < N; ++i) r.v[i] = (expr);                      \
    return r;                                                         \
  }
  BB_PORTABLE_BINOP(operator+, a.v[i] + b.v[i])
  BB_PORTABLE_BINOP(operator-, a.v[i] - b.v[i])
  BB_PORTABLE_BINOP(operator*, a.v[i] * b.v[i])
  BB_PORTABLE_BINOP(operator/, a.v[i] / b.v[i])
  BB_PORTABLE_BINOP(vmax, std::fmax(a.v[i], b.v[i]))
  BB_PORTABLE_BINOP(vmin, std::fmin(a.v[i], b.v[i]))
#undef BB_PORTABLE_BINOP
  friend VF fma(VF a, VF b, VF c) { VF r; for (int i = 0; i < N; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  friend VF vround(VF a) { VF r; for (int i = 0; i < N; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }
  friend VF pow2n(VF n) {
    VF r;
    for (int i = 0; i < N; ++i) {
      uint32_t e = uint32_t(int32_t(n.v[i]) + 127) << 23;
      std::memcpy(&r.v[i], &e, 4);
    }
    return r;
  }
  friend VF zero_below(VF r, VF x, float lo) {
    for (int i = 0; i < N; ++i) r.v[i] = x.v[i] >= lo ? r.v[i] : 0.f;
    return r;
  }
};
#endif

// ---- math on VF (one body for every ISA) ------------------------------------------------
inline VF vexp(VF x) {
  VF xc = vmin(vmax(x, VF::set1(kExpLo)), VF::set1(kExpHi));
  VF n = vround(xc * VF::set1(kLog2e));
  VF r = fma(n, VF::set1(-kLn2Hi), xc);
  r = fma(n, VF::set1(-kLn2Lo), r);
  VF p = VF::set1(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = fma(p, r, VF::set1(kExpP[i]));
  VF y = fma(p, r * r, r + VF::set1(1.f));
#if BB_VEC_AVX512
  // y * 2^n in one VSCALEFPS (exact, n = 128 included): 17 operations where the two-step
  // scale took 27; silu_mul over 1040 x 2048 bf16 on 2 Zen 5 cores 0.385 -> 0.32 ms
  return zero_below(VF(_mm512_scalef_ps(y.v, n.v)), x, kExpLo);
#else
  // n = 128 only when x rounds to the top of the range: split the scale in two halves
  VF half = vround(n * VF::set1(0.5f));
  return zero_below(y * pow2n(half) * pow2n(n - half), x, kExpLo);
#endif
}

// 1 / d (fp32-exact to about 1e-7: AVX-512's 14-bit estimate and one Newton step, a quarter of a
// division's cost; elsewhere the division)
inline VF vrecip(VF d) {
#if BB_VEC_AVX512
  const __m512 r = _mm512_rcp14_ps(d.v);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d.v, r, _mm512_set1_ps(2.f)));
#else
  return VF::set1(1.f) / d;
#endif
}

inline VF vsilu(VF x) { return x * vrecip(VF::set1(1.f) + vexp(VF::zero() - x)); }   // as torch: x / (1 + e^-x)

// n elements starting at p, in VF-sized pieces: f(VF-offset, lanes) with lanes < N only last
template <typename F> inline void for_lanes(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + VF::N <= n; i += VF::N) f(i, VF::N);
  if (i < n) f(i, int(n - i));
}

template <typename T> inline VF load_n(const T* p, int lanes) {
  return lanes == VF::N ? VF::load(p) : VF::load(p, lanes);
}
template <typename T> inline void store_n(VF x, T* p, int lanes) {
  if (lanes == VF::N) x.store(p); else x.store(p, lanes);
}

// A store that bypasses the caches (no read-for-ownership of the destination line) where the
// address allows, for data written once and not read again soon; stream_fence() orders them.
inline void store_stream(VF x, float* p, int lanes) {
  if (lanes == VF::N && (reinterpret_cast<uintptr_t>(p) % sizeof(VF)) == 0) x.stream(p);
  else store_n(x, p, lanes);
}

inline void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

// x rounded to T lane by lane (identity for float)
template <typename T> inline VF round_vec(VF x) { return x; }
template <> inline VF round_vec<bf16>(VF x) {
  bf16 tmp[VF::N];
  x.store(tmp);
  return VF::load(tmp);
}

// sum over i < n of f(x, i) for a lane function f(VF-offset, lanes) -> VF, with four
// accumulators (one FMA chain would wait on its latency at every step)
template <typename F> inline float reduce_sum(int64_t n, F&& f) {
  VF a0 = VF::zero(), a1 = VF::zero(), a2 = VF::zero(), a3 = VF::zero();
  int64_t i = 0;
  for (; i + 4 * VF::N <= n; i += 4 * VF::N) {
    a0 = f(i, VF::N, a0);
    a1 = f(i + VF::N, VF::N, a1);
    a2 = f(i + 2 * VF::N, VF::N, a2);
    a3 = f(i + 3 * VF::N, VF::N, a3);
  }
  for (; i < n; i += VF::N) a0 = f(i, int(std::min<int64_t>(VF::N, n - i)), a0);
  return ((a0 + a1) + (a2 + a3)).sum();
}

// sum of x[i]^2 (fp32 accumulate)
template <typename T> inline float sum_squares(const T* x, int64_t n) {
  return reduce_sum(n, [&](int64_t i, int m, VF acc) { VF v = load_n(x + i, m); return fma(v, v, acc); });
}

// sum of a[i] * b[i] (fp32)
inline float dot(const float* a, const float* b, int64_t n) {
  return reduce_sum(n, [&](int64_t i, int m, VF acc) { return fma(load_n(a + i, m), load_n(b + i, m), acc); });
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
