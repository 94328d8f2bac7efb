// Large kernel outputs on pages that stay mapped: a small cache of freed blocks.
//
// glibc maps an allocation over 32 MiB afresh and unmaps it on free, so each step's logits (64
// rows of a 248K vocabulary in fp32: 64 MB) took 15,500 page faults, each a zeroed page: 67 ms
// for the LM head at M = 64 on a Zen 4 where its arithmetic takes 43. Blocks of MIN_BYTES and
// more come from here instead (2 MiB aligned, huge pages asked for); a freed tensor's block goes
// back to the cache, which keeps the last CAP blocks and frees older ones.
//
//   at::Tensor y = big::empty({M, N}, options);     // at::empty below MIN_BYTES
#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace bb {
namespace big {

constexpr size_t MIN_BYTES = size_t(8) << 20, ALIGN = size_t(2) << 20, CAP = 4;

struct Cache {
  std::mutex mu;
  std::vector<std::pair<void*, size_t>> blocks;     // oldest first
};

inline Cache& cache() {
  static Cache* c = new Cache;                       // never destroyed: tensors may outlive statics
  return *c;
}

inline void give(void* p, size_t n) {
  Cache& c = cache();
  std::lock_guard<std::mutex> g(c.mu);
  c.blocks.emplace_back(p, n);
  if (c.blocks.size() > CAP) {
    std::free(c.blocks.front().first);
    c.blocks.erase(c.blocks.begin());
  }
}

// the smallest cached block of at least n bytes, else a new one; its size in *got
inline void* take(size_t n, size_t* got) {
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> g(c.mu);
    auto best = c.blocks.end();
    for (auto it = c.blocks.begin(); it != c.blocks.end(); ++it)
      if (it->second >= n && (best == c.blocks.end() || it->second < best->second)) best = it;
    if (best != c.blocks.end()) {
      void* p = best->first;
      *got = best->second;
      c.blocks.erase(best);
      return p;
    }
  }
  *got = (n + ALIGN - 1) / ALIGN * ALIGN;
  void* p = nullptr;
  if (posix_memalign(&p, ALIGN, *got) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, *got, MADV_HUGEPAGE);                   // advice only: fine where THP is off
#endif
  return p;
}

// min_bytes: smaller tensors come from at::empty (scratch reused every call may ask for less)
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opt, size_t min_bytes = MIN_BYTES) {
  size_t n = size_t(c10::elementSize(c10::typeMetaToScalarType(opt.dtype())));
  for (int64_t s : sizes) n *= size_t(s);
  if (n < min_bytes) return at::empty(sizes, opt);
  size_t got = 0;
  void* p = take(n, &got);
  return at::from_blob(p, sizes, [got](void* q) { give(q, got); }, opt);
}

}  // namespace big
}  // namespace bb
