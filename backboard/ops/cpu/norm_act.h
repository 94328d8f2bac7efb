// RMSNorm (Norm0 `(1 + w)` and plain `w`), fused residual add + RMSNorm, the GDN gated output
// norm and SiLU-mul: one row of N elements at a time, fp32 math, rounded to the model dtype T
// exactly where the torch references (ops/norm.py, ops/activation.py) round.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <tuple>

#include "simd.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

// ---- one row --------------------------------------------------------------------------------
// y = x * rsqrt(mean(x^2) + eps) * (w + w_off), one rounding (w_off = 1: Norm0, 0: plain)
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* y, int64_t n, float eps, float w_off) {
  const VF inv = VF::set1(1.f / std::sqrt(sum_squares(x, n) / float(n) + eps));
  const VF off = VF::set1(w_off);
  for_lanes(n, [&](int64_t i, int m) {
    store_n((load_n(x + i, m) * inv) * (load_n(w + i, m) + off), y + i, m);
  });
}

// r = x + res (rounded to T, as `h = h + x`), y = rms_norm(r)
template <typename T>
inline void add_rms_norm_row(const T* x, const T* res, const T* w, T* y, T* r, int64_t n, float eps,
                             float w_off) {
  for_lanes(n, [&](int64_t i, int m) { store_n(load_n(x + i, m) + load_n(res + i, m), r + i, m); });
  rms_norm_row(r, w, y, n, eps, w_off);
}

// y = round(round(round(x * rsqrt(mean(x^2) + eps)) * w) * silu(z))  (ops.norm.gated_rms_norm)
template <typename T>
inline void gated_rms_norm_row(const T* x, const T* z, const T* w, T* y, int64_t n, float eps) {
  const VF inv = VF::set1(1.f / std::sqrt(sum_squares(x, n) / float(n) + eps));
  for_lanes(n, [&](int64_t i, int m) {
    VF a = round_vec<T>(load_n(x + i, m) * inv);
    a = round_vec<T>(load_n(w + i, m) * a);
    store_n(a * vsilu(load_n(z + i, m)), y + i, m);
  });
}

// y = round(round(silu(g)) * u)  (F.silu(gate) * up in the model dtype)
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* y, int64_t n) {
  for_lanes(n, [&](int64_t i, int m) {
    store_n(round_vec<T>(vsilu(load_n(g + i, m))) * load_n(u + i, m), y + i, m);
  });
}

// rows [0, count) of n elements in parallel, enough elements per task to pay for a thread
template <typename F> inline void parallel_rows(int64_t count, int64_t n, F&& f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, count, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f(r);
  });
}

inline void check_weight(const char* op, const at::Tensor& w, const at::Tensor& x) {
  check_dim(op, "weight", w, 1);
  check_size(op, "weight", w, 0, x.size(-1));
  check_same_dtype(op, "weight", w, x);
  BB_CHECK(w.is_contiguous(), op, ": weight must be contiguous");
}

// ---- ops (the references' signatures) ------------------------------------------------------
// x: [..., N] (last dim contiguous; rows may be strided views, e.g. q heads of a joined
// projection) -> [..., N] contiguous
inline at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps, bool zero_centered) {
  RECORD_FUNCTION("bb::rms_norm", std::vector<c10::IValue>());
  const char* op = "rms_norm";
  at::Tensor x = as_rows_view(x_);
  check_weight(op, w, x);
  at::Tensor y = at::empty(x_.sizes(), x.options());
  Rows rx = rows_of(x);
  with_float_dtype(op, x, [&](auto tag) {
    using T = decltype(tag);
    const T *px = ptr<T>(x), *pw = ptr<T>(w);
    T* py = ptr<T>(y);
    parallel_rows(rx.count, rx.n, [&](int64_t r) {
      rms_norm_row(px + rx.offset(r), pw, py + r * rx.n, rx.n, float(eps), zero_centered ? 1.f : 0.f);
    });
  });
  return y;
}

// x, residual: [..., N] -> (rms_norm(x + residual), x + residual), both contiguous
inline std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_, const at::Tensor& res_,
                                                            const at::Tensor& w, double eps,
                                                            bool zero_centered) {
  RECORD_FUNCTION("bb::fused_add_rms_norm", std::vector<c10::IValue>());
  const char* op = "fused_add_rms_norm";
  at::Tensor x = as_rows_view(x_), res = as_rows_view(res_);
  BB_CHECK(x_.sizes() == res_.sizes(), op, ": x ", x_.sizes(), " and residual ", res_.sizes(),
           " differ in shape");
  check_same_dtype(op, "residual", res, x);
  check_weight(op, w, x);
  at::Tensor y = at::empty(x_.sizes(), x.options()), r = at::empty(x_.sizes(), x.options());
  Rows rx = rows_of(x), rr = rows_of(res);
  with_float_dtype(op, x, [&](auto tag) {
    using T = decltype(tag);
    const T *px = ptr<T>(x), *pres = ptr<T>(res), *pw = ptr<T>(w);
    T *py = ptr<T>(y), *pr = ptr<T>(r);
    parallel_rows(rx.count, rx.n, [&](int64_t i) {
      add_rms_norm_row(px + rx.offset(i), pres + rr.offset(i), pw, py + i * rx.n, pr + i * rx.n, rx.n,
                       float(eps), zero_centered ? 1.f : 0.f);
    });
  });
  return {y, r};
}

// x, gate: [T, nh, N] (views allowed) -> [T, nh, N] in x's dtype
inline at::Tensor gated_rms_norm(const at::Tensor& x_, const at::Tensor& gate_, const at::Tensor& w,
                                 double eps) {
  RECORD_FUNCTION("bb::gated_rms_norm", std::vector<c10::IValue>());
  const char* op = "gated_rms_norm";
  at::Tensor x = as_rows_view(x_), gate = as_rows_view(gate_);
  BB_CHECK(x_.sizes() == gate_.sizes(), op, ": x ", x_.sizes(), " and gate ", gate_.sizes(),
           " differ in shape");
  check_same_dtype(op, "gate", gate, x);
  check_weight(op, w, x);
  at::Tensor y = at::empty(x_.sizes(), x.options());
  Rows rx = rows_of(x), rg = rows_of(gate);
  with_float_dtype(op, x, [&](auto tag) {
    using T = decltype(tag);
    const T *px = ptr<T>(x), *pg = ptr<T>(gate), *pw = ptr<T>(w);
    T* py = ptr<T>(y);
    parallel_rows(rx.count, rx.n, [&](int64_t i) {
      gated_rms_norm_row(px + rx.offset(i), pg + rg.offset(i), pw, py + i * rx.n, rx.n, float(eps));
    });
  });
  return y;
}

// x: [..., 2I] = [gate | up] -> silu(gate) * up [..., I]
inline at::Tensor silu_mul(const at::Tensor& x_) {
  RECORD_FUNCTION("bb::silu_mul", std::vector<c10::IValue>());
  const char* op = "silu_mul";
  at::Tensor x = as_rows_view(x_);
  BB_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op, ": the last dim must be even, shape ", x_.sizes());
  auto sizes = x_.sizes().vec();
  const int64_t half = sizes.back() / 2;
  sizes.back() = half;
  at::Tensor y = at::empty(sizes, x.options());
  Rows rx = rows_of(x);
  with_float_dtype(op, x, [&](auto tag) {
    using T = decltype(tag);
    const T* px = ptr<T>(x);
    T* py = ptr<T>(y);
    parallel_rows(rx.count, half, [&](int64_t i) {
      const T* g = px + rx.offset(i);
      silu_mul_row(g, g + half, py + i * half, half);
    });
  });
  return y;
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
