// Random sampling's draw: one token per row of probabilities p [R, V] (fp32, >= 0, any positive
// sum) by the inverse CDF at u [R] in [0, 1): the first index i whose running sum (fp64) exceeds
// u * sum(p), as ops.sampling.sample_inverse_cdf_ref. One uniform a row instead of the exponential
// race's V exponentials: torch's CPU exponential_ took 3.55 ms a row of a 248K vocabulary (56 ms
// for 16 rows) on a Zen 5, more than the decode step itself; this reads the row once.
// Chunk sums are threaded over (row, chunk) like argmax_rows; each row then walks its chunk sums
// and scans one chunk. A row without a positive finite sum gets its argmax (torch's rule). With
// temperature alone the draw reads the logits themselves (sample_logits, below).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <vector>

#include "argmax.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

constexpr int64_t kDrawChunk = 4096;

// The inverse CDF of a row in chunks: sums [nch] the chunks' sums (fp64); values(k, f) hands chunk
// k's values to f(index in the row, value) in order. The first index whose running sum exceeds
// u * total; when rounding leaves none, the last positive value's; -1 when the row has no positive
// finite mass.
template <typename Values>
inline int64_t chunked_inverse_cdf(const double* sums, int64_t nch, double u, Values&& values) {
  double total = 0;
  for (int64_t c = 0; c < nch; ++c) total += sums[c];
  if (!(total > 0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  double run = 0;
  int64_t c = 0;
  while (c < nch - 1 && run + sums[c] <= target) run += sums[c++];
  int64_t last = -1, found = -1;
  for (int64_t k = c; k < nch && found < 0; ++k)
    values(k, [&](int64_t i, float v) {
      if (found >= 0 || !(v > 0)) return;
      run += double(v);
      last = i;
      if (run > target) found = i;
    });
  return found >= 0 ? found : last;
}

// sum of p[0 .. n) in fp64, eight independent accumulators (vectorisable, deterministic)
inline double chunk_sum(const float* p, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += double(p[i + j]);
  for (; i < n; ++i) acc[0] += double(p[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// p [R, V] fp32 (rows contiguous), u [R] fp64 -> int64 [R]
inline at::Tensor sample_inverse_cdf(const at::Tensor& p, const at::Tensor& u) {
  RECORD_FUNCTION("bb::sample_inverse_cdf", std::vector<c10::IValue>());
  check_rows(p, "sample_inverse_cdf", "p");
  BB_CHECK(u.dim() == 1 && u.size(0) == p.size(0) && u.scalar_type() == at::kDouble && u.is_contiguous(),
           "sample_inverse_cdf: u must be float64 [R] (R = ", p.size(0), "), got ", u.scalar_type(), " ",
           u.sizes());
  const int64_t V = p.size(1), ld = p.stride(0), nch = (V + kDrawChunk - 1) / kDrawChunk;
  const float* pp = ptr<float>(p);
  const double* pu = u.data_ptr<double>();
  std::vector<double> sums(p.size(0) * nch);
  parallel_row_chunks(p, kDrawChunk, [&](int64_t t, const float* x, int64_t n) { sums[t] = chunk_sum(x, n); });
  return ids_by_row(p, [&](int64_t r) {
    const float* row = pp + r * ld;
    const int64_t i = chunked_inverse_cdf(sums.data() + r * nch, nch, pu[r], [&](int64_t k, auto&& f) {
      for (int64_t j = k * kDrawChunk, e = std::min(V, j + kDrawChunk); j < e; ++j) f(j, row[j]);
    });
    return i >= 0 ? i : argmax_exact(row, V);
  });
}

// ---- temperature alone: softmax and draw in one op ------------------------------------------
// logits [R, V] fp32, inv_t [R] fp32 (1 / temperature), u [R] fp64 -> int64 [R]: the draw of
// softmax(logits * inv_t) as sample_inverse_cdf would make it, the probabilities never written
// (torch's softmax over [16, 248K] took ~4 ms a decode step). exp(x - max) in fp32 (vexp), summed
// in fp64 by chunk; the chosen chunk is scanned again with the same exps. A row whose maximum is
// not finite (a NaN, +inf, or nothing but -inf) gets its argmax.

// the chunk's maximum, or NaN when it holds a NaN or +inf (-inf, a masked token, is fine)
inline float chunk_max_finite(const float* p, int64_t n) {
  const ChunkMax cm = chunk_max(p, n);
  if (cm.special)
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(p[i]) || p[i] == std::numeric_limits<float>::infinity()) return NAN;
  return cm.max;
}

// exp((p[i] - mx) * it) of k <= N values, lanes past k zero
inline VF exps(const float* p, int k, VF vm, VF vt) {
  const VF e = vexp((load_n(p, k) - vm) * vt);
  if (k == VF::N) return e;
  float b[VF::N];
  e.store(b);
  for (int j = k; j < VF::N; ++j) b[j] = 0.f;
  return VF::load(b);
}

inline double chunk_exp_sum(const float* p, int64_t n, float mx, float it) {
  const VF vm = VF::set1(mx), vt = VF::set1(it);
  double total = 0;
  for (int64_t b = 0; b < n; b += 256) {               // fp32 lanes over 256 values, then fp64
    VF acc = VF::zero();
    for_lanes(std::min<int64_t>(256, n - b), [&](int64_t i, int k) { acc = acc + exps(p + b + i, k, vm, vt); });
    total += double(acc.sum());
  }
  return total;
}

// the same exps of p[0 .. n), handed to f(offset + i, value) in order
template <typename F>
inline void chunk_exps(const float* p, int64_t n, int64_t offset, float mx, float it, F&& f) {
  const VF vm = VF::set1(mx), vt = VF::set1(it);
  float e[VF::N];
  for_lanes(n, [&](int64_t i, int k) {
    exps(p + i, k, vm, vt).store(e);
    for (int j = 0; j < k; ++j) f(offset + i + j, e[j]);
  });
}

inline at::Tensor sample_logits(const at::Tensor& x, const at::Tensor& inv_t, const at::Tensor& u) {
  RECORD_FUNCTION("bb::sample_logits", std::vector<c10::IValue>());
  check_rows(x, "sample_logits", "logits");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0), nch = (V + kDrawChunk - 1) / kDrawChunk;
  BB_CHECK(inv_t.dim() == 1 && inv_t.size(0) == R && inv_t.scalar_type() == at::kFloat && inv_t.is_contiguous(),
           "sample_logits: inv_t must be float32 [R] (R = ", R, ")");
  BB_CHECK(u.dim() == 1 && u.size(0) == R && u.scalar_type() == at::kDouble && u.is_contiguous(),
           "sample_logits: u must be float64 [R] (R = ", R, ")");
  const float *px = ptr<float>(x), *pt = inv_t.data_ptr<float>();
  const double* pu = u.data_ptr<double>();
  std::vector<float> cmax(R * nch), rmax(R, -std::numeric_limits<float>::infinity());
  std::vector<double> sums(R * nch);
  parallel_row_chunks(x, kDrawChunk, [&](int64_t t, const float* p, int64_t n) { cmax[t] = chunk_max_finite(p, n); });
  for (int64_t t = 0; t < R * nch; ++t)            // NaN (a chunk's mark) stays
    rmax[t / nch] = std::isnan(cmax[t]) || std::isnan(rmax[t / nch]) ? NAN : std::max(rmax[t / nch], cmax[t]);
  parallel_row_chunks(x, kDrawChunk, [&](int64_t t, const float* p, int64_t n) {
    const int64_t r = t / nch;
    sums[t] = std::isfinite(rmax[r]) ? chunk_exp_sum(p, n, rmax[r], pt[r]) : 0.0;
  });
  return ids_by_row(x, [&](int64_t r) {
    const float* row = px + r * ld;
    if (!std::isfinite(rmax[r])) return argmax_exact(row, V);
    const int64_t i = chunked_inverse_cdf(sums.data() + r * nch, nch, pu[r], [&](int64_t k, auto&& f) {
      const int64_t start = k * kDrawChunk;
      chunk_exps(row + start, std::min(kDrawChunk, V - start), start, rmax[r], pt[r], f);
    });
    return i >= 0 ? i : argmax_exact(row, V);
  });
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
