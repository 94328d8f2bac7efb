// Argument checks and raw addressing for the CPU kernels: every bad argument is a ValueError
// (TORCH_CHECK_VALUE) naming the op and the tensor, never a crash or a silent wrong answer.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "simd.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

#define BB_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

// run f(T{}) with T = float or bf16 for the tensor's dtype
template <typename F>
decltype(auto) with_float_dtype(const char* op, const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  BB_CHECK(t.scalar_type() == at::kBFloat16, op, ": dtype ", t.scalar_type(),
           " is not supported (float32 or bfloat16)");
  return f(bf16{});
}

template <typename T> inline T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  BB_CHECK(t.dim() == ndim, op, ": ", name, " must have ", ndim, " dims, got shape ", t.sizes());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t d, int64_t n) {
  BB_CHECK(t.size(d) == n, op, ": ", name, " has size ", t.size(d), " in dim ", d, ", expected ",
           n, " (shape ", t.sizes(), ")");
}

inline void check_last_contiguous(const char* op, const char* name, const at::Tensor& t) {
  BB_CHECK(t.dim() >= 1 && (t.stride(-1) == 1 || t.size(-1) <= 1), op, ": ", name,
           " must have a contiguous last dim, strides ", t.strides());
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  BB_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " is ", t.scalar_type(), ", expected ",
           like.scalar_type());
}

inline void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  BB_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

// a 1-D float vector of any float dtype and stride, read into fp32
inline std::vector<float> read_floats(const char* op, const char* name, const at::Tensor& t, int64_t n) {
  check_dim(op, name, t, 1);
  check_size(op, name, t, 0, n);
  std::vector<float> out(n);
  with_float_dtype(op, t, [&](auto tag) {
    using T = decltype(tag);
    const T* p = ptr<T>(t);
    for (int64_t i = 0; i < n; ++i) out[i] = to_f32(p[i * t.stride(0)]);
  });
  return out;
}

// an index tensor (int32 / int64, 1 or 2 dims, any strides), read row-major as int64 and
// checked against [0, bound)
inline std::vector<int64_t> read_indices(const char* op, const char* name, const at::Tensor& t,
                                         int64_t bound) {
  BB_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
           " must be int32 or int64, got ", t.scalar_type());
  BB_CHECK(t.dim() == 1 || t.dim() == 2, op, ": ", name, " must have 1 or 2 dims, got ", t.sizes());
  int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.size(-1);
  int64_t s0 = t.dim() == 2 ? t.stride(0) : 0, s1 = t.stride(-1);
  std::vector<int64_t> out(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      int64_t o = i * s0 + j * s1;
      int64_t v = t.scalar_type() == at::kLong ? ptr<int64_t>(t)[o] : ptr<int32_t>(t)[o];
      BB_CHECK(v >= 0 && v < bound, op, ": ", name, " holds ", v, ", outside [0, ", bound, ")");
      out[i * cols + j] = v;
    }
  return out;
}

// int32 / int64 2-D index tensor read in place (the block table: only the entries a kernel
// uses are read)
struct Index2D {
  const void* p = nullptr;
  bool i64 = true;
  int64_t s0 = 0, s1 = 0;
  int64_t at(int64_t i, int64_t j) const {
    int64_t o = i * s0 + j * s1;
    return i64 ? static_cast<const int64_t*>(p)[o] : static_cast<const int32_t*>(p)[o];
  }
};

inline Index2D index2d(const char* op, const char* name, const at::Tensor& t) {
  BB_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
           " must be int32 or int64, got ", t.scalar_type());
  check_dim(op, name, t, 2);
  return Index2D{t.data_ptr(), t.scalar_type() == at::kLong, t.stride(0), t.stride(1)};
}

// Rows of N elements of a tensor whose last dim is contiguous, leading dims collapsed into
// (outer, inner) with one stride each: row r starts at (r / inner) * s_outer + (r % inner) * s_inner.
// Covers contiguous tensors, column slices of a 2-D matrix and [T, h, N] head views of one.
struct Rows {
  int64_t count = 0, n = 0, inner = 1, s_outer = 0, s_inner = 0;
  int64_t offset(int64_t r) const { return (r / inner) * s_outer + (r % inner) * s_inner; }
};

inline Rows rows_of(const at::Tensor& t) {
  Rows r;
  r.n = t.size(-1);
  r.count = r.n ? t.numel() / r.n : 0;
  if (t.dim() == 1) return r;
  r.inner = t.size(-2);
  r.s_inner = t.stride(-2);
  if (t.dim() >= 3) r.s_outer = t.stride(-3);
  return r;
}

// a view the Rows form can address: last dim contiguous and at most 3 dims (else a copy)
inline at::Tensor as_rows_view(const at::Tensor& t) {
  at::Tensor x = (t.dim() >= 1 && (t.stride(-1) == 1 || t.size(-1) <= 1)) ? t : t.contiguous();
  if (x.dim() > 3) x = x.reshape({-1, x.size(-2), x.size(-1)});
  if (x.dim() > 3 || (x.dim() >= 1 && x.stride(-1) != 1 && x.size(-1) > 1)) x = x.contiguous();
  return x;
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
