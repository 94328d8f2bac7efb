// The Gated DeltaNet decode / verify step between in_proj and out_proj, in one op: the CPU
// kernel of ops.gdn.decode.gdn_decode_ref (same arguments, same result, same state updates).
//
// B requests x L rows (decode L = 1; verify L = 1 + k); proj [B*L, C + nv*dv + 2*nv] holds
// [qkv (C = 2*nk*dk + nv*dv) | z | b | a]. One task per (request, key head): it owns the conv
// channels of its q and k heads and of the r = nv/nk value heads that share them, so it can
//   1. run the causal depthwise conv over the cached K-1 inputs (conv_state[src]) and its L new
//      rows, SiLU, rounded to the model dtype (as the reference), and write the window after
//      the last row (dst [B]) or after every row (dst [B, L]) for its channels;
//   2. l2-normalise q (times dk^-0.5) and k, and for each of its value heads run the delta rule
//      on the fp32 state [dk, dv], streamed from its source slot to its destination slot in
//      column chunks (per row: kv = k^T S, u = (v - exp(g) kv) beta, S' = exp(g) S + k u^T,
//      o = q^T S'), with g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b);
//   3. apply the gated output norm rmsnorm(o) * w * silu(z) and write the output row.
// Tasks never share channels or (slot, head) state tiles, so one parallel region does it all.
// Every source value is read before the task writes its destination (dst may equal src);
// different requests must not share slots (as the Triton kernel).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <vector>

#include "norm_act.h"
#include "simd.h"
#include "tensor_args.h"

namespace bb {
inline namespace BB_ISA_NAMESPACE {

struct GdnShape {
  int64_t B, L, nk, nv, dk, dv, r, K, C;
};

template <typename T>
struct GdnArgs {
  GdnShape s;
  const T* proj;
  int64_t sp;                              // proj row stride
  const T* conv_w;                         // [C, K]
  T* conv;                                 // [slots, K-1, C]
  int64_t conv_ss, conv_st;                // slot / column strides
  float* ssm;                              // [slots, nv, dk, dv]
  int64_t ssm_ss, ssm_sh, ssm_sk;          // slot / head / key-row strides
  const T* norm_w;                         // [dv]
  const float *a_log, *dt_bias;            // [nv]
  const int64_t *src, *dst;                // [B]; [B] or [B, L]
  const bool* init;                        // [B] or nullptr
  bool per_position;
  float eps;
  T* out;                                  // [B*L, nv*dv]
};

// ---- 1. conv (channels [c0, c0 + n) of request b) ---------------------------------------
template <typename T>
void gdn_conv_channels(const GdnArgs<T>& a, int64_t b, int64_t c0, int64_t n, float* out) {
  const GdnShape& s = a.s;
  const int64_t K = s.K, L = s.L, row0 = b * L;
  const bool init = a.init == nullptr || a.init[b];
  const T* win = a.conv + a.src[b] * a.conv_ss;
  std::vector<VF> ext(K - 1 + L), w(K);        // the K-1 cached inputs then the L new ones
  for_lanes(n, [&](int64_t i, int m) {
    const int64_t c = c0 + i;
    for (int64_t j = 0; j < K; ++j) {
      float wt[VF::N] = {};
      for (int l = 0; l < m; ++l) wt[l] = to_f32(a.conv_w[(c + l) * K + j]);
      w[j] = VF::load(wt);
    }
    for (int64_t e = 0; e < K - 1; ++e) ext[e] = init ? load_n(win + e * a.conv_st + c, m) : VF::zero();
    for (int64_t t = 0; t < L; ++t) ext[K - 1 + t] = load_n(a.proj + (row0 + t) * a.sp + c, m);
    for (int64_t t = 0; t < L; ++t) {
      VF acc = ext[t] * w[0];
      for (int64_t j = 1; j < K; ++j) acc = acc + ext[t + j] * w[j];
      store_n(round_vec<T>(vsilu(acc)), out + t * n + i, m);
    }
    // windows out: after every row (verify) or after the last one
    for (int64_t t = a.per_position ? 0 : L - 1; t < L; ++t) {
      T* dwin = a.conv + (a.per_position ? a.dst[row0 + t] : a.dst[b]) * a.conv_ss;
      for (int64_t e = 0; e < K - 1; ++e) store_n(ext[t + 1 + e], dwin + e * a.conv_st + c, m);
    }
  });
}

// ---- 2. one delta-rule row of one value head over NV vectors of columns ----------------------
// S_in / S_out: [dk rows (stride rs_in / rs_out), dv cols]; may alias (row i is read, then
// written). S_copy (or nullptr): a second destination of S_out, written with streaming stores.
struct StateRows {
  const float* in;
  float* out;
  float* copy;
  int64_t rs_in, rs_out, rs_copy;
  StateRows at(int64_t c) const { return {in + c, out + c, copy ? copy + c : nullptr, rs_in, rs_out, rs_copy}; }
};

// Two FMA chains per column vector on AVX-512 (even and odd key rows, summed at the end): with
// one, both passes were bound by the FMA latency over the dk rows (NV = 4 chains, where two FMA
// ports need 8 in flight): a 1024-token prompt, 4 value heads of 128 x 128, 5.35 -> 3.8 ms per
// layer on 2 Sapphire Rapids cores. AVX2 keeps one (16 registers: two spilled, 4.8 -> 4.9 ms).
constexpr int kChains = VF::N >= 16 ? 2 : 1;

template <int NV>
inline void delta_cols(const StateRows& S, int64_t dk, const float* k, const float* q, const float* v,
                       float decay, float beta, float* o, int last_lanes) {
  int lanes[NV];
  for (int j = 0; j < NV; ++j) lanes[j] = j == NV - 1 ? last_lanes : VF::N;
  VF kv0[NV], kv1[NV], u[NV], acc0[NV], acc1[NV];
  for (int j = 0; j < NV; ++j) kv0[j] = acc0[j] = VF::zero();
  if constexpr (kChains == 2)
    for (int j = 0; j < NV; ++j) kv1[j] = acc1[j] = VF::zero();
  auto kv_row = [&](int64_t i, VF* kv) {                       // kv += k_i S_i
    const VF ki = VF::set1(k[i]);
    for (int j = 0; j < NV; ++j) kv[j] = fma(ki, load_n(S.in + i * S.rs_in + j * VF::N, lanes[j]), kv[j]);
  };
  int64_t i = 0;
  for (; i + kChains <= dk; i += kChains) {                    // kv = k^T S
    kv_row(i, kv0);
    if constexpr (kChains == 2) kv_row(i + 1, kv1);
  }
  for (; i < dk; ++i) kv_row(i, kv0);
  const VF vd = VF::set1(decay), vb = VF::set1(beta);
  if constexpr (kChains == 2)
    for (int j = 0; j < NV; ++j) kv0[j] = kv0[j] + kv1[j];
  for (int j = 0; j < NV; ++j) u[j] = (load_n(v + j * VF::N, lanes[j]) - kv0[j] * vd) * vb;
  auto update_row = [&](int64_t i, VF* acc) {                  // S'_i = decay S_i + k_i u; o += q_i S'_i
    const VF ki = VF::set1(k[i]), qi = VF::set1(q[i]);
    for (int j = 0; j < NV; ++j) {
      VF sn = fma(ki, u[j], load_n(S.in + i * S.rs_in + j * VF::N, lanes[j]) * vd);
      store_n(sn, S.out + i * S.rs_out + j * VF::N, lanes[j]);
      if (S.copy) store_stream(sn, S.copy + i * S.rs_copy + j * VF::N, lanes[j]);
      acc[j] = fma(qi, sn, acc[j]);
    }
  };
  for (i = 0; i + kChains <= dk; i += kChains) {
    update_row(i, acc0);
    if constexpr (kChains == 2) update_row(i + 1, acc1);
  }
  for (; i < dk; ++i) update_row(i, acc0);
  if constexpr (kChains == 2)
    for (int j = 0; j < NV; ++j) acc0[j] = acc0[j] + acc1[j];
  for (int j = 0; j < NV; ++j) store_n(acc0[j], o + j * VF::N, lanes[j]);
}

inline void delta_row(const StateRows& S, int64_t dk, int64_t dv, const float* k, const float* q,
                      const float* v, float decay, float beta, float* o) {
  constexpr int64_t W = 4 * VF::N;                             // columns per chunk
  int64_t c = 0;
  for (; c + W <= dv; c += W) delta_cols<4>(S.at(c), dk, k, q, v + c, decay, beta, o + c, VF::N);
  for (; c < dv; c += VF::N) {
    const int lanes = int(std::min<int64_t>(VF::N, dv - c));
    delta_cols<1>(S.at(c), dk, k, q, v + c, decay, beta, o + c, lanes);
  }
}

inline void l2_normalise(float* x, int64_t n, float scale) {   // x * rsqrt(sum x^2 + 1e-6) * scale
  const float inv = 1.f / std::sqrt(sum_squares(x, n) + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

inline void gdn_gates(float a, float b, float a_log, float dt_bias, float* decay, float* beta) {
  const float x = a + dt_bias;
  const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
  *decay = std::exp(-std::exp(a_log) * softplus);
  *beta = 1.f / (1.f + std::exp(-b));
}

// ---- the task: request b, key head kh ------------------------------------------------------
// state columns per block over several rows: delta_row's chunk of four vectors (32 KiB of state at
// dk = 128 with AVX-512); a prompt of 1024 tokens, 4 value heads of 128 x 128: 4.5 -> 4.0 ms per
// layer on a Zen 4 (32 or 16 columns: 5.9, one vector per FMA chain)
constexpr int64_t kColBlock = 4 * VF::N;

template <typename T>
void gdn_task(const GdnArgs<T>& a, int64_t b, int64_t kh) {
  const GdnShape& s = a.s;
  const int64_t L = s.L, dk = s.dk, dv = s.dv, r = s.r, key_dim = s.nk * dk;
  std::vector<float> buf(2 * L * dk + L * r * dv);
  float *qb = buf.data(), *kb = qb + L * dk, *vb = kb + L * dk;
  std::vector<T> core(dv);
  gdn_conv_channels(a, b, kh * dk, dk, qb);
  gdn_conv_channels(a, b, key_dim + kh * dk, dk, kb);
  gdn_conv_channels(a, b, 2 * key_dim + kh * r * dv, r * dv, vb);
  for (int64_t t = 0; t < L; ++t) {
    l2_normalise(qb + t * dk, dk, 1.f / std::sqrt(float(dk)));
    l2_normalise(kb + t * dk, dk, 1.f);
  }
  const bool init = a.init == nullptr || a.init[b];
  const int64_t z_off = s.C, b_off = s.C + s.nv * dv, a_off = b_off + s.nv;
  // several rows: the running state lives in a scratch tile and each destination slot is written
  // with streaming stores (no read-for-ownership, never read back), one block of kColBlock state
  // columns at a time over all L rows (the columns of the delta rule are independent: the same
  // arithmetic in the same order as the whole state row by row), so the tile stays near L1;
  // one row: the state streams from its source slot to its destination slot directly
  const int64_t cb = L > 1 ? std::min(kColBlock, dv) : dv;
  std::vector<float> work(L > 1 ? dk * cb : 0), decay(L), beta(L), orow(L > 1 ? L * dv : dv);
  for (int64_t h = kh * r; h < (kh + 1) * r; ++h) {
    const int64_t head = h * a.ssm_sh;
    for (int64_t t = 0; t < L; ++t) {
      const T* prow = a.proj + (b * L + t) * a.sp;
      gdn_gates(to_f32(prow[a_off + h]), to_f32(prow[b_off + h]), a.a_log[h], a.dt_bias[h], &decay[t], &beta[t]);
    }
    const float* vh = vb + (h - kh * r) * dv;
    for (int64_t c0 = 0; c0 < dv; c0 += cb) {
      const int64_t w = std::min(cb, dv - c0);
      StateRows S{a.ssm + a.src[b] * a.ssm_ss + head + c0, nullptr, nullptr, a.ssm_sk, a.ssm_sk, a.ssm_sk};
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = b * L + t;
        float* dst = a.ssm + (a.per_position ? a.dst[row] : a.dst[b]) * a.ssm_ss + head + c0;
        if (L > 1) {
          S.out = work.data();
          S.rs_out = cb;
          S.copy = a.per_position || t == L - 1 ? dst : nullptr;
        } else {
          S.out = dst;
        }
        if (t == 0 && !init) {                                 // start from zeros
          for (int64_t i = 0; i < dk; ++i) std::fill(S.out + i * S.rs_out, S.out + i * S.rs_out + w, 0.f);
          S.in = S.out;
          S.rs_in = S.rs_out;
        }
        delta_row(S, dk, w, kb + t * dk, qb + t * dk, vh + t * r * dv + c0, decay[t], beta[t],
                  orow.data() + (L > 1 ? t * dv : 0) + c0);
        S.in = S.out;
        S.rs_in = S.rs_out;
      }
    }
    for (int64_t t = 0; t < L; ++t) {
      const int64_t row = b * L + t;
      const float* o = orow.data() + (L > 1 ? t * dv : 0);
      for (int64_t i = 0; i < dv; ++i) core[i] = from_f32<T>(o[i]);     // the core in the model dtype
      gated_rms_norm_row(core.data(), a.proj + row * a.sp + z_off + h * dv, a.norm_w,
                         a.out + row * s.nv * dv + h * dv, dv, a.eps);
    }
  }
  stream_fence();
}

// ---- the op ---------------------------------------------------------------------------------
// proj [B*L, C + nv*dv + 2*nv]; conv_weight [C, K]; conv_state [slots, K-1, C] (model dtype);
// A_log, dt_bias [nv]; norm_weight [dv]; ssm_state [slots, nv, dk, dv] fp32; src_slots [B];
// dst_slots [B] or [B, L]; has_initial_state [B] bool or None -> [B*L, nv*dv] in proj's dtype
inline at::Tensor gdn_decode(const at::Tensor& proj, const at::Tensor& conv_weight,
                             const at::Tensor& conv_state, const at::Tensor& A_log,
                             const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                             const at::Tensor& ssm_state, const at::Tensor& src_slots,
                             const at::Tensor& dst_slots, const std::optional<at::Tensor>& has_init,
                             int64_t nk, int64_t nv, int64_t dk, int64_t dv, double eps) {
  RECORD_FUNCTION("bb::gdn_decode", std::vector<c10::IValue>());
  const char* op = "gdn_decode";
  BB_CHECK(nk > 0 && nv > 0 && nv % nk == 0, op, ": num_v_heads (", nv,
           ") must be a positive multiple of num_k_heads (", nk, ")");
  BB_CHECK(dk > 0 && dv > 0, op, ": head dims must be positive, got dk=", dk, ", dv=", dv);
  GdnShape s{0, 0, nk, nv, dk, dv, nv / nk, 0, 2 * nk * dk + nv * dv};
  check_dim(op, "proj", proj, 2);
  check_last_contiguous(op, "proj", proj);
  check_size(op, "proj", proj, 1, s.C + nv * dv + 2 * nv);
  check_dim(op, "conv_weight", conv_weight, 2);
  check_size(op, "conv_weight", conv_weight, 0, s.C);
  BB_CHECK(conv_weight.is_contiguous(), op, ": conv_weight must be contiguous");
  s.K = conv_weight.size(1);
  BB_CHECK(s.K >= 2, op, ": conv kernel width must be >= 2, got ", s.K);
  check_dim(op, "conv_state", conv_state, 3);
  check_size(op, "conv_state", conv_state, 1, s.K - 1);
  check_size(op, "conv_state", conv_state, 2, s.C);
  check_last_contiguous(op, "conv_state", conv_state);
  check_dim(op, "ssm_state", ssm_state, 4);
  BB_CHECK(ssm_state.scalar_type() == at::kFloat, op, ": ssm_state must be float32, got ",
           ssm_state.scalar_type());
  check_size(op, "ssm_state", ssm_state, 1, nv);
  check_size(op, "ssm_state", ssm_state, 2, dk);
  check_size(op, "ssm_state", ssm_state, 3, dv);
  check_last_contiguous(op, "ssm_state", ssm_state);
  for (auto* t : {&conv_weight, &conv_state, &norm_weight}) check_same_dtype(op, "a weight or state", *t, proj);
  check_dim(op, "norm_weight", norm_weight, 1);
  check_size(op, "norm_weight", norm_weight, 0, dv);
  BB_CHECK(norm_weight.is_contiguous(), op, ": norm_weight must be contiguous");
  check_dim(op, "src_slots", src_slots, 1);
  s.B = src_slots.size(0);
  BB_CHECK(s.B > 0 && proj.size(0) % s.B == 0, op, ": proj has ", proj.size(0),
           " rows, not a positive multiple of B=", s.B);
  s.L = proj.size(0) / s.B;
  const bool per_position = dst_slots.dim() == 2;
  BB_CHECK(per_position ? dst_slots.size(0) == s.B && dst_slots.size(1) == s.L
                        : dst_slots.dim() == 1 && dst_slots.size(0) == s.B,
           op, ": dst_slots must be [B] or [B, L] = [", s.B, ", ", s.L, "], got ", dst_slots.sizes());
  const int64_t slots = std::min(conv_state.size(0), ssm_state.size(0));
  const auto src = read_indices(op, "src_slots", src_slots, slots);
  const auto dst = read_indices(op, "dst_slots", dst_slots, slots);
  std::vector<uint8_t> init;
  if (has_init.has_value()) {
    const at::Tensor& hi = *has_init;
    BB_CHECK(hi.scalar_type() == at::kBool && hi.dim() == 1 && hi.size(0) == s.B, op,
             ": has_initial_state must be a [B] bool tensor, got ", hi.scalar_type(), " ", hi.sizes());
    for (int64_t i = 0; i < s.B; ++i) init.push_back(ptr<bool>(hi)[i * hi.stride(0)]);
  }
  const auto a_log = read_floats(op, "A_log", A_log, nv), dtb = read_floats(op, "dt_bias", dt_bias, nv);
  at::Tensor out = at::empty({proj.size(0), nv * dv}, proj.options());
  with_float_dtype(op, proj, [&](auto tag) {
    using T = decltype(tag);
    GdnArgs<T> a{s, ptr<T>(proj), proj.stride(0), ptr<T>(conv_weight), ptr<T>(conv_state),
                 conv_state.stride(0), conv_state.stride(1), ptr<float>(ssm_state), ssm_state.stride(0),
                 ssm_state.stride(1), ssm_state.stride(2), ptr<T>(norm_weight), a_log.data(), dtb.data(),
                 src.data(), dst.data(), init.empty() ? nullptr : reinterpret_cast<const bool*>(init.data()),
                 per_position, float(eps), ptr<T>(out)};
    at::parallel_for(0, s.B * nk, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals ftz;
      for (int64_t task = begin; task < end; ++task) gdn_task(a, task / nk, task % nk);
    });
  });
  return out;
}

}  // namespace BB_ISA_NAMESPACE
}  // namespace bb
