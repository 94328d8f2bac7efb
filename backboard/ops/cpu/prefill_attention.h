// Causal prefill attention over one request's paged KV cache on CPUs with AVX512-BF16: the CPU
// kernel of ops.attention.paged_attention_prefill_ref (same arguments, same result to bf16 rounding).
//
// L new tokens at the end of a sequence of S = ctx + L tokens (all already in the cache); query
// t sees keys at positions <= ctx + t. torch's bf16 SDPA reached 80-126 GFLOP/s on a 2-core
// Zen 4 where the GEMMs reach ~390: a flash-attention form built on VDPBF16PS instead.
//
//   1. K and V of every KV head are packed once into VNNI panels of kKeyBlock keys: K as
//      [D/2][kKeyBlock] pairs (k_j[2i], k_j[2i+1]), so one vector of 16 pairs against a
//      broadcast query pair gives 16 scores; V as [kKeyBlock/2][D] pairs (v_2j[d], v_2j+1[d]),
//      so a broadcast probability pair against one vector gives 16 output columns.
//   2. A task is (KV head, block of kQueryBlock query positions): its r * kQueryBlock rows (the
//      heads sharing the KV head) run an online softmax over the key blocks up to their causal
//      limit; S = QK^T and O += PV in register tiles, fp32 accumulation; the probabilities are
//      rounded to bf16 for PV, as torch's bf16 SDPA does.
//   3. Tasks are taken longest first from a shared counter, so the causal triangle's uneven
//      work spreads over the threads.
//
// Only built where VDPBF16PS exists (kPrefillAttention); elsewhere torch's SDPA runs.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <atomic>
#include <limits>
#include <optional>
#include <vector>

#include "big_alloc.h"
#include "paged_attention.h"
#include "simd.h"
#include "tensor_args.h"
#if defined(BB_ISA_AVX512_BF16)
#include "transpose.h"
#endif
#if defined(BB_ISA_AMX_BF16)
#include "amx_tiles.h"
#endif

namespace bb {
inline namespace BB_ISA_NAMESPACE {

#if defined(BB_ISA_AVX512_BF16)
constexpr bool kPrefillAttention = true;
constexpr int64_t kKeyBlock = 32;           // keys per block: two vectors of scores
constexpr int64_t kQueryBlock = 16;         // query positions per task
constexpr int64_t kPairs = kKeyBlock / 2;

struct PrefillArgs {
  int64_t L, ctx, nh, nkv, r, D, nkb;       // ctx: tokens before the L new ones; nkb: key blocks
  const bf16* q;
  int64_t sq_l, sq_h;
  float scale;
  const uint32_t *kp, *vp;                  // packed panels [nkv][nkb][D/2][kKeyBlock], [nkv][nkb][kPairs][D]
  bf16* out;                                // [L, nh, D]
};

// ---- packing ------------------------------------------------------------------------------
// rows[j] (j < n, n <= kKeyBlock): key j of the block (D bf16, as uint32 pairs); missing keys are 0.
// 16 keys x 16 pairs at a time, transposed in registers (pair by pair it took a sixth of a
// 1024-token prefill's attention once the products ran on AMX tiles)
inline void pack_k_block(const uint32_t* const* rows, int64_t n, int64_t Dp, uint32_t* kp) {
  for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 16) {
    for (int64_t i0 = 0; i0 + 16 <= Dp; i0 += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j0 + j < n ? _mm512_castsi512_ps(_mm512_loadu_si512(rows[j0 + j] + i0)) : _mm512_setzero_ps();
      simd16::transpose16(r);
      for (int t = 0; t < 16; ++t) _mm512_storeu_ps(reinterpret_cast<float*>(kp + (i0 + t) * kKeyBlock + j0), r[t]);
    }
  }
}

// pair jp of column d = (v_2jp[d], v_2jp+1[d]): 16 columns at a time, zero-extended and joined
inline void pack_v_block(const bf16* const* rows, int64_t n, int64_t D, uint32_t* vp) {
  for (int64_t jp = 0; jp < kPairs; ++jp) {
    const int64_t j0 = 2 * jp, j1 = 2 * jp + 1;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i lo = j0 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(rows[j0] + d)))
                                : _mm512_setzero_si512();
      const __m512i hi = j1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(rows[j1] + d)))
                                : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + jp * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// ---- register tiles -----------------------------------------------------------------------
// s [RB][kKeyBlock] = scale * q rows [RB][Dp pairs] . packed keys
template <int RB>
inline void qk_tile(const uint32_t* q, int64_t Dp, const uint32_t* kp, float scale, float* s) {
  __m512 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < Dp; ++i) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + i * kKeyBlock);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + i * kKeyBlock + 16);
    for (int r = 0; r < RB; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(q[r * Dp + i]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(s + r * kKeyBlock, _mm512_mul_ps(acc[r][0], vs));
    _mm512_storeu_ps(s + r * kKeyBlock + 16, _mm512_mul_ps(acc[r][1], vs));
  }
}

// o [RB][D] columns [d0, d0 + 16 NV) = o * alpha + p pairs [RB][kPairs] . packed values
template <int RB, int NV>
inline void pv_tile(float* o, int64_t D, const float* alpha, const uint32_t* p, const uint32_t* vp, int64_t d0) {
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * c), _mm512_set1_ps(alpha[r]));
  for (int64_t jp = 0; jp < kPairs; ++jp) {
    __m512bh v[NV];
    for (int c = 0; c < NV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + d0 + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(p[r * kPairs + jp]));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
}

inline void qk_rows(const uint32_t* q, int64_t M, int64_t Dp, const uint32_t* kp, float scale, float* s) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) qk_tile<8>(q + m * Dp, Dp, kp, scale, s + m * kKeyBlock);
  for (; m < M; ++m) qk_tile<1>(q + m * Dp, Dp, kp, scale, s + m * kKeyBlock);
}

template <int RB>
inline void pv_rows_of(float* o, int64_t D, const float* alpha, const uint32_t* p, const uint32_t* vp) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_tile<RB, 4>(o, D, alpha, p, vp, d);
  for (; d < D; d += 16) pv_tile<RB, 1>(o, D, alpha, p, vp, d);
}

inline void pv_rows(float* o, int64_t M, int64_t D, const float* alpha, const uint32_t* p, const uint32_t* vp) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) pv_rows_of<4>(o + m * D, D, alpha + m, p + m * kPairs, vp);
  for (; m < M; ++m) pv_rows_of<1>(o + m * D, D, alpha + m, p + m * kPairs, vp);
}

#if defined(BB_ISA_AMX_BF16)
// The same two products on AMX tiles (M % 16 == 0: the scratch holds 16 r rows, the rows past a
// task's own are zero). The packed panels are already B tiles: K's [D/2][32] pairs give 16 pairs
// of dims x 16 keys per tile, V's [16 key pairs][D] 16 key pairs x 16 columns; q rows [M][D] and
// the probability pairs [M][32] are A tiles. TDPBF16PS: exact bf16 products, fp32 sums.

// s [M][32] = scale * q . K: C tiles 0 (keys 0-15), 1 (16-31), A tile 2, B tiles 3, 4
inline void qk_rows_amx(const bf16* q, int64_t M, int64_t D, const uint32_t* kp, float scale, float* s) {
  for (int64_t m = 0; m < M; m += amx::L) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t d = 0; d < D; d += 32) {
      _tile_loadd(2, q + m * D + d, D * 2);
      _tile_loadd(3, kp + (d / 2) * kKeyBlock, kKeyBlock * 4);
      _tile_loadd(4, kp + (d / 2) * kKeyBlock + 16, kKeyBlock * 4);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, s + m * kKeyBlock, kKeyBlock * 4);
    _tile_stored(1, s + m * kKeyBlock + 16, kKeyBlock * 4);
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < M * kKeyBlock; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), vs));
}

// o [M][D] = o * alpha + p . V: A tile 0 = 16 rows of p, C tiles 1-4 = 64 columns of o, B 5, 6
inline void pv_rows_amx(float* o, int64_t M, int64_t D, const float* alpha, const uint32_t* p, const uint32_t* vp) {
  for (int64_t m = 0; m < M; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + m * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + m * D + d), a));
  }
  const int64_t so = D * 4;
  for (int64_t m = 0; m < M; m += amx::L) {
    float* om = o + m * D;
    _tile_loadd(0, p + m * kPairs, kPairs * 4);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
      _tile_loadd(1, om + d, so);
      _tile_loadd(2, om + d + 16, so);
      _tile_loadd(3, om + d + 32, so);
      _tile_loadd(4, om + d + 48, so);
      _tile_loadd(5, vp + d, so);
      _tile_dpbf16ps(1, 0, 5);
      _tile_loadd(6, vp + d + 16, so);
      _tile_dpbf16ps(2, 0, 6);
      _tile_loadd(5, vp + d + 32, so);
      _tile_dpbf16ps(3, 0, 5);
      _tile_loadd(6, vp + d + 48, so);
      _tile_dpbf16ps(4, 0, 6);
      _tile_stored(1, om + d, so);
      _tile_stored(2, om + d + 16, so);
      _tile_stored(3, om + d + 32, so);
      _tile_stored(4, om + d + 48, so);
    }
    for (; d < D; d += 16) {
      _tile_loadd(1, om + d, so);
      _tile_loadd(5, vp + d, so);
      _tile_dpbf16ps(1, 0, 5);
      _tile_stored(1, om + d, so);
    }
  }
}
#endif

// ---- one task -----------------------------------------------------------------------------
struct PrefillScratch {
  std::vector<uint32_t> q, p;               // [M][D/2] query pairs, [M][kPairs] probability pairs
  std::vector<float> o, s, m, l, alpha;     // [M][D], [M][kKeyBlock], [M] x 3
  explicit PrefillScratch(int64_t M, int64_t D)
      : q(M * D / 2), p(M * kPairs), o(M * D), s(M * kKeyBlock), m(M), l(M), alpha(M) {}
};

// rows m = (query t0 + m / r, head kvh * r + m % r) of the task; returns how many rows it has
inline int64_t load_task_rows(const PrefillArgs& a, int64_t kvh, int64_t t0, PrefillScratch& w) {
  const int64_t rows = std::min(kQueryBlock, a.L - t0) * a.r, Dp = a.D / 2;
  for (int64_t m = 0; m < rows; ++m) {
    const bf16* qs = a.q + (t0 + m / a.r) * a.sq_l + (kvh * a.r + m % a.r) * a.sq_h;
    std::memcpy(w.q.data() + m * Dp, qs, a.D * sizeof(bf16));
    std::fill(w.o.begin() + m * a.D, w.o.begin() + (m + 1) * a.D, 0.f);
    w.m[m] = -std::numeric_limits<float>::infinity();
    w.l[m] = 0.f;
  }
  // rows past the task's own up to the scratch's (a multiple of 16: whole AMX tiles) stay zero
  std::fill(w.q.begin() + rows * Dp, w.q.end(), 0u);
  return rows;
}

// scores of one key block -> bf16 probability pairs and each row's rescale factor
inline void block_softmax(const PrefillArgs& a, int64_t t0, int64_t k0, int64_t rows, PrefillScratch& w) {
  for (int64_t m = 0; m < rows; ++m) {
    float* s = w.s.data() + m * kKeyBlock;
    const int64_t visible = std::min(kKeyBlock, a.ctx + t0 + m / a.r + 1 - k0);
    w.alpha[m] = softmax_chunk(s, kKeyBlock, visible, w.m.data() + m, w.l.data() + m);
    // (p_2j, p_2j+1) pairs are the row's 32 probabilities in order, rounded to nearest even
    const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s));
    _mm512_storeu_si512(w.p.data() + m * kPairs, (__m512i)p);
  }
}

inline void store_task_rows(const PrefillArgs& a, int64_t kvh, int64_t t0, int64_t rows, const PrefillScratch& w) {
  for (int64_t m = 0; m < rows; ++m) {
    const float inv = w.l[m] > 0.f ? 1.f / w.l[m] : 0.f;
    bf16* y = a.out + ((t0 + m / a.r) * a.nh + kvh * a.r + m % a.r) * a.D;
    const float* o = w.o.data() + m * a.D;
    for_lanes(a.D, [&](int64_t d, int n) { store_n(load_n(o + d, n) * VF::set1(inv), y + d, n); });
  }
}

// amx: the products on AMX tiles over whole 16-row tiles (the thread has configured them)
inline void prefill_task(const PrefillArgs& a, int64_t kvh, int64_t qb, PrefillScratch& w, bool amx) {
  const int64_t t0 = qb * kQueryBlock, rows = load_task_rows(a, kvh, t0, w), Dp = a.D / 2;
  const int64_t last_key = a.ctx + std::min(a.L, t0 + kQueryBlock);     // keys [0, last_key) are seen
  for (int64_t kb = 0; kb * kKeyBlock < last_key; ++kb) {
    const int64_t panel = kvh * a.nkb + kb;
    const uint32_t *kp = a.kp + panel * Dp * kKeyBlock, *vp = a.vp + panel * kPairs * a.D;
#if defined(BB_ISA_AMX_BF16)
    if (amx) {
      const int64_t tiled = (rows + amx::L - 1) / amx::L * amx::L;
      qk_rows_amx(reinterpret_cast<const bf16*>(w.q.data()), tiled, a.D, kp, a.scale, w.s.data());
      block_softmax(a, t0, kb * kKeyBlock, rows, w);
      pv_rows_amx(w.o.data(), tiled, a.D, w.alpha.data(), w.p.data(), vp);
      continue;
    }
#endif
    qk_rows(w.q.data(), rows, Dp, kp, a.scale, w.s.data());
    block_softmax(a, t0, kb * kKeyBlock, rows, w);
    pv_rows(w.o.data(), rows, a.D, w.alpha.data(), w.p.data(), vp);
  }
  store_task_rows(a, kvh, t0, rows, w);
}

// ---- the op -------------------------------------------------------------------------------
// the key rows of one block of the sequence (positions k0 .. k0 + n) for KV head h
template <typename Row>
inline int64_t block_rows(const at::Tensor& cache, const std::vector<int64_t>& blocks, int64_t h, int64_t k0,
                          int64_t S, const Row** rows) {
  const int64_t bs = cache.size(1), n = std::min(kKeyBlock, S - k0);
  const bf16* base = ptr<bf16>(cache);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = k0 + j;
    rows[j] = reinterpret_cast<const Row*>(base + blocks[p / bs] * cache.stride(0) + (p % bs) * cache.stride(1) +
                                           h * cache.stride(2));
  }
  return n;
}

inline void pack_kv(const at::Tensor& kc, const at::Tensor& vc, const std::vector<int64_t>& blocks, int64_t S,
                    int64_t nkb, uint32_t* kp, uint32_t* vp) {
  const int64_t nkv = kc.size(2), D = kc.size(3), Dp = D / 2;
  at::parallel_for(0, nkv * nkb, 4, [&](int64_t b, int64_t e) {
    const uint32_t* krows[kKeyBlock];
    const bf16* vrows[kKeyBlock];
    for (int64_t i = b; i < e; ++i) {
      const int64_t h = i / nkb, k0 = (i % nkb) * kKeyBlock;
      const int64_t n = block_rows(kc, blocks, h, k0, S, krows);
      block_rows(vc, blocks, h, k0, S, vrows);
      pack_k_block(krows, n, Dp, kp + i * Dp * kKeyBlock);
      pack_v_block(vrows, n, D, vp + i * kPairs * D);
    }
  });
}

// tasks longest first (late query blocks see more keys), taken from a shared counter
inline void run_prefill_tasks(const PrefillArgs& a, bool amx) {
  const int64_t nqb = (a.L + kQueryBlock - 1) / kQueryBlock, tasks = nqb * a.nkv;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    FlushDenormals ftz;
#if defined(BB_ISA_AMX_BF16)
    std::optional<amx::Tiles> tiles;
    if (amx) tiles.emplace();
#endif
    PrefillScratch w(kQueryBlock * a.r, a.D);
    for (int64_t i = next++; i < tasks; i = next++) prefill_task(a, i % a.nkv, nqb - 1 - i / a.nkv, w, amx);
  });
}

// q [L, nh, D] bf16 (last dim contiguous); k_cache, v_cache [num_blocks, bs, nkv, D] bf16;
// block_table_row [>= ceil(S / bs)]; seq_len S >= L -> [L, nh, D]
// use_amx: the products on AMX tiles where the CPU has them (amx_bf16 builds; tests turn it off)
inline at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& block_table_row, int64_t seq_len, double scale,
                                          bool use_amx) {
  RECORD_FUNCTION("bb::paged_attention_prefill", std::vector<c10::IValue>());
  const char* op = "paged_attention_prefill";
  check_dim(op, "q", q, 3);
  check_dim(op, "k_cache", k_cache, 4);
  BB_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": k_cache ", k_cache.sizes(), " and v_cache ",
           v_cache.sizes(), " differ in shape");
  for (auto* t : {&q, &k_cache, &v_cache}) check_last_contiguous(op, "q / k_cache / v_cache", *t);
  BB_CHECK(q.scalar_type() == at::kBFloat16, op, ": q must be bfloat16, got ", q.scalar_type());
  check_same_dtype(op, "k_cache", k_cache, q);
  check_same_dtype(op, "v_cache", v_cache, q);
  const int64_t L = q.size(0), nh = q.size(1), D = q.size(2), nkv = k_cache.size(2), bs = k_cache.size(1);
  check_size(op, "k_cache", k_cache, 3, D);
  BB_CHECK(D % 32 == 0, op, ": head_dim must be a multiple of 32, got ", D);
  BB_CHECK(nkv > 0 && nh % nkv == 0, op, ": num heads (", nh, ") is not a multiple of num kv heads (", nkv, ")");
  BB_CHECK(L > 0 && seq_len >= L, op, ": seq_len (", seq_len, ") must be at least L (", L, ") > 0");
  const int64_t used = (seq_len + bs - 1) / bs;
  BB_CHECK(block_table_row.dim() == 1 && block_table_row.size(0) >= used, op, ": block_table_row needs ",
           used, " entries for ", seq_len, " tokens, has shape ", block_table_row.sizes());
  const auto blocks = read_indices(op, "block_table_row", block_table_row.slice(0, 0, used), k_cache.size(0));
  const int64_t nkb = (seq_len + kKeyBlock - 1) / kKeyBlock;
  // from big_alloc's cache from 1 MiB on: a fresh buffer's page faults (zeroed huge pages) cost
  // as much as the attention itself at one query over 1024-4096 keys (0.6-7 ms)
  at::Tensor packed = big::empty({2 * nkv * nkb * kKeyBlock * D / 2}, q.options().dtype(at::kInt), size_t(1) << 20);
  uint32_t* kp = ptr<uint32_t>(packed);
  uint32_t* vp = kp + nkv * nkb * kKeyBlock * D / 2;
  pack_kv(k_cache, v_cache, blocks, seq_len, nkb, kp, vp);
  at::Tensor out = at::empty({L, nh, D}, q.options());
  const PrefillArgs a{L, seq_len - L, nh, nkv, nh / nkv, D, nkb, ptr<bf16>(q), q.stride(0), q.stride(1),
                      float(scale), kp, vp, ptr<bf16>(out)};
#if defined(BB_ISA_AMX_BF16)
  run_prefill_tasks(a, use_amx && amx::ready());
#else
  run_prefill_tasks(a, false);
#endif
  return out;
}
#else
constexpr bool kPrefillAttention = false;
#endif

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
