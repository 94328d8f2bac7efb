// Paged decode / verify attention over block tables: the CPU kernel of
// ops.attention.paged_attention_uniform (same arguments, same result).
//
// B requests with L query rows each, the last L positions of their sequences; row t of request
// b sees the keys at positions < seq_lens[b] - L + 1 + t. KV cache per layer [num_blocks,
// block_size, nkv, D]; position p of request b lives at block_table[b, p // bs], offset p % bs.
// One task per (request, KV head, context split) takes all r * L query rows that share the KV
// head (r = nh / nkv), so every K/V row is read (and widened to fp32) once per KV head; an online
// softmax (running max, sum, fp32 accumulator per row) runs over chunks of CHUNK tokens. The
// context is split (flash-decoding) only when B * nkv tasks would leave threads idle; the split
// partials are then merged in a second pass.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <limits>
#include <vector>

#include "simd.h"
#include "tensor_args.h"

namespace bb {

constexpr int64_t kAttnChunk = 16;          // tokens per softmax update (K/V rows widened at once)
constexpr int64_t kMinSplitTokens = 256;    // never split the context finer than this

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

// acc = acc * alpha + sum_j p[j] * rows[j]   (D columns, four vectors at a time)
inline void scale_accumulate(float* acc, float alpha, const float* p, const float* const* rows,
                             int64_t n, int64_t D) {
  const VF va = VF::set1(alpha);
  for_lanes(D, [&](int64_t d, int m) {
    VF x = load_n(acc + d, m) * va;
    for (int64_t j = 0; j < n; ++j) x = fma(VF::set1(p[j]), load_n(rows[j] + d, m), x);
    store_n(x, acc + d, m);
  });
}

// running softmax state of one query row over one chunk of n visible keys
inline void online_softmax_update(const float* qrow, const float* const* krows, const float* const* vrows,
                                  int64_t n, int64_t D, float* m_i, float* l_i, float* acc, float* p) {
  float mx = *m_i;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = dot(qrow, krows[j], D);
    mx = std::max(mx, p[j]);
  }
  const float alpha = std::exp(*m_i - mx);               // 0 on the first chunk (m_i = -inf)
  const VF vmx = VF::set1(mx);
  VF sum = VF::zero();
  for_lanes(n, [&](int64_t j, int m) {
    VF e = vexp(load_n(p + j, m) - vmx);
    store_n(e, p + j, m);
    sum = sum + (m == VF::N ? e : VF::load(p + j, m));    // masked lanes of e may be non-zero
  });
  *l_i = *l_i * alpha + sum.sum();
  *m_i = mx;
  scale_accumulate(acc, alpha, p, vrows, n, D);
}

template <typename T>
void attention_task(const AttnArgs<T>& a, int64_t b, int64_t kvh, int64_t split) {
  const int64_t D = a.D, M = a.r * a.L, seq = a.seq_lens[b];
  std::vector<float> buf(2 * M * D + 2 * M + 2 * kAttnChunk * D + kAttnChunk);
  float *qf = buf.data(), *acc = qf + M * D, *m_i = acc + M * D, *l_i = m_i + M;
  float *kf = l_i + M, *vf = kf + kAttnChunk * D, *p = vf + kAttnChunk * D;
  for (int64_t m = 0; m < M; ++m) {                        // row m: query row m / r, head kvh*r + m % r
    const T* qs = a.q + b * a.sq_b + (m / a.r) * a.sq_l + (kvh * a.r + m % a.r) * a.sq_h;
    for_lanes(D, [&](int64_t d, int n) { store_n(load_n(qs + d, n) * VF::set1(a.scale), qf + m * D + d, n); });
    std::fill(acc + m * D, acc + (m + 1) * D, 0.f);
    m_i[m] = -std::numeric_limits<float>::infinity();
    l_i[m] = 0.f;
  }
  const int64_t start = split * a.tokens_per_split, end = std::min(seq, start + a.tokens_per_split);
  const float* krows[kAttnChunk];
  const float* vrows[kAttnChunk];
  for (int64_t p0 = start; p0 < end;) {
    const int64_t blk = a.block_table.at(b, p0 / a.bs), off = p0 % a.bs;
    BB_CHECK(blk >= 0 && blk < a.num_blocks, "paged_attention_decode: block_table holds ", blk,
             ", outside [0, ", a.num_blocks, ")");
    const int64_t n = std::min({kAttnChunk, a.bs - off, end - p0});
    const T* kb = a.k + blk * a.sk_blk + off * a.sk_tok + kvh * a.sk_head;
    const T* vb = a.v + blk * a.sv_blk + off * a.sv_tok + kvh * a.sv_head;
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        krows[j] = kb + j * a.sk_tok;
        vrows[j] = vb + j * a.sv_tok;
      } else {                                             // widen once, use for all M rows
        for_lanes(D, [&](int64_t d, int w) {
          store_n(load_n(kb + j * a.sk_tok + d, w), kf + j * D + d, w);
          store_n(load_n(vb + j * a.sv_tok + d, w), vf + j * D + d, w);
        });
        krows[j] = kf + j * D;
        vrows[j] = vf + j * D;
      }
    }
    for (int64_t m = 0; m < M; ++m) {                      // row t sees positions < seq - L + 1 + t
      const int64_t visible = std::min(n, seq - a.L + 1 + m / a.r - p0);
      if (visible > 0)
        online_softmax_update(qf + m * D, krows, vrows, visible, D, m_i + m, l_i + m, acc + m * D, p);
    }
    p0 += n;
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = (b * a.L + m / a.r) * a.nh + kvh * a.r + m % a.r;
    if (a.splits == 1) {
      const VF inv = VF::set1(l_i[m] > 0.f ? 1.f / l_i[m] : 0.f);
      for_lanes(D, [&](int64_t d, int w) { store_n(load_n(acc + m * D + d, w) * inv, a.out + row * D + d, w); });
    } else {
      const int64_t prow = row * a.splits + split;
      std::copy(acc + m * D, acc + (m + 1) * D, a.part_o + prow * D);
      a.part_m[prow] = m_i[m];
      a.part_l[prow] = l_i[m];
    }
  }
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
  // split the context only when the (request, kv head) tasks leave threads idle
  int64_t splits = 1;
  const int64_t threads = at::get_num_threads(), work = B * nkv;
  if (work < threads)
    splits = std::max<int64_t>(1, std::min((threads + work - 1) / work, longest / kMinSplitTokens));
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
    at::parallel_for(0, B * nkv * splits, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) attention_task(a, i / (nkv * splits), (i / splits) % nkv, i % splits);
    });
    if (splits > 1)
      at::parallel_for(0, B * L * nh, 4, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) attention_merge(a, row);
      });
  });
  return out;
}

}  // namespace bb
