// The prefix cache's block / slot copies in one call: slice src -> dst along one dim of every
// cache tensor (dim 0: KV caches [blocks, bs, nkv, D]; dim 1: GDN states [n_gdn, slots, ...]).
// The torch reference (ops/cache_copy.py) runs an index_select and an index_copy_ per tensor:
// with a draft head's proposer KV, each prefix-cache hit copies a partial block in all 31 caches
// of SmolLM2 (~0.41 ms a step that has one, 62 small torch calls); here it is a few memcpys.
// Copies are sequential, as the reference's: each task runs every pair in list order over its own
// slices (one tensor, one outer index: memory no other task touches), so a chain needs no care.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

struct Slices {
  char* base;
  int64_t outer, outer_stride, bytes;   // outer index range / its stride in bytes; one slice's bytes
};

inline Slices slices_of(const at::Tensor& t, int64_t dim, const std::vector<int64_t>& ids) {
  const char* op = "copy_slices";
  check_cpu(op, "tensor", t);
  BB_CHECK(t.is_contiguous(), op, ": every tensor must be contiguous, strides ", t.strides());
  BB_CHECK(t.dim() > dim, op, ": tensor of shape ", t.sizes(), " has no dim ", dim);
  for (int64_t i : ids)
    BB_CHECK(i >= 0 && i < t.size(dim), op, ": index ", i, " out of range for dim ", dim, " of shape ", t.sizes());
  const int64_t es = t.element_size();
  return {static_cast<char*>(t.data_ptr()), dim == 0 ? 1 : t.size(0), dim == 0 ? 0 : t.stride(0) * es,
          t.stride(dim) * es};
}

using Units = std::vector<std::pair<size_t, int64_t>>;   // (tensor, outer index): one task's slices

inline Units units_of(const std::vector<Slices>& ts) {
  Units units;
  for (size_t i = 0; i < ts.size(); ++i)
    for (int64_t o = 0; o < ts[i].outer; ++o) units.emplace_back(i, o);
  return units;
}

// every pair, in order, within each unit; parallel over units (disjoint memory), ~256 KB a task
inline void copy_pairs(const std::vector<Slices>& ts, const Units& units, const std::vector<int64_t>& src,
                       const std::vector<int64_t>& dst) {
  int64_t bytes = 0;
  for (const auto& u : units) bytes += ts[u.first].bytes;
  const int64_t per_unit = std::max<int64_t>(1, bytes * int64_t(src.size()) / int64_t(units.size()));
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / per_unit);
  at::parallel_for(0, int64_t(units.size()), grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const Slices& s = ts[units[u].first];
      char* base = s.base + units[u].second * s.outer_stride;
      for (size_t p = 0; p < src.size(); ++p)
        if (src[p] != dst[p]) std::memcpy(base + dst[p] * s.bytes, base + src[p] * s.bytes, s.bytes);
    }
  });
}

inline void copy_slices(const std::vector<at::Tensor>& tensors, int64_t dim, const std::vector<int64_t>& src,
                        const std::vector<int64_t>& dst) {
  RECORD_FUNCTION("bb::copy_slices", std::vector<c10::IValue>());
  BB_CHECK(dim == 0 || dim == 1, "copy_slices: dim must be 0 or 1, got ", dim);
  BB_CHECK(src.size() == dst.size(), "copy_slices: ", src.size(), " sources for ", dst.size(), " destinations");
  std::vector<int64_t> ids(src);
  ids.insert(ids.end(), dst.begin(), dst.end());
  std::vector<Slices> ts;
  for (const at::Tensor& t : tensors) ts.push_back(slices_of(t, dim, ids));   // every check before any copy
  const Units units = units_of(ts);
  if (!units.empty() && !src.empty()) copy_pairs(ts, units, src, dst);
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
