// Greedy sampling's argmax over fp32 logits [R, V] as torch.argmax(x, -1) returns it: the first
// index of the largest value, a NaN counting as larger than everything (its first index then).
// torch's CPU argmax read the LM head's logits at ~10 GB/s on a Zen 4 (1.6 ms for 16 rows of a
// 248K vocabulary, 6.6 ms for 64: 6-7% of a decode step); this reads them once, vectorised and
// threaded over (row, chunk), then scans only the chunk that holds each row's maximum.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "simd.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

constexpr int64_t kArgmaxChunk = 16384;       // elements per task (64 KiB)

struct ChunkMax {
  float max;
  bool special;                               // an inf or a NaN in the chunk: scan it exactly
};

// the largest of p[0 .. n); `special` when some element is not finite (x * 0 is then NaN)
inline ChunkMax chunk_max(const float* p, int64_t n) {
  const int64_t nv = n - n % VF::N;
  VF m = VF::set1(-std::numeric_limits<float>::infinity()), z = VF::zero();
  for (int64_t i = 0; i < nv; i += VF::N) {
    const VF v = VF::load(p + i);
    m = vmax(m, v);
    z = z + v * VF::zero();
  }
  float mx = m.max(), zs = z.sum();
  for (int64_t i = nv; i < n; ++i) {
    mx = std::max(mx, p[i]);
    zs += p[i] * 0.f;
  }
  return {mx, !(zs == 0.f)};
}

// torch's rule, element by element (rows with an inf or a NaN)
inline int64_t argmax_exact(const float* p, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(p[i])) return i;
    if (p[i] > p[best]) best = i;
  }
  return best;
}

inline int64_t row_argmax(const float* p, int64_t V, const ChunkMax* cm, int64_t nch) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < nch; ++c) {
    if (cm[c].special) return argmax_exact(p, V);
    mx = std::max(mx, cm[c].max);
  }
  for (int64_t c = 0; c < nch; ++c) {
    if (cm[c].max != mx) continue;
    for (int64_t i = c * kArgmaxChunk, e = std::min(V, i + kArgmaxChunk); i < e; ++i)
      if (p[i] == mx) return i;
  }
  return 0;                                   // unreachable: the maximum is some element
}

// ---- row-wise ops over [R, V] fp32 (argmax here, the sampling draws in sampling.h) --------------
inline void check_rows(const at::Tensor& x, const char* op, const char* name) {
  BB_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
           op, ": ", name, " must be 2-D float32 [R, V > 0] with contiguous rows, got ", x.scalar_type(), " ",
           x.sizes());
}

// f(t, chunk start, chunk length) for every (row, chunk) of x, t = row * nch + chunk, threaded over t
template <typename F>
inline void parallel_row_chunks(const at::Tensor& x, int64_t chunk, F&& f) {
  const int64_t V = x.size(1), ld = x.stride(0), nch = (V + chunk - 1) / chunk;
  const float* px = ptr<float>(x);
  at::parallel_for(0, x.size(0) * nch, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t c = t % nch;
      f(t, px + (t / nch) * ld + c * chunk, std::min(chunk, V - c * chunk));
    }
  });
}

// int64 [R]: f(r) for every row, threaded over rows
template <typename F>
inline at::Tensor ids_by_row(const at::Tensor& x, F&& f) {
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* po = ptr<int64_t>(out);
  at::parallel_for(0, x.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) po[r] = f(r);
  });
  return out;
}

// x [R, V] fp32 (rows contiguous) -> int64 [R]
inline at::Tensor argmax_rows(const at::Tensor& x) {
  RECORD_FUNCTION("bb::argmax_rows", std::vector<c10::IValue>());
  check_rows(x, "argmax_rows", "x");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  const int64_t nch = (V + kArgmaxChunk - 1) / kArgmaxChunk;
  const float* px = ptr<float>(x);
  std::vector<ChunkMax> cm(R * nch);
  parallel_row_chunks(x, kArgmaxChunk, [&](int64_t t, const float* p, int64_t n) { cm[t] = chunk_max(p, n); });
  return ids_by_row(x, [&](int64_t r) { return row_argmax(px + r * ld, V, cm.data() + r * nch, nch); });
}

// ---- greedy decoding's screen (ops/argmax_screen.py) ---------------------------------------------
// approx [R, N] (the INT8 LM head's logits), slack [N] and norm [R] (||x||_1 of each row): row r's
// exact logit i lies in approx[r, i] -+ slack[i] * norm[r], so only the i whose upper end reaches
// the largest lower end can be the row's maximum. Threaded over (row, chunk): each chunk's largest
// lower and upper ends, then only the chunks whose upper end reaches the row's largest lower end
// are scanned for the indices. -> (int64 [R + 1] offsets into int64 [n] indices, ascending per row)
struct ScreenChunk {
  float lo, hi;
};

inline ScreenChunk screen_chunk(const float* a, const float* c, float s, int64_t n) {
  const int64_t nv = n - n % VF::N;
  const VF vs = VF::set1(s);
  VF lo = VF::set1(-std::numeric_limits<float>::infinity()), hi = lo;
  for (int64_t i = 0; i < nv; i += VF::N) {
    const VF v = VF::load(a + i), d = VF::load(c + i) * vs;
    lo = vmax(lo, v - d);
    hi = vmax(hi, v + d);
  }
  float l = lo.max(), h = hi.max();
  for (int64_t i = nv; i < n; ++i) {
    l = std::max(l, a[i] - c[i] * s);
    h = std::max(h, a[i] + c[i] * s);
  }
  return {l, h};
}

inline std::tuple<at::Tensor, at::Tensor> screen_candidates(const at::Tensor& approx, const at::Tensor& slack,
                                                            const at::Tensor& norm) {
  RECORD_FUNCTION("bb::screen_candidates", std::vector<c10::IValue>());
  check_rows(approx, "screen_candidates", "approx");
  const int64_t R = approx.size(0), N = approx.size(1), ld = approx.stride(0);
  BB_CHECK(slack.dim() == 1 && slack.size(0) == N && slack.scalar_type() == at::kFloat && slack.is_contiguous(),
           "screen_candidates: slack must be contiguous float32 [", N, "], got ", slack.sizes());
  BB_CHECK(norm.dim() == 1 && norm.size(0) == R && norm.scalar_type() == at::kFloat && norm.is_contiguous(),
           "screen_candidates: norm must be contiguous float32 [", R, "], got ", norm.sizes());
  const int64_t nch = (N + kArgmaxChunk - 1) / kArgmaxChunk;
  const float *pa = ptr<float>(approx), *pc = ptr<float>(slack), *ps = ptr<float>(norm);
  std::vector<ScreenChunk> ch(R * nch);
  parallel_row_chunks(approx, kArgmaxChunk, [&](int64_t t, const float* p, int64_t n) {
    ch[t] = screen_chunk(p, pc + (t % nch) * kArgmaxChunk, ps[t / nch], n);
  });
  std::vector<int64_t> idx, off{0};
  for (int64_t r = 0; r < R; ++r) {
    float floor = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < nch; ++c) floor = std::max(floor, ch[r * nch + c].lo);
    for (int64_t c = 0; c < nch; ++c) {
      if (!(ch[r * nch + c].hi >= floor)) continue;
      for (int64_t i = c * kArgmaxChunk, e = std::min(N, i + kArgmaxChunk); i < e; ++i)
        if (pa[r * ld + i] + pc[i] * ps[r] >= floor) idx.push_back(i);
    }
    off.push_back(int64_t(idx.size()));
  }
  auto to_tensor = [](const std::vector<int64_t>& v) {
    at::Tensor t = at::empty({int64_t(v.size())}, at::TensorOptions().dtype(at::kLong));
    std::copy(v.begin(), v.end(), ptr<int64_t>(t));
    return t;
  };
  return {to_tensor(off), to_tensor(idx)};
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
