// y = x @ W^T (+ bias) for weights stored narrow (bf16, int8 per-channel, int4 grouped; formats in
// backboard/ops/quant.py), widened in registers and accumulated in fp32.
//
//   x [M, K] fp32 or bf16 (rows may be strided, elements contiguous)
//   W [N, K] as nn.Linear stores it (the LM head may be tied to the embedding), or for decode's
//        rows where bf16 is widened in registers its K-interleaved copy (pack_bf16,
//        linear_bf16_packed: gemm_packed.h)
//   y [M, N] fp32 or bf16
//
// Four paths on W, chosen by the caller (backboard/ops/cpu/gemm.py; lanes and amx inside linear_bf16):
//   rows   decode (small M): each thread owns a range of output channels N; a tile of MB rows of
//          x by NB channels keeps MB*NB fp32 vector accumulators in registers, so each weight
//          vector loaded from memory feeds MB FMAs. For M <= MB every weight byte is read once.
//          On avx512_bf16 a bf16 x uses VDPBF16PS (two bf16 products per fp32 lane, exact
//          products, fp32 accumulation); an fp32 x is never rounded to bf16. One row (M = 1)
//          reads its channels one after another instead (gemv in gemm_gemv.h: a single stream),
//          and so do two bf16 rows over a bf16 weight of 8M+ elements in short rows (gemv_rows;
//          on AVX2 Zen 3s up to GEMV_ROW_GROUPS_MAX rows, in groups of 4).
//   lanes  bf16 x with 16+ rows (14+ over many channels) on avx512_bf16 (gemm_lanes.h): rows in
//          the vector lanes, a weight pair broadcast, no horizontal sums (1.5-1.9x the rows path
//          at 32-64 rows)
//   amx    bf16 x with 4+ rows on amx_bf16 builds where the CPU has AMX-BF16 (gemm_amx.h): the
//          weight's rows as AMX tiles, x packed as for lanes; whole 32-channel blocks, the tail on
//          lanes / rows (4-7x the lanes kernel at 16-64 rows on Sapphire Rapids)
//   panel  prefill (large M): widen NC output channels at a time into an fp32 scratch panel (in
//          parallel) and hand it to torch's fp32 GEMM (MKL / oneDNN), so prefill runs at the fp32
//          matmul rate without a second fp32 copy of the weights; up to 128 rows (large decode
//          batches) each thread widens into its own L2-sized panel and multiplies it alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <stdexcept>
#include <tuple>
#include <memory>
#include <type_traits>
#include <vector>

#include "big_alloc.h"
#include "gemm_formats.h"
#include "gemm_gemv.h"
#include "gemm_out.h"
#include "gemm_packed.h"
#include "gemm_simd.h"
#if defined(BB_ISA_AVX512_BF16)
#include "gemm_lanes.h"
#endif
#if defined(BB_ISA_AMX_BF16)
#include "gemm_amx.h"
#endif

namespace bb {
namespace {

// ---- register tiles ---------------------------------------------------------------------------
// MB x NB for M >= 2 (accumulators + NB * NV weight vectors + one x vector fit the registers);
// one row goes to gemv below, two bf16 rows over a large bf16 weight to gemv_rows
#if defined(BB_SIMD_AVX512)
constexpr int MB = 4, NB = 4;   // 16 + 8 + 1 of 32 registers
#elif defined(BB_SIMD_AVX2)
constexpr int MB = 4, NB = 2;   // 8 + 4 + 1 of 16 registers (2 x 4 is as fast)
#else
constexpr int MB = 2, NB = 2;
#endif

// acc[i][j] = x[m0 + i] . W[n0 + j] for an mb x nb tile (compile-time sizes), then stored
template <class F, int TM, int TN>
inline void tile(const F& f, const typename F::XT* x, int64_t ldx, int64_t m0, int64_t n0,
                 int64_t K, int64_t kv, const Out& o) {
  VF acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = vzero();
  const typename F::XT* xm = x + m0 * ldx;
  // rows are short (K = 512: 1 KiB) and a tile reads TN of them side by side: the hardware
  // prefetchers lose track, so fetch the lines PF_TILES tiles ahead while this one computes
  const std::ptrdiff_t pf = static_cast<const char*>(f.at(n0 + PF_TILES * TN, 0)) -
                            static_cast<const char*>(f.at(n0, 0));
  for (int64_t k = 0; k < kv; k += F::STEP) {
    typename F::WV w[TN][F::NV];
    for (int j = 0; j < TN; ++j) prefetch(static_cast<const char*>(f.at(n0 + j, k)) + pf);
    for (int j = 0; j < TN; ++j) f.load(n0 + j, k, w[j]);
    for (int v = 0; v < F::NV; ++v)
      for (int i = 0; i < TM; ++i) {
        typename F::XV xv = F::loadx(xm + i * ldx + k + v * F::XLANES);
        for (int j = 0; j < TN; ++j) acc[i][j] = F::fma(acc[i][j], w[j][v], xv);
      }
  }
  float sums[TM * TN];
  if constexpr (TM * TN % VW == 0) {
    for (int c = 0; c < TM * TN; c += VW) vsum_vw(&acc[0][0] + c, sums + c);
  } else if constexpr (TM * TN % 8 == 0) {
    for (int c = 0; c < TM * TN; c += 8) vsum_8(&acc[0][0] + c, sums + c);
  } else {
    for (int c = 0; c < TM * TN; ++c) sums[c] = vsum((&acc[0][0])[c]);
  }
  store_sums<F, TM, TN>(f, sums, xm, ldx, m0, n0, K, kv, o);
}

// a tile of mb <= TM rows (the M tail picks the largest instance that fits)
template <class F, int TM, int TN>
inline void tile_rows(const F& f, int mb, const typename F::XT* x, int64_t ldx, int64_t m0,
                      int64_t n0, int64_t K, int64_t kv, const Out& o) {
  if constexpr (TM > 1) {
    if (mb < TM) return tile_rows<F, TM - 1, TN>(f, mb, x, ldx, m0, n0, K, kv, o);
  }
  tile<F, TM, TN>(f, x, ldx, m0, n0, K, kv, o);
}

// every output channel, threads over blocks of TN channels; each block's tiles walk down M
template <class F, int TM, int TN>
void rows_tiled(const F& f, const typename F::XT* x, int64_t ldx, int64_t M, int64_t N, int64_t K,
                const Out& o) {
  const int64_t kv = f.vector_k(K);
  for_channel_blocks<TN>(N, K, [&](int64_t n0, auto tn) {   // each block's tiles walk down M
    for (int64_t m0 = 0; m0 < M; m0 += TM)
      tile_rows<F, TM, decltype(tn)::value>(f, int(std::min<int64_t>(TM, M - m0)), x, ldx, m0, n0, K, kv, o);
  });
}

template <class F>
void rows_path(const F& f, const typename F::XT* x, int64_t ldx, int64_t M, int64_t N, int64_t K,
               const Out& o) {
  if (M == 1) gemv(f, x, N, K, o);
  else if (gemv_rows_pays<F>(M, N, K)) gemv_rows<F>(f, x, ldx, M, N, K, o);
  else rows_tiled<F, MB, NB>(f, x, ldx, M, N, K, o);
}

// Panel path: weights widened to fp32 into a scratch panel, then torch's fp32 GEMM (MKL's).
// Prefill (more than PANEL_OWN_MAX_M rows): the threads widen NC channels at a time into one
// shared panel, then one multithreaded GEMM on it.
template <class F>
void panel_shared(const F& f, const at::Tensor& xf, int64_t N, int64_t K, at::Tensor& y32) {
  const int64_t nc = std::min<int64_t>(N, std::max<int64_t>(64, ((int64_t(1) << 19) / K) / 16 * 16));
  at::Tensor panel = at::empty({nc, K}, xf.options());
  float* p = panel.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += nc) {
    const int64_t rows = std::min(nc, N - n0);
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) f.widen(n0 + r, p + r * K, K);
    });
    at::Tensor out = y32.narrow(1, n0, rows);
    at::mm_out(out, xf, panel.narrow(0, 0, rows).t());
  }
}

// Decode-sized M (up to PANEL_OWN_MAX_M rows; the panel path starts at 49 on AVX2 builds): each
// thread widens its own blocks of channels into its own L2-sized panel (PANEL_OWN_BYTES) and runs a
// single-threaded GEMM on it (torch's GEMM called inside a parallel region runs on the calling
// thread; the worker threads take the caller's inference mode, without which they refuse to write
// its tensors). The shared 2 MiB panel of prefill lives in L3, and on a 2-core Zen 3 VM its
// widening and GEMM slowed by 2.8x and 1.4x for minutes at a time (a neighbour's use of the shared
// L3, I assume): the LM head at 64 rows read 136-150 or 212-258 ms. Min / median ms of 5
// interleaved, shared vs own panels: LM head 248320 x 512 at 49 rows 116.1 / 122.9 vs 96.7 / 111.5,
// 64 rows 138.3 / 139.1 vs 113.5 / 116.6, 128 rows 226.0 / 235.3 vs 202.7 / 209.1; 4096 x 512 at 64
// rows 2.30 / 2.39 vs 1.96 / 2.24; 512 x 2048 1.13 / 1.19 vs 1.09 / 1.12. From 192 rows the shared
// panel won on some shapes (1544 x 512: 1.98 vs 2.17 ms; at 1024 rows 10.1 vs 12.8), lost on
// others.
constexpr int64_t PANEL_OWN_MAX_M = 128;
constexpr int64_t PANEL_OWN_BYTES = int64_t(256) << 10;

template <class F>
void panel_own(const F& f, const at::Tensor& xf, int64_t N, int64_t K, at::Tensor& y32) {
  const int64_t nt = at::get_num_threads();
  const int64_t nc_max = std::max<int64_t>(16, PANEL_OWN_BYTES / (4 * K) / 16 * 16);
  const int64_t nblocks = ((N + nc_max - 1) / nc_max + nt - 1) / nt * nt;   // as many per thread
  const int64_t nc = ((N + nblocks - 1) / nblocks + 15) / 16 * 16;   // whole vectors for the GEMM
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    c10::InferenceMode mode(inference);    // worker threads do not inherit the caller's
    at::Tensor panel = at::empty({nc, K}, xf.options());
    float* p = panel.data_ptr<float>();
    for (int64_t b = b0; b < b1 && b * nc < N; ++b) {
      const int64_t n0 = b * nc, rows = std::min(nc, N - n0);
      for (int64_t r = 0; r < rows; ++r) f.widen(n0 + r, p + r * K, K);
      at::Tensor out = y32.narrow(1, n0, rows);
      at::mm_out(out, xf, panel.narrow(0, 0, rows).t());
    }
  });
}

template <class F>
void panel_path(const F& f, const at::Tensor& xf, int64_t N, int64_t K, at::Tensor& y32) {
  if (xf.size(0) <= PANEL_OWN_MAX_M) panel_own(f, xf, N, K, y32);
  else panel_shared(f, xf, N, K, y32);
}

// ---- argument handling ------------------------------------------------------------------------
void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, op, ": x must be a 2-D CPU tensor [M, K], got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == K, op, ": x has K=", x.size(1), " but the weight has K=", K);
}

void check_w(const at::Tensor& w, at::ScalarType dt, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == dt, op,
              ": the weight must be a 2-D CPU ", dt, " tensor, got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) <= 1, op, ": the weight's rows must be contiguous");
}

// x as fp32 with contiguous elements (a view when it already is); int4 wants the permuted copy
at::Tensor x_fp32(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat && (x.stride(1) == 1 || x.size(1) <= 1)) return x;
  return x.to(at::kFloat).contiguous();
}

inline float as_f32(float v) { return v; }
inline float as_f32(uint16_t v) { return bf16_to_f32(v); }

// rows of s (stride lds) -> d [M, K] fp32: each block of 2 VW elements below kv as its even
// elements then its odd ones, the rest as they are
template <class T>
void permute_rows(const T* s, int64_t lds, int64_t M, int64_t K, int64_t kv, float* d) {
  for (int64_t m = 0; m < M; ++m, s += lds, d += K) {
    for (int64_t k0 = 0; k0 < kv; k0 += 2 * VW)
      for (int i = 0; i < VW; ++i) {
        d[k0 + i] = as_f32(s[k0 + 2 * i]);
        d[k0 + VW + i] = as_f32(s[k0 + 2 * i + 1]);
      }
    for (int64_t k = kv; k < K; ++k) d[k] = as_f32(s[k]);
  }
}

// see Bf16W. One allocation and one pass from x's own dtype: a decode step's ~33 linears each
// paid a widening .to(), a clone and a copy before (2.2-2.5 us of a 6-13 us call on 2 Zen 3 cores)
at::Tensor permute_x(const at::Tensor& x, int64_t kv) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xc = x.stride(1) == 1 || K <= 1 ? x : x.contiguous();
  at::Tensor xp = at::empty({M, K}, x.options().dtype(at::kFloat));
  if (xc.scalar_type() == at::kFloat)
    permute_rows(xc.data_ptr<float>(), xc.stride(0), M, K, kv, xp.data_ptr<float>());
  else
    permute_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.stride(0), M, K, kv,
                 xp.data_ptr<float>());
  return xp;
}

at::Tensor bias_fp32(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [", N, "], got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

Out make_out(at::Tensor& y, const at::Tensor& b) {
  Out o{nullptr, nullptr, y.size(1), b.defined() ? b.data_ptr<float>() : nullptr};
  if (y.scalar_type() == at::kFloat) o.yf = y.data_ptr<float>();
  else o.yb = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  return o;
}

// the shared tail of every entry point: rows (x fp32, widened weights) or panel
template <class F>
at::Tensor run(const F& f, const at::Tensor& x, const at::Tensor& xrows, int64_t N, int64_t K,
               const c10::optional<at::Tensor>& bias, bool out_fp32, bool panel) {
  const int64_t M = x.size(0);
  at::Tensor y = big::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  at::Tensor b = bias_fp32(bias, N);
  if (M == 0 || N == 0) return y;
  if (panel) {
    at::Tensor y32 = out_fp32 ? y : at::empty({M, N}, x.options().dtype(at::kFloat));
    panel_path(f, x.to(at::kFloat).contiguous(), N, K, y32);
    if (b.defined()) y32.add_(b);
    if (!out_fp32) y.copy_(y32);
    return y;
  }
  rows_path(f, xrows.data_ptr<float>(), xrows.stride(0), M, N, K, make_out(y, b));
  return y;
}

#if defined(BB_ISA_AVX512_BF16)
// bf16 x takes the lanes path (gemm_lanes.h) from 16 rows on (a full vector of rows), from 14
// with many channels (padded to 16 rows, it beat the rows path's 4 x 4 tiles from 12 rows when
// those stored one float at a time: LM head 248320 x 512 at 12 rows 12.6 vs 17.8 ms on a Zen 4;
// with store4, 4096 x 512 on a Zen 5: 12 rows 84.0 vs 72.5 us, 14 87.1 vs 87.1, 15 87.2 vs 91.5;
// at 6-8 rows and for 512-channel layers the rows path stays ahead), except for long rows at few
// rows: from K = 2048 the rows path's reductions are amortised and it was ahead up to 32 rows
// (down_proj 512 x 2048 on a Zen 4: 375-400 GFLOP/s vs 280-375)
inline bool lanes_pays(int64_t M, int64_t N, int64_t K) {
  return (M >= 16 || (M >= 14 && N >= 2048)) && (K < 2048 || M >= 48);
}

void lanes_path(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw, int64_t N,
                int64_t K, const Out& o) {
  const int64_t mp = (M + lanes::L - 1) / lanes::L * lanes::L;
  std::unique_ptr<uint32_t[]> xp(new uint32_t[size_t(K / 2) * size_t(mp)]);
  lanes::pack_x(x, ldx, M, K, xp.get(), mp, mp);
  lanes::run({xp.get(), mp, w, ldw, M, N, K, o.yf, o.yb, o.ldy, o.bias});
}

// bf16 x on bf16 W with VDPBF16PS: the lanes kernel where it pays, else the rows path
void bf16_dot(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw, int64_t N,
              int64_t K, const Out& o, bool use_lanes) {
  if (use_lanes && lanes_pays(M, N, K) && K % 2 == 0 && ldw % 2 == 0) lanes_path(x, ldx, M, w, ldw, N, K, o);
  else rows_path(Bf16Dp{w, ldw}, x, ldx, M, N, K, o);
}
#endif

#if defined(BB_ISA_AMX_BF16)
// AMX tiles from 4 rows on: one row's GEMV and two rows' gemv_rows already stream the weights at
// memory speed, and at 2-3 rows the tiles were 5-15% behind them (LM head 248320 x 512 on 2
// Sapphire Rapids cores: 2 rows 8.9 vs 8.4 ms, 3 rows 9.2 vs 8.4, 4 rows 8.9 vs 9.3; 64 rows
// 17.9 vs 70.7 on the lanes kernel)
inline bool amx_pays(int64_t M, int64_t N, int64_t K) { return M >= 4 && N >= amx::NT && K % amx::KT == 0; }

// whole blocks of 32 channels on AMX tiles (gemm_amx.h), the N % 32 tail on bf16_dot
void amx_path(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw, int64_t N,
              int64_t K, const Out& o, bool use_lanes) {
  const int64_t mp = (M + amx::L - 1) / amx::L * amx::L, nm = N / amx::NT * amx::NT;
  const int64_t ld = std::min(mp, amx::MC), blocks = (mp + ld - 1) / ld;   // the last block may be partial
  std::unique_ptr<uint32_t[]> xp(new uint32_t[size_t(K / 2) * size_t(blocks * ld)]);
  lanes::pack_x(x, ldx, M, K, xp.get(), ld, mp);
  amx::run({xp.get(), mp, w, ldw, M, nm, K, o.yf, o.yb, o.ldy, o.bias});
  if (nm == N) return;
  const Out tail{o.yf ? o.yf + nm : nullptr, o.yb ? o.yb + nm : nullptr, o.ldy, o.bias ? o.bias + nm : nullptr};
  bf16_dot(x, ldx, M, w + nm * ldw, ldw, N - nm, K, tail, use_lanes);
}
#endif

// ---- entry points -----------------------------------------------------------------------------
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       bool out_fp32, bool panel, bool use_lanes, bool use_amx) {
  check_w(w, at::kBFloat16, "linear_bf16");
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K, "linear_bf16");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
#if defined(BB_ISA_AVX512_BF16)
  if (!panel && x.scalar_type() == at::kBFloat16 && x.size(0) > 0 && N > 0) {
    at::Tensor xb = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor y = big::empty({x.size(0), N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
    at::Tensor b = bias_fp32(bias, N);
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
#if defined(BB_ISA_AMX_BF16)
    if (use_amx && amx_pays(x.size(0), N, K) && amx::ready()) {
      amx_path(xp, xb.stride(0), x.size(0), wp, w.stride(0), N, K, make_out(y, b), use_lanes);
      return y;
    }
#endif
    bf16_dot(xp, xb.stride(0), x.size(0), wp, w.stride(0), N, K, make_out(y, b), use_lanes);
    return y;
  }
#endif
  Bf16W f{wp, w.stride(0)};
  at::Tensor xr = panel ? x : permute_x(x, f.vector_k(K));
  return run(f, x, xr, N, K, bias, out_fp32, panel);
}

// w bf16 [N, K] -> its K-interleaved copy [ceil(N / TN), K, TN] (gemm_packed.h)
at::Tensor pack_bf16(const at::Tensor& w) {
  check_w(w, at::kBFloat16, "pack_bf16");
  const int64_t N = w.size(0), K = w.size(1), T = (N + packed::TN - 1) / packed::TN;
  at::Tensor p = at::empty({T, K, packed::TN}, w.options());
  packed::pack(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), w.stride(0), N, K,
               reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>()));
  return p;
}

// x [M, K] @ W^T (+ bias) on pack_bf16(W) for W's N channels
at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& p, int64_t N,
                              const c10::optional<at::Tensor>& bias, bool out_fp32) {
  TORCH_CHECK(p.device().is_cpu() && p.dim() == 3 && p.scalar_type() == at::kBFloat16 && p.is_contiguous() &&
              p.size(2) == packed::TN, "linear_bf16_packed: the weight must be pack_bf16's [T, K, ", packed::TN,
              "] bf16 tensor, got ", p.scalar_type(), " ", p.sizes());
  TORCH_CHECK(N > (p.size(0) - 1) * packed::TN && N <= p.size(0) * packed::TN, "linear_bf16_packed: N=", N,
              " does not fit ", p.size(0), " tiles of ", packed::TN, " channels");
  const int64_t K = p.size(1), M = x.size(0);
  check_x(x, K, "linear_bf16_packed");
  at::Tensor xf = x_fp32(x);
  at::Tensor y = big::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  at::Tensor b = bias_fp32(bias, N);
  if (M == 0) return y;
  packed::run(reinterpret_cast<const uint16_t*>(p.data_ptr<at::BFloat16>()), N, K, xf.data_ptr<float>(),
              xf.stride(0), M, make_out(y, b));
  return y;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool out_fp32, bool panel) {
  check_w(q, at::kChar, "linear_int8");
  const int64_t N = q.size(0), K = q.size(1);
  check_x(x, K, "linear_int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "linear_int8: scale must be [", N, "], got ",
              scale.sizes());
  at::Tensor s = scale.to(at::kFloat).contiguous();
  at::Tensor xr = panel ? x : x_fp32(x);
  return run(Int8W{q.data_ptr<int8_t>(), q.stride(0), s.data_ptr<float>()}, x, xr, N, K, bias,
             out_fp32, panel);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t group_size, bool out_fp32, bool panel) {
  check_w(packed, at::kByte, "linear_int4");
  const int64_t N = packed.size(0), K = 2 * packed.size(1);
  check_x(x, K, "linear_int4");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0,
              "linear_int4: group_size must be even and divide K=", K, "; got ", group_size);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size,
              "linear_int4: scales must be [", N, ", ", K / group_size, "], got ", scales.sizes());
  at::Tensor s = scales.to(at::kFloat).contiguous();
  Int4W f{packed.data_ptr<uint8_t>(), packed.stride(0), s.data_ptr<float>(), s.size(1), group_size};
  at::Tensor xr = panel ? x : permute_x(x, f.vector_k(K));
  return run(f, x, xr, N, K, c10::nullopt, out_fp32, panel);
}

// sum of a bf16 tensor, threads over contiguous chunks: a pure streaming read, the memory floor
// that benchmarks/cpu_kernels.py measures the GEMMs against
double sum_bf16(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
              "sum_bf16: a contiguous bf16 CPU tensor");
  const uint16_t* p = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  const int64_t chunk = 1 << 16, n = t.numel(), nchunks = (n + chunk - 1) / chunk;
  std::vector<double> part(nchunks, 0.0);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * chunk, e = std::min(n, b + chunk);
      VF a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      int64_t i = b;
      for (; i + 4 * VW <= e; i += 4 * VW) {
        a0 = vfma(vload_bf16(p + i), vset1(1.f), a0);
        a1 = vfma(vload_bf16(p + i + VW), vset1(1.f), a1);
        a2 = vfma(vload_bf16(p + i + 2 * VW), vset1(1.f), a2);
        a3 = vfma(vload_bf16(p + i + 3 * VW), vset1(1.f), a3);
      }
      double s = double(vsum(a0)) + vsum(a1) + vsum(a2) + vsum(a3);
      for (; i < e; ++i) s += bf16_to_f32(p[i]);
      part[c] = s;
    }
  });
  double s = 0.0;
  for (double v : part) s += v;
  return s;
}

const char* isa() {
#if defined(BB_ISA_AMX_BF16)
  return "amx_bf16";
#elif defined(BB_ISA_AVX512_BF16)
  return "avx512_bf16";
#elif defined(BB_ISA_AVX512)
  return "avx512";
#elif defined(BB_ISA_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace
}  // namespace bb

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace pybind11::literals;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear_bf16", &bb::linear_bf16, "x [M,K] @ bf16 W [N,K]^T (+ bias)", "x"_a, "w"_a,
        "bias"_a = py::none(), "out_fp32"_a = false, "panel"_a = false, "use_lanes"_a = true, "use_amx"_a = true, nogil);
  m.def("pack_bf16", &bb::pack_bf16,
        "bf16 W [N,K] -> its K-interleaved copy [ceil(N/TN), K, TN] for linear_bf16_packed", "w"_a, nogil);
  m.def("linear_bf16_packed", &bb::linear_bf16_packed, "x [M,K] @ W^T (+ bias) on pack_bf16(W) of N channels",
        "x"_a, "packed"_a, "n"_a, "bias"_a = py::none(), "out_fp32"_a = false, nogil);
  m.def("linear_int8", &bb::linear_int8, "x @ (int8 q [N,K] * scale [N])^T (+ bias)", "x"_a, "q"_a,
        "scale"_a, "bias"_a = py::none(), "out_fp32"_a = true, "panel"_a = false, nogil);
  m.def("linear_int4", &bb::linear_int4, "x @ dequant_int4(packed [N,K/2], scales [N,K/G])^T",
        "x"_a, "packed"_a, "scales"_a, "group_size"_a, "out_fp32"_a = true, "panel"_a = false, nogil);
  m.def("sum_bf16", &bb::sum_bf16, "sum of a bf16 tensor (a streaming read: the bandwidth probe)",
        nogil);
  m.def("isa", &bb::isa);
  m.def("set_gemv_rows", [](int64_t max_m, int64_t min_weights, int64_t max_k) {
    if (max_m < 2 || max_m > 4) throw std::invalid_argument("set_gemv_rows: max_m must be 2, 3 or 4");
    bb::GemvRows& s = bb::gemv_rows_setting();
    s.max_m = max_m, s.min_weights = min_weights, s.max_k = max_k;
  }, "rows (2..max_m), weight elements and K for which gemv_rows takes the rows path's tiles' place",
        "max_m"_a, "min_weights"_a, "max_k"_a);
  m.def("gemv_rows", [] {
    const bb::GemvRows& s = bb::gemv_rows_setting();
    return std::make_tuple(s.max_m, s.min_weights, s.max_k);
  }, "the setting set_gemv_rows takes: (max_m, min_weights, max_k)");
  m.def("set_gemv_rows_widened", [](int64_t max_m) {
    if (max_m != 0 && (max_m < 2 || max_m > 4))
      throw std::invalid_argument("set_gemv_rows_widened: max_m must be 0 (off), 2, 3 or 4");
    bb::gemv_rows_setting().widened_max_m = max_m;
  }, "rows (2..max_m) up to which bf16 weights widened in registers take gemv_rows (0: never; 4: on to "
     "GEMV_ROW_GROUPS_MAX rows, in groups of 4)", "max_m"_a);
  m.def("gemv_rows_widened", [] { return bb::gemv_rows_setting().widened_max_m; },
        "the setting set_gemv_rows_widened takes");
  m.def("set_lanes_channels", [](int64_t nc) {
#if defined(BB_ISA_AVX512_BF16)
    if (nc != 6 && nc != 12) throw std::invalid_argument("set_lanes_channels: 6 or 12");
    bb::lanes::wide_channels() = int(nc);
#endif
  }, "channels per lanes tile at 16 or 32 rows (6 or 12; no effect without the lanes kernel)", "nc"_a);
  m.def("lanes_channels", [] {
#if defined(BB_ISA_AVX512_BF16)
    return bb::lanes::wide_channels();
#else
    return 0;
#endif
  }, "the setting set_lanes_channels takes (0 without the lanes kernel)");
  m.attr("VW") = bb::VW;
  m.attr("INT4_STEP") = 2 * bb::VW;
  m.attr("PACKED_TN") = bb::packed::TN;
  m.attr("MB") = bb::MB;
  m.attr("NB") = bb::NB;
#if defined(BB_ISA_AMX_BF16)
  m.def("amx", &bb::amx::ready, "whether AMX tiles run here (AMX-BF16 and the kernel granted the tile state)");
#else
  m.def("amx", [] { return false; }, "whether AMX tiles run here (not in this build)");
#endif
}
