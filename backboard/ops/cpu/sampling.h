// Random sampling's draw: one token per row of probabilities p [R, V] (fp32, >= 0, any positive
// sum) by the inverse CDF at u [R] in [0, 1): the first index i whose running sum (fp64) exceeds
// u * sum(p), as ops.sampling.sample_inverse_cdf_ref. One uniform a row instead of the exponential
// race's V exponentials: torch's CPU exponential_ took 3.55 ms a row of a 248K vocabulary (56 ms
// for 16 rows) on a Zen 5, more than the decode step itself; this reads the row once.
// Chunk sums are threaded over (row, chunk) like argmax_rows; each row then walks its chunk sums
// and scans one chunk. A row without a positive finite sum gets its argmax (torch's rule).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <vector>

#include "argmax.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

constexpr int64_t kCdfChunk = 4096;

// sum of p[0 .. n) in fp64, eight independent accumulators (vectorisable, deterministic)
inline double chunk_sum(const float* p, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += double(p[i + j]);
  for (; i < n; ++i) acc[0] += double(p[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline int64_t row_inverse_cdf(const float* p, int64_t V, const double* sums, int64_t nch, double u) {
  double total = 0;
  for (int64_t c = 0; c < nch; ++c) total += sums[c];
  if (!(total > 0) || !std::isfinite(total)) return argmax_exact(p, V);
  const double target = u * total;
  double run = 0;
  int64_t c = 0;
  while (c < nch - 1 && run + sums[c] <= target) run += sums[c++];
  int64_t last = -1;                            // the last positive entry seen (rounding's fallback)
  for (int64_t k = c; k < nch; ++k) {
    for (int64_t i = k * kCdfChunk, e = std::min(V, i + kCdfChunk); i < e; ++i) {
      if (!(p[i] > 0)) continue;
      run += double(p[i]);
      last = i;
      if (run > target) return i;
    }
  }
  return last >= 0 ? last : argmax_exact(p, V);
}

// p [R, V] fp32 (rows contiguous), u [R] fp64 -> int64 [R]
inline at::Tensor sample_inverse_cdf(const at::Tensor& p, const at::Tensor& u) {
  RECORD_FUNCTION("bb::sample_inverse_cdf", std::vector<c10::IValue>());
  BB_CHECK(p.dim() == 2 && p.scalar_type() == at::kFloat && p.stride(1) == 1 && p.size(1) > 0,
           "sample_inverse_cdf: p must be 2-D float32 [R, V > 0] with contiguous rows, got ",
           p.scalar_type(), " ", p.sizes());
  BB_CHECK(u.dim() == 1 && u.size(0) == p.size(0) && u.scalar_type() == at::kDouble && u.is_contiguous(),
           "sample_inverse_cdf: u must be float64 [R] (R = ", p.size(0), "), got ", u.scalar_type(), " ",
           u.sizes());
  const int64_t R = p.size(0), V = p.size(1), ld = p.stride(0);
  const int64_t nch = (V + kCdfChunk - 1) / kCdfChunk;
  const float* pp = ptr<float>(p);
  std::vector<double> sums(R * nch);
  at::parallel_for(0, R * nch, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t c = t % nch;
      sums[t] = chunk_sum(pp + (t / nch) * ld + c * kCdfChunk, std::min(kCdfChunk, V - c * kCdfChunk));
    }
  });
  at::Tensor out = at::empty({R}, p.options().dtype(at::kLong));
  int64_t* po = ptr<int64_t>(out);
  const double* pu = u.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) po[r] = row_inverse_cdf(pp + r * ld, V, sums.data() + r * nch, nch, pu[r]);
  });
  return out;
}

// ---- temperature alone: softmax and draw in one op ------------------------------------------
// logits [R, V] fp32, inv_t [R] fp32 (1 / temperature), u [R] fp64 -> int64 [R]: the draw of
// softmax(logits * inv_t) as sample_inverse_cdf would make it, the probabilities never written
// (torch's softmax over [16, 248K] took ~4 ms a decode step). exp(x - max) in fp32 (vexp), summed
// in fp64 by chunk; the chosen chunk is scanned again with the same exps. A row whose maximum is
// not finite (a NaN, +inf, or nothing but -inf) gets its argmax.
constexpr int64_t kExpChunk = 4096;

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

// the same exps, handed to f(i, value) in order
template <typename F>
inline void chunk_exps(const float* p, int64_t n, float mx, float it, F&& f) {
  const VF vm = VF::set1(mx), vt = VF::set1(it);
  float e[VF::N];
  for_lanes(n, [&](int64_t i, int k) {
    exps(p + i, k, vm, vt).store(e);
    for (int j = 0; j < k; ++j) f(i + j, e[j]);
  });
}

inline int64_t row_tempered(const float* p, int64_t V, float mx, float it, const double* sums, int64_t nch,
                            double u) {
  if (!std::isfinite(mx)) return argmax_exact(p, V);
  double total = 0;
  for (int64_t c = 0; c < nch; ++c) total += sums[c];
  const double target = u * total;
  double run = 0;
  int64_t c = 0;
  while (c < nch - 1 && run + sums[c] <= target) run += sums[c++];
  int64_t last = -1, found = -1;
  for (int64_t k = c; k < nch && found < 0; ++k) {
    const int64_t start = k * kExpChunk;
    chunk_exps(p + start, std::min(kExpChunk, V - start), mx, it, [&](int64_t i, float e) {
      if (found >= 0 || !(e > 0)) return;
      run += double(e);
      last = start + i;
      if (run > target) found = start + i;
    });
  }
  return found >= 0 ? found : (last >= 0 ? last : argmax_exact(p, V));
}

inline at::Tensor sample_logits(const at::Tensor& x, const at::Tensor& inv_t, const at::Tensor& u) {
  RECORD_FUNCTION("bb::sample_logits", std::vector<c10::IValue>());
  BB_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
           "sample_logits: logits must be 2-D float32 [R, V > 0] with contiguous rows, got ",
           x.scalar_type(), " ", x.sizes());
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  BB_CHECK(inv_t.dim() == 1 && inv_t.size(0) == R && inv_t.scalar_type() == at::kFloat && inv_t.is_contiguous(),
           "sample_logits: inv_t must be float32 [R] (R = ", R, ")");
  BB_CHECK(u.dim() == 1 && u.size(0) == R && u.scalar_type() == at::kDouble && u.is_contiguous(),
           "sample_logits: u must be float64 [R] (R = ", R, ")");
  const int64_t nch = (V + kExpChunk - 1) / kExpChunk;
  const float *px = ptr<float>(x), *pt = inv_t.data_ptr<float>();
  std::vector<float> cmax(R * nch), rmax(R);
  std::vector<double> sums(R * nch);
  auto chunk = [&](int64_t t) { return std::min(kExpChunk, V - (t % nch) * kExpChunk); };
  auto at = [&](int64_t t) { return px + (t / nch) * ld + (t % nch) * kExpChunk; };
  at::parallel_for(0, R * nch, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) cmax[t] = chunk_max_finite(at(t), chunk(t));
  });
  for (int64_t r = 0; r < R; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < nch && !std::isnan(m); ++c) m = std::isnan(cmax[r * nch + c]) ? NAN : std::max(m, cmax[r * nch + c]);
    rmax[r] = m;
  }
  at::parallel_for(0, R * nch, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      sums[t] = std::isfinite(rmax[t / nch]) ? chunk_exp_sum(at(t), chunk(t), rmax[t / nch], pt[t / nch]) : 0.0;
  });
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* po = ptr<int64_t>(out);
  const double* pu = u.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      po[r] = row_tempered(px + r * ld, V, rmax[r], pt[r], sums.data() + r * nch, nch, pu[r]);
  });
  return out;
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
