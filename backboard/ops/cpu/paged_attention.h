// Paged decode / verify attention over block tables: the CPU kernel of
// ops.attention.paged_attention_uniform (same arguments, same result).
//
// B requests with L query rows each, the last L positions of their sequences; row t of request
// b sees the keys at positions < seq_lens[b] - L + 1 + t. KV cache per layer [num_blocks,
// block_size, nkv, D]; position p of request b lives at block_table[b, p // bs], offset p % bs.
// A task takes all r * L query rows that share a KV head (r = nh / nkv), so every K/V row is read
// (and widened to fp32) once per KV head; with enough requests a task is a whole request (its KV
// heads walk the blocks together), else one per (request, KV head, context split), or one per
// (request, context split) with all its KV heads where per-head tasks would not divide evenly over
// the threads. An online softmax (running max, sum, fp32 accumulator per row) runs over chunks of
// kAttnChunk tokens, gathered through the block table (a chunk may span blocks). The context is
// split (flash-decoding) only when the tasks would leave threads idle; the split partials are then
// merged in a second pass.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "simd.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

constexpr int64_t kMinSplitTokens = 256;    // never split the context finer than this
// Fewer requests than threads, and (request, KV head) tasks that do not divide evenly over them:
// the context is split over the threads instead, each task all of a request's KV heads, in splits
// of at least this many tokens. SmolLM2 (3 KV heads) on 2 Zen 5 cores, whose per-head tasks left
// a core idle a third of the time: one request's decode step 12.27 -> 11.28 ms at 1024 tokens,
// 9.13 -> 8.98 at 256
constexpr int64_t kMinWholeSplitTokens = 64;

template <typename T>
struct AttnArgs {
  int64_t B, L, nh, nkv, r, D, bs, num_blocks, splits, tokens_per_split;
  const T* q;
  int64_t sq_b, sq_l, sq_h;
  const T *k, *v;
  int64_t sk_blk, sk_tok, sk_head, sv_blk, sv_tok, sv_head;
  Index2D block_table;
  const int64_t* seq_lens;
  float scale;
  T* out;                                   // [B, L, nh, D] contiguous
  float *part_o, *part_m, *part_l;          // [B, L, nh, splits, (D)] when splits > 1
};

// s[g][j] = q_g . k_j for G query rows and the chunk's n keys: each key is loaded (and widened)
// once for the G rows, whose G dot products are independent FMA chains
template <int G, typename T>
inline void group_scores(const float* q, int64_t D, const T* const* krows, int64_t n, float* s) {
  for (int64_t j = 0; j < n; ++j) {
    VF acc[G];
    for (int g = 0; g < G; ++g) acc[g] = VF::zero();
    for_lanes(D, [&](int64_t d, int w) {
      const VF kv = load_n(krows[j] + d, w);
      for (int g = 0; g < G; ++g) acc[g] = fma(load_n(q + g * D + d, w), kv, acc[g]);
    });
    for (int g = 0; g < G; ++g) s[g * kAttnChunk + j] = acc[g].sum();
  }
}

template <typename T>
inline void chunk_scores(const float* qf, int64_t M, int64_t D, const T* const* krows, int64_t n, float* s) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) group_scores<4>(qf + m * D, D, krows, n, s + m * kAttnChunk);
  for (; m + 2 <= M; m += 2) group_scores<2>(qf + m * D, D, krows, n, s + m * kAttnChunk);
  for (; m < M; ++m) group_scores<1>(qf + m * D, D, krows, n, s + m * kAttnChunk);
}

#if !defined(BB_ISA_AVX512_BF16)
constexpr bool kBf16Dot = false;
#endif

// acc[d0 .. d0 + NB vectors) = acc * alpha + sum_j p[j] * rows[j], the accumulators in registers
template <int NB>
inline void pv_block(float* acc, VF alpha, const float* p, const float* const* rows, int64_t n,
                     int64_t d0, int last_lanes) {
  int lanes[NB];
  VF x[NB];
  for (int v = 0; v < NB; ++v) {
    lanes[v] = v == NB - 1 ? last_lanes : VF::N;
    x[v] = load_n(acc + d0 + v * VF::N, lanes[v]) * alpha;
  }
  for (int64_t j = 0; j < n; ++j) {
    const VF pj = VF::set1(p[j]);
    for (int v = 0; v < NB; ++v) x[v] = fma(pj, load_n(rows[j] + d0 + v * VF::N, lanes[v]), x[v]);
  }
  for (int v = 0; v < NB; ++v) store_n(x[v], acc + d0 + v * VF::N, lanes[v]);
}

inline void scale_accumulate(float* acc, float alpha, const float* p, const float* const* rows,
                             int64_t n, int64_t D) {
  constexpr int NB = 8;
  const VF va = VF::set1(alpha);
  int64_t d = 0;
  for (; d + NB * VF::N <= D; d += NB * VF::N) pv_block<NB>(acc, va, p, rows, n, d, VF::N);
  for (; d < D; d += VF::N) pv_block<1>(acc, va, p, rows, n, d, int(std::min<int64_t>(VF::N, D - d)));
}

// one query row's running softmax (max m_i, sum l_i) over a chunk of n keys whose first
// `visible` scores are s[0 .. visible): s becomes the probabilities (zero past `visible`); returns
// the factor alpha by which the row's accumulator must be rescaled
inline float softmax_chunk(float* s, int64_t n, int64_t visible, float* m_i, float* l_i) {
  if (visible <= 0) {
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
  float mx = *m_i;
  for (int64_t j = 0; j < visible; ++j) mx = std::max(mx, s[j]);
  const float alpha = std::exp(*m_i - mx);               // 0 on the first chunk (m_i = -inf)
  const VF vmx = VF::set1(mx);
  VF sum = VF::zero();
  for_lanes(visible, [&](int64_t j, int m) {
    VF e = vexp(load_n(s + j, m) - vmx);
    store_n(e, s + j, m);
    sum = sum + (m == VF::N ? e : VF::load(s + j, m));    // masked lanes of e may be non-zero
  });
  std::fill(s + visible, s + n, 0.f);
  *l_i = *l_i * alpha + sum.sum();
  *m_i = mx;
  return alpha;
}

// the rows of one KV head in a task: q (scaled fp32, or raw bf16 for the bf16 dot), accumulator,
// running max / sum, rescale factors and the chunk's scores
template <typename T>
struct HeadRows {
  float *qf, *acc, *m_i, *l_i, *alpha, *s;
  T* qraw;
};

template <typename T>
void load_head_rows(const AttnArgs<T>& a, int64_t b, int64_t kvh, const HeadRows<T>& h) {
  const int64_t D = a.D, M = a.r * a.L;
  for (int64_t m = 0; m < M; ++m) {                        // row m: query row m / r, head kvh*r + m % r
    const T* qs = a.q + b * a.sq_b + (m / a.r) * a.sq_l + (kvh * a.r + m % a.r) * a.sq_h;
    if (h.qraw != nullptr) std::copy(qs, qs + D, h.qraw + m * D);
    else for_lanes(D, [&](int64_t d, int n) { store_n(load_n(qs + d, n) * VF::set1(a.scale), h.qf + m * D + d, n); });
    std::fill(h.acc + m * D, h.acc + (m + 1) * D, 0.f);
    h.m_i[m] = -std::numeric_limits<float>::infinity();
    h.l_i[m] = 0.f;
  }
}

// the cache rows of a chunk's n positions (KV head 0; head h is h * sk_head / sv_head further)
template <typename T>
struct ChunkRows {
  const T* k[kAttnChunk];
  const T* v[kAttnChunk];
};

// the rows of request b's positions p0 .. p0 + n through its block table (a chunk may span blocks)
template <typename T>
void gather_chunk_rows(const AttnArgs<T>& a, int64_t b, int64_t p0, int64_t n, ChunkRows<T>& c) {
  for (int64_t j = 0; j < n;) {
    const int64_t p = p0 + j, blk = a.block_table.at(b, p / a.bs), off = p % a.bs;
    BB_CHECK(blk >= 0 && blk < a.num_blocks, "paged_attention_decode: block_table holds ", blk,
             ", outside [0, ", a.num_blocks, ")");
    const int64_t run = std::min(n - j, a.bs - off);
    for (int64_t t = 0; t < run; ++t, ++j) {
      c.k[j] = a.k + blk * a.sk_blk + (off + t) * a.sk_tok;
      c.v[j] = a.v + blk * a.sv_blk + (off + t) * a.sv_tok;
    }
  }
}

// one KV head's rows over the chunk's n keys (rows c, head kvh) starting at position p0
template <typename T>
void head_chunk(const AttnArgs<T>& a, int64_t b, const HeadRows<T>& h, const ChunkRows<T>& c, int64_t kvh,
                int64_t p0, int64_t n, float* vf) {
  const int64_t D = a.D, M = a.r * a.L, seq = a.seq_lens[b];
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, bf16>;
  const bool bf16_pv = bf16_dot && D % 32 == 0;            // PV by bf16 pair dot products too
  const T* krows[kAttnChunk];
  const T* vraw[kAttnChunk];
  const float* vrows[kAttnChunk];
  for (int64_t j = 0; j < n; ++j) {
    krows[j] = c.k[j] + kvh * a.sk_head;
    vraw[j] = c.v[j] + kvh * a.sv_head;
    if constexpr (std::is_same_v<T, float>) {
      vrows[j] = vraw[j];
    } else if (!bf16_pv) {                                 // widen once, use for all M rows
      for_lanes(D, [&](int64_t d, int w) { store_n(load_n(vraw[j] + d, w), vf + j * D + d, w); });
      vrows[j] = vf + j * D;
    }
  }
#if defined(BB_ISA_AVX512_BF16)
  if constexpr (bf16_dot) chunk_scores_bf16(h.qraw, M, D, krows, n, a.scale, h.s);
  else
#endif
    chunk_scores(h.qf, M, D, krows, n, h.s);
  // row t sees positions < seq - L + 1 + t
  auto visible = [&](int64_t m) { return std::min(n, seq - a.L + 1 + m / a.r - p0); };
  for (int64_t m = 0; m < M; ++m)
    h.alpha[m] = softmax_chunk(h.s + m * kAttnChunk, n, visible(m), h.m_i + m, h.l_i + m);
#if defined(BB_ISA_AVX512_BF16)
  if constexpr (bf16_dot) {
    if (bf16_pv) return pv_rows_bf16(h.acc, h.alpha, h.s, M, vraw, n, D);
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    if (visible(m) > 0) scale_accumulate(h.acc + m * D, h.alpha[m], h.s + m * kAttnChunk, vrows, visible(m), D);
}

template <typename T>
void store_head_rows(const AttnArgs<T>& a, int64_t b, int64_t kvh, int64_t split, const HeadRows<T>& h) {
  const int64_t D = a.D, M = a.r * a.L;
#if defined(BB_ISA_AVX512_BF16)
  if (kBf16Dot && std::is_same_v<T, bf16> && D % 32 == 0)
    for (int64_t m = 0; m < M; ++m) unpermute_pair_columns(h.acc + m * D, D);
#endif
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = (b * a.L + m / a.r) * a.nh + kvh * a.r + m % a.r;
    if (a.splits == 1) {
      const VF inv = VF::set1(h.l_i[m] > 0.f ? 1.f / h.l_i[m] : 0.f);
      for_lanes(D, [&](int64_t d, int w) { store_n(load_n(h.acc + m * D + d, w) * inv, a.out + row * D + d, w); });
    } else {
      const int64_t prow = row * a.splits + split;
      std::copy(h.acc + m * D, h.acc + (m + 1) * D, a.part_o + prow * D);
      a.part_m[prow] = h.m_i[m];
      a.part_l[prow] = h.l_i[m];
    }
  }
}

// KV heads [h0, h0 + hn) of request b over the context split `split`: the heads walk the blocks
// together, so with hn = nkv each block's K and V rows are read whole and in address order
template <typename T>
void attention_task(const AttnArgs<T>& a, int64_t b, int64_t h0, int64_t hn, int64_t split) {
  const int64_t D = a.D, M = a.r * a.L, seq = a.seq_lens[b];
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, bf16>;
  const int64_t per_head = 2 * M * D + 3 * M + M * kAttnChunk;
  std::vector<float> buf(hn * per_head + kAttnChunk * D);
  std::vector<T> qraw(bf16_dot ? hn * M * D : 0);          // q as stored, for the bf16 dot
  std::vector<HeadRows<T>> heads(hn);
  for (int64_t i = 0; i < hn; ++i) {
    float* f = buf.data() + i * per_head;
    heads[i] = {f, f + M * D, f + 2 * M * D, f + 2 * M * D + M, f + 2 * M * D + 2 * M, f + 2 * M * D + 3 * M,
                bf16_dot ? qraw.data() + i * M * D : nullptr};
    load_head_rows(a, b, h0 + i, heads[i]);
  }
  float* vf = buf.data() + hn * per_head;
  const int64_t start = split * a.tokens_per_split, end = std::min(seq, start + a.tokens_per_split);
  ChunkRows<T> rows;
  for (int64_t p0 = start; p0 < end;) {
    const int64_t n = std::min(kAttnChunk, end - p0);
    gather_chunk_rows(a, b, p0, n, rows);
    for (int64_t i = 0; i < hn; ++i) head_chunk(a, b, heads[i], rows, h0 + i, p0, n, vf);
    p0 += n;
  }
  for (int64_t i = 0; i < hn; ++i) store_head_rows(a, b, h0 + i, split, heads[i]);
}

// merge the split partials of one output row (query row, head)
template <typename T>
void attention_merge(const AttnArgs<T>& a, int64_t row) {
  const int64_t S = a.splits, D = a.D;
  const float *pm = a.part_m + row * S, *pl = a.part_l + row * S, *po = a.part_o + row * S * D;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < S; ++s) mx = std::max(mx, pm[s]);
  std::vector<float> w(S);
  const float* rows[64];
  float l = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    w[s] = pl[s] > 0.f ? std::exp(pm[s] - mx) : 0.f;
    l += w[s] * pl[s];
    rows[s] = po + s * D;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t s = 0; s < S; ++s) w[s] *= inv;
  for_lanes(D, [&](int64_t d, int m) {
    VF x = VF::zero();
    for (int64_t s = 0; s < S; ++s) x = fma(VF::set1(w[s]), load_n(rows[s] + d, m), x);
    store_n(x, a.out + row * D + d, m);
  });
}

// q [B, L, nh, D]; k_cache, v_cache [num_blocks, bs, nkv, D]; block_table [B, M]; seq_lens [B]
// (context + the L new tokens, already in the cache) -> [B, L, nh, D]
inline at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& block_table,
                                         const at::Tensor& seq_lens, int64_t max_seq_len, double scale) {
  RECORD_FUNCTION("bb::paged_attention_decode", std::vector<c10::IValue>());
  const char* op = "paged_attention_decode";
  check_dim(op, "q", q, 4);
  check_dim(op, "k_cache", k_cache, 4);
  BB_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": k_cache ", k_cache.sizes(), " and v_cache ",
           v_cache.sizes(), " differ in shape");
  for (auto* t : {&q, &k_cache, &v_cache}) check_last_contiguous(op, "q / k_cache / v_cache", *t);
  check_same_dtype(op, "k_cache", k_cache, q);
  check_same_dtype(op, "v_cache", v_cache, q);
  const int64_t B = q.size(0), L = q.size(1), nh = q.size(2), D = q.size(3), nkv = k_cache.size(2);
  const int64_t bs = k_cache.size(1);
  check_size(op, "k_cache", k_cache, 3, D);
  BB_CHECK(nkv > 0 && nh % nkv == 0, op, ": num heads (", nh, ") is not a multiple of num kv heads (", nkv, ")");
  BB_CHECK(L > 0, op, ": L must be positive");
  const Index2D bt = index2d(op, "block_table", block_table);
  check_size(op, "block_table", block_table, 0, B);
  const auto seq = read_indices(op, "seq_lens", seq_lens, block_table.size(1) * bs + 1);
  BB_CHECK(int64_t(seq.size()) == B, op, ": seq_lens has ", seq.size(), " entries, expected B=", B);
  int64_t longest = 0;
  for (int64_t s : seq) {
    BB_CHECK(s >= L, op, ": a sequence of ", s, " tokens cannot hold its ", L, " query rows");
    longest = std::max(longest, s);
  }
  (void)max_seq_len;                        // the kernel bounds each request by its own length
  // split the context only when the tasks would leave threads idle
  int64_t splits = 1;
  const int64_t threads = at::get_num_threads(), work = B * nkv;
  bool whole = B >= threads;                // a task takes all of a request's KV heads
  if (!whole && work % threads != 0 && longest >= 2 * kMinWholeSplitTokens) {
    whole = true;
    splits = std::min((threads + B - 1) / B, longest / kMinWholeSplitTokens);
  } else if (work < threads) {
    splits = std::max<int64_t>(1, std::min((threads + work - 1) / work, longest / kMinSplitTokens));
  }
  const int64_t tps = ((longest + splits - 1) / splits + bs - 1) / bs * bs;
  splits = std::min<int64_t>(64, (longest + tps - 1) / tps);
  at::Tensor out = at::empty({B, L, nh, D}, q.options());
  at::Tensor part = splits > 1 ? at::empty({B * L * nh * splits * (D + 2)}, q.options().dtype(at::kFloat))
                               : at::Tensor();
  with_float_dtype(op, q, [&](auto tag) {
    using T = decltype(tag);
    float* pb = splits > 1 ? ptr<float>(part) : nullptr;
    const int64_t P = B * L * nh * splits;
    AttnArgs<T> a{B, L, nh, nkv, nh / nkv, D, bs, k_cache.size(0), splits, tps,
                  ptr<T>(q), q.stride(0), q.stride(1), q.stride(2),
                  ptr<T>(k_cache), ptr<T>(v_cache), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt, seq.data(), float(scale),
                  ptr<T>(out), pb, pb ? pb + P * D : nullptr, pb ? pb + P * D + P : nullptr};
    // a task per request and split takes all its KV heads (whole blocks read in address order:
    // 5-14% faster than a task per head at 16-64 requests x 1024 context, same result) when the
    // requests alone keep every thread busy, or the per-head tasks would not divide evenly over
    // the threads (kMinWholeSplitTokens); else a task per (request, KV head, split)
    const int64_t hn = whole ? nkv : 1, groups = nkv / hn;
    at::parallel_for(0, B * groups * splits, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals ftz;
      for (int64_t i = begin; i < end; ++i)
        attention_task(a, i / (groups * splits), (i / splits) % groups * hn, hn, i % splits);
    });
    if (splits > 1)
      at::parallel_for(0, B * L * nh, 4, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) attention_merge(a, row);
      });
  });
  return out;
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
