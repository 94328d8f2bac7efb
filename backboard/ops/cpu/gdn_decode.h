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
//      on the fp32 state [dk, dv] (per row: kv = k^T S, u = (v - exp(g) kv) beta,
//      S' = exp(g) S + k u^T, o = q^T S'), with g = -exp(A_log) softplus(a + dt_bias),
//      beta = sigmoid(b): one row streams the state from its source slot to its destination
//      slot; several rows run in a scratch tile, a block of columns at a time (delta_span);
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
// written).
struct StateRows {
  const float* in;
  float* out;
  int64_t rs_in, rs_out;
  StateRows at(int64_t c) const { return {in + c, out + c, rs_in, rs_out}; }
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

// ---- 3. a prompt's rows: one block of NV state column vectors over all L rows -------------
// The tile holds S / G, G the product of the decays since the last rescale, so a row costs one
// FMA per state element for its update (tile_i += k_i u / G) and one each for the next row's
// k^T S and q^T S, accumulated in the same pass over the tile (one pass a row, not two):
//   kv_t = G_{t-1} k_t^T tile,  u_t = beta_t (v_t - g_t kv_t),  o_t = g_t G_{t-1} q_t^T tile + (q_t . k_t) u_t
// (o_t = q_t^T S_t with S_t = g_t S_{t-1} + k_t u_t^T). When G would fall below kMinScale (or a
// decay is 0) the row rescales instead: tile_i = G_t tile_i + k_i u, G = 1. A 1040-token prompt,
// 4 value heads of 128 x 128 on 2 Zen 5 cores: 1.87 -> 1.57 ms a layer (two passes a row with the
// decay multiplied in before; 1.17 ms of it is this span, the rest conv, gates and output norm).
constexpr float kMinScale = 1e-20f;
// state columns per block: 32 KiB of state at dk = 128 with AVX-512, so the tile stays near L1
// over all L rows
constexpr int64_t kColBlock = 4 * VF::N;

struct SpanArgs {
  int64_t L, dk;
  const float *k, *q, *qk;                 // [L, dk], [L, dk], [L] (q_t . k_t)
  const float* v;                          // row t at v + t * v_stride
  int64_t v_stride;
  const float *decay, *beta;               // [L]
  float* o;                                // row t at o + t * o_stride
  int64_t o_stride;
  const float* src;                        // starting state rows (stride src_rs) or nullptr: zeros
  int64_t src_rs;
  float* const* copy;                      // [L]: where the state after row t goes, or nullptr
  int64_t copy_rs;
};

template <int NV>
struct SpanCols {
  int lanes[NV];
  float* tile;                             // [dk][ts]
  int64_t ts;

  // one pass over the tile: the update of a row (Upd; Rescale: decayed first), its copy out
  // (scaled by cs), and the next row's accumulations (Next: kn, qn)
  template <bool Upd, bool Rescale, bool Copy, bool Next>
  void pass(const SpanArgs& a, const float* k, const VF* w, float gs, float* copy, float cs,
            const float* kn, const float* qn, VF* kv_out, VF* qs_out) const {
    // locals, not the caller's arrays: a vector type may alias the tile's floats, so sums kept
    // behind a pointer would go to memory after every store
    const VF vg = VF::set1(gs), vc = VF::set1(cs);
    VF wl[NV], kv[NV], qs[NV];
    int ln[NV];
    for (int j = 0; j < NV; ++j) wl[j] = w[j], kv[j] = qs[j] = VF::zero(), ln[j] = lanes[j];
    float* const t0 = tile;
    const int64_t stride = ts, dk = a.dk;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = t0 + i * stride;
      const VF ki = VF::set1(Upd ? k[i] : 0.f);
      for (int j = 0; j < NV; ++j) {
        VF s;
        if constexpr (Upd) {
          s = load_n(row + j * VF::N, ln[j]);
          s = fma(ki, wl[j], Rescale ? s * vg : s);
        } else {
          s = a.src ? load_n(a.src + i * a.src_rs + j * VF::N, ln[j]) : VF::zero();
        }
        store_n(s, row + j * VF::N, ln[j]);
        if constexpr (Copy) store_stream(s * vc, copy + i * a.copy_rs + j * VF::N, ln[j]);
        if constexpr (Next) {
          kv[j] = fma(VF::set1(kn[i]), s, kv[j]);
          qs[j] = fma(VF::set1(qn[i]), s, qs[j]);
        }
      }
    }
    for (int j = 0; j < NV; ++j) kv_out[j] = kv[j], qs_out[j] = qs[j];
  }

  template <bool Upd, bool Rescale>
  void pass_for(const SpanArgs& a, int64_t t, const VF* w, float gs, float cs, VF* kv, VF* qs) const {
    const bool next = t + 1 < a.L;
    float* copy = Upd ? a.copy[t] : nullptr;
    const float *k = Upd ? a.k + t * a.dk : nullptr, *kn = a.k + (t + 1) * a.dk, *qn = a.q + (t + 1) * a.dk;
    if (copy && next) pass<Upd, Rescale, true, true>(a, k, w, gs, copy, cs, kn, qn, kv, qs);
    else if (copy) pass<Upd, Rescale, true, false>(a, k, w, gs, copy, cs, kn, qn, kv, qs);
    else if (next) pass<Upd, Rescale, false, true>(a, k, w, gs, copy, cs, kn, qn, kv, qs);
    else pass<Upd, Rescale, false, false>(a, k, w, gs, copy, cs, kn, qn, kv, qs);
  }

  void run(const SpanArgs& a) const {
    VF kv[NV], qs[NV], u[NV], w[NV];
    for (int j = 0; j < NV; ++j) kv[j] = qs[j] = VF::zero();
    pass_for<false, false>(a, -1, w, 1.f, 1.f, kv, qs);       // load the tile; row 0's sums
    float G = 1.f;
    for (int64_t t = 0; t < a.L; ++t) {
      const float Gn = a.decay[t] * G;                        // g_t G_{t-1}
      const bool rescale = !(Gn >= kMinScale);
      const VF vgG = VF::set1(Gn), vb = VF::set1(a.beta[t]), vqk = VF::set1(a.qk[t]);
      const VF inv = VF::set1(rescale ? 1.f : 1.f / Gn);
      const float* v = a.v + t * a.v_stride;
      float* o = a.o + t * a.o_stride;
      for (int j = 0; j < NV; ++j) {
        u[j] = (load_n(v + j * VF::N, lanes[j]) - kv[j] * vgG) * vb;
        store_n(fma(vqk, u[j], qs[j] * vgG), o + j * VF::N, lanes[j]);
        w[j] = u[j] * inv;
      }
      if (rescale) pass_for<true, true>(a, t, w, Gn, 1.f, kv, qs);
      else pass_for<true, false>(a, t, w, 1.f, Gn, kv, qs);
      G = rescale ? 1.f : Gn;
    }
  }
};

// every column of the state over all L rows: blocks of kColBlock columns, then single vectors;
// tile: [dk][kColBlock] scratch
inline void delta_span(SpanArgs a, int64_t dv, float* tile) {
  constexpr int64_t W = kColBlock;
  float* const* copy0 = a.copy;
  std::vector<float*> shifted(a.L);
  for (int64_t c = 0; c < dv;) {
    const int64_t w = dv - c >= W ? W : std::min<int64_t>(VF::N, dv - c);
    SpanArgs b = a;
    b.v += c;
    b.o += c;
    if (b.src) b.src += c;
    for (int64_t t = 0; t < a.L; ++t) shifted[t] = copy0[t] ? copy0[t] + c : nullptr;
    b.copy = shifted.data();
    if (w == W) {
      SpanCols<4>{{VF::N, VF::N, VF::N, VF::N}, tile, W}.run(b);
    } else {
      SpanCols<1>{{int(w)}, tile, W}.run(b);
    }
    c += w;
  }
}

// ---- the task: request b, key head kh ------------------------------------------------------
template <typename T>
void gdn_task(const GdnArgs<T>& a, int64_t b, int64_t kh) {
  const GdnShape& s = a.s;
  const int64_t L = s.L, dk = s.dk, dv = s.dv, r = s.r, key_dim = s.nk * dk;
  std::vector<float> buf(2 * L * dk + L * r * dv + L);
  float *qb = buf.data(), *kb = qb + L * dk, *vb = kb + L * dk, *qk = vb + L * r * dv;
  std::vector<T> core(dv);
  gdn_conv_channels(a, b, kh * dk, dk, qb);
  gdn_conv_channels(a, b, key_dim + kh * dk, dk, kb);
  gdn_conv_channels(a, b, 2 * key_dim + kh * r * dv, r * dv, vb);
  for (int64_t t = 0; t < L; ++t) {
    l2_normalise(qb + t * dk, dk, 1.f / std::sqrt(float(dk)));
    l2_normalise(kb + t * dk, dk, 1.f);
    qk[t] = dot(qb + t * dk, kb + t * dk, dk);
  }
  const bool init = a.init == nullptr || a.init[b];
  const int64_t z_off = s.C, b_off = s.C + s.nv * dv, a_off = b_off + s.nv;
  // several rows: the running state lives in a scratch tile (delta_span) and each destination
  // slot is written with streaming stores (no read-for-ownership, never read back); one row: the
  // state streams from its source slot to its destination slot directly
  std::vector<float> work(L > 1 ? dk * kColBlock : 0), decay(L), beta(L), orow(L * dv);
  std::vector<float*> copy(L);
  for (int64_t h = kh * r; h < (kh + 1) * r; ++h) {
    const int64_t head = h * a.ssm_sh;
    for (int64_t t = 0; t < L; ++t) {
      const T* prow = a.proj + (b * L + t) * a.sp;
      gdn_gates(to_f32(prow[a_off + h]), to_f32(prow[b_off + h]), a.a_log[h], a.dt_bias[h], &decay[t], &beta[t]);
    }
    const float* vh = vb + (h - kh * r) * dv;
    const float* src = init ? a.ssm + a.src[b] * a.ssm_ss + head : nullptr;
    if (L > 1) {
      for (int64_t t = 0; t < L; ++t)
        copy[t] = a.per_position || t == L - 1
                      ? a.ssm + (a.per_position ? a.dst[b * L + t] : a.dst[b]) * a.ssm_ss + head : nullptr;
      delta_span({L, dk, kb, qb, qk, vh, r * dv, decay.data(), beta.data(), orow.data(), dv, src, a.ssm_sk,
                  copy.data(), a.ssm_sk}, dv, work.data());
    } else {
      float* dst = a.ssm + a.dst[b] * a.ssm_ss + head;
      if (!src)                                                // start from zeros
        for (int64_t i = 0; i < dk; ++i) std::fill(dst + i * a.ssm_sk, dst + i * a.ssm_sk + dv, 0.f);
      const float* in = src ? src : dst;
      delta_row({in, dst, a.ssm_sk, a.ssm_sk}, dk, dv, kb, qb, vh, decay[0], beta[0], orow.data());
    }
    for (int64_t t = 0; t < L; ++t) {
      const int64_t row = b * L + t;
      const float* o = orow.data() + t * dv;
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
