// The attention layer's per-token prologue in one op: q / k RMSNorm, RoPE (NeoX rotate-half over
// the first `rot` dims of each head, the rest passed through) and the K/V cache write: the CPU
// kernel of ops.rotary.qk_norm_rope_write_kv_ref, which takes ~60 torch ops per layer and step.
//
// Without norm weights (Llama, Qwen2) it is RoPE and the cache write alone.
//
// Rounded where the reference rounds: the normed head in the model dtype T; cos / sin of
// position * inv_freq computed in fp32 and rounded to T; x * cos and rotate(x) * sin each rounded
// to T, then their sum. One task per (token, head) row: q heads to the output, k heads and v
// heads into the caches at slot_mapping[token].
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <limits>
#include <vector>

#include "norm_act.h"
#include "simd.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

// x [D] (normed, in T) -> y [D]: rotate-half RoPE over dims [0, rot), cos / sin [rot / 2] in T
template <typename T>
inline void rope_row(const T* x, const float* cs, const float* sn, T* y, int64_t rot, int64_t D) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_f32(x[i]), b = to_f32(x[i + half]);
    y[i] = from_f32<T>(round_to<T>(a * cs[i]) + round_to<T>(-b * sn[i]));
    y[i + half] = from_f32<T>(round_to<T>(b * cs[i]) + round_to<T>(a * sn[i]));
  }
  std::copy(x + rot, x + D, y + rot);
}

// cos / sin [T, rot / 2] of positions [T] * inv_freq, in fp32 then rounded to T (as the reference)
template <typename T>
inline void rope_tables(const std::vector<int64_t>& pos, const float* inv_freq, int64_t half,
                        std::vector<float>& cs, std::vector<float>& sn) {
  cs.resize(pos.size() * half);
  sn.resize(pos.size() * half);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float f = float(pos[t]) * inv_freq[i];
      cs[t * half + i] = round_to<T>(std::cos(f));
      sn[t * half + i] = round_to<T>(std::sin(f));
    }
}

inline void check_heads(const char* op, const char* name, const at::Tensor& t, int64_t T, int64_t D) {
  check_dim(op, name, t, 3);
  check_size(op, name, t, 0, T);
  check_size(op, name, t, 2, D);
  check_last_contiguous(op, name, t);
}

// q [T, nh, D], k / v [T, nkv, D] (row strides free, last dim contiguous); q_weight, k_weight [D]
// or both absent (no q / k norm); positions [T]; inv_freq [rot / 2] fp32; caches [num_blocks,
// block_size, nkv, D] contiguous; slot_mapping [T] -> rope(norm(q)) [T, nh, D] contiguous; rope(norm(k)) and v written to the caches
inline at::Tensor qk_norm_rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const c10::optional<at::Tensor>& q_weight,
                                        const c10::optional<at::Tensor>& k_weight,
                                        double eps, bool zero_centered, const at::Tensor& positions,
                                        const at::Tensor& inv_freq, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  RECORD_FUNCTION("bb::qk_norm_rope_write_kv", std::vector<c10::IValue>());
  const char* op = "qk_norm_rope_write_kv";
  const int64_t T = q.size(0), D = q.size(-1), nh = q.size(1), nkv = k.size(1);
  check_heads(op, "q", q, T, D);
  check_heads(op, "k", k, T, D);
  check_heads(op, "v", v, T, D);
  check_size(op, "v", v, 1, nkv);
  for (auto* t : {&k, &v, &k_cache, &v_cache}) check_same_dtype(op, "a tensor", *t, q);
  BB_CHECK(q_weight.has_value() == k_weight.has_value(), op,
           ": q_weight and k_weight must both be given or both be None");
  const bool norm = q_weight.has_value();
  if (norm) {                                  // check_weight checks the dtype too
    check_weight(op, *q_weight, q);
    check_weight(op, *k_weight, q);
  }
  check_dim(op, "inv_freq", inv_freq, 1);
  BB_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous(), op,
           ": inv_freq must be a contiguous float32 vector");
  const int64_t rot = 2 * inv_freq.size(0);
  BB_CHECK(rot > 0 && rot <= D, op, ": rotary dims ", rot, " (2 x inv_freq) must be in [1, head_dim ", D, "]");
  for (auto* c : {&k_cache, &v_cache}) {
    check_dim(op, "a KV cache", *c, 4);
    BB_CHECK(c->is_contiguous() && c->size(2) == nkv && c->size(3) == D, op, ": KV caches must be contiguous [",
             "num_blocks, block_size, ", nkv, ", ", D, "], got ", c->sizes());
  }
  BB_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, op, ": slot_mapping must be [T = ", T,
           "], got ", slot_mapping.sizes());
  BB_CHECK(positions.dim() == 1 && positions.size(0) == T, op, ": positions must be [T = ", T, "], got ",
           positions.sizes());
  const auto slots = read_indices(op, "slot_mapping", slot_mapping, k_cache.size(0) * k_cache.size(1));
  const auto pos = read_indices(op, "positions", positions, std::numeric_limits<int64_t>::max());
  at::Tensor out = at::empty({T, nh, D}, q.options());
  const float w_off = zero_centered ? 1.f : 0.f;
  with_float_dtype(op, q, [&](auto tag) {
    using E = decltype(tag);
    std::vector<float> cs, sn;
    rope_tables<E>(pos, ptr<float>(inv_freq), rot / 2, cs, sn);
    const int64_t heads = nh + 2 * nkv;
    const E* qw = norm ? ptr<E>(*q_weight) : nullptr;
    const E* kw = norm ? ptr<E>(*k_weight) : nullptr;
    parallel_rows(T * heads, D, [&](int64_t r) {
      const int64_t t = r / heads, h = r % heads;
      std::vector<E> normed(D);
      const float *c = cs.data() + t * (rot / 2), *s = sn.data() + t * (rot / 2);
      // the head row normed into `normed` (or as it is without norm weights)
      auto prepared = [&](const E* x, const E* w) -> const E* {
        if (w == nullptr) return x;
        rms_norm_row(x, w, normed.data(), D, float(eps), w_off);
        return normed.data();
      };
      if (h < nh) {
        rope_row(prepared(ptr<E>(q) + t * q.stride(0) + h * q.stride(1), qw), c, s, ptr<E>(out) + (t * nh + h) * D,
                 rot, D);
      } else if (h < nh + nkv) {
        rope_row(prepared(ptr<E>(k) + t * k.stride(0) + (h - nh) * k.stride(1), kw), c, s,
                 ptr<E>(k_cache) + (slots[t] * nkv + h - nh) * D, rot, D);
      } else {
        const E* src = ptr<E>(v) + t * v.stride(0) + (h - nh - nkv) * v.stride(1);
        std::copy(src, src + D, ptr<E>(v_cache) + (slots[t] * nkv + h - nh - nkv) * D);
      }
    });
  });
  return out;
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
