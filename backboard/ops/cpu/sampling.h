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

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
