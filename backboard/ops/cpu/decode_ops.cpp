// The fused decode ops of a CPU step (one extension, compiled once per ISA level by build.py):
// the GDN decode / verify step, paged decode attention, causal prefill attention (AVX512-BF16
// builds), RMSNorm (+ residual), the GDN gated norm, SiLU-mul, the attention prologue (q / k
// norm, RoPE, K/V cache write), greedy argmax (and its INT8 screen's scan), random sampling's
// draw and the prefix cache's block / slot copies. Each has the signature of its torch reference
// (the Python wrapper backboard/ops/cpu/decode_ops.py passes the arguments through) and is tested
// against it.
#include <torch/csrc/utils/pybind.h>

#include "argmax.h"
#include "cache_copy.h"
#include "gdn_decode.h"
#include "norm_act.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "rope.h"
#include "sampling.h"

namespace {

const char* isa_name() {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Backboard fused CPU decode ops";
  m.def("isa", &isa_name, "the instruction-set level this build was compiled for");
  m.def("vector_lanes", [] { return bb::VF::N; }, "fp32 lanes of one SIMD vector in this build");
  m.def("gdn_decode", &bb::gdn_decode, "GDN decode / verify step (see ops.gdn.decode.gdn_decode_ref)",
        py::arg("proj"), py::arg("conv_weight"), py::arg("conv_state"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("norm_weight"), py::arg("ssm_state"), py::arg("src_slots"),
        py::arg("dst_slots"), py::arg("has_initial_state"), py::arg("num_k_heads"),
        py::arg("num_v_heads"), py::arg("head_k_dim"), py::arg("head_v_dim"), py::arg("eps"));
  m.def("paged_attention_decode", &bb::paged_attention_decode,
        "paged attention of uniform groups (see ops.attention.paged_attention_uniform)");
  m.def("has_prefill_attention", [] { return bb::kPrefillAttention; },
        "whether this build has paged_attention_prefill (AVX512-BF16 and AMX-BF16 builds)");
#if defined(BB_ISA_AVX512_BF16)
  m.def("paged_attention_prefill", &bb::paged_attention_prefill,
        "causal bf16 prefill attention of one request (see ops.attention.paged_attention_prefill_ref)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table_row"), py::arg("seq_len"),
        py::arg("scale"), py::arg("use_amx") = true);
#endif
  m.def("copy_slices", &bb::copy_slices,
        "slices src -> dst along dim 0 or 1 of every tensor, in order (see ops.cache_copy.copy_slices_ref)");
  m.def("argmax_rows", &bb::argmax_rows, "torch.argmax(x, -1) of fp32 logits [R, V] (first maximum, NaN largest)");
  m.def("screen_candidates", &bb::screen_candidates,
        "greedy decoding's screen: per row the indices whose bounds reach the largest lower bound "
        "(see ops.argmax_screen.screen_candidates_ref)");
  m.def("sample_inverse_cdf", &bb::sample_inverse_cdf,
        "one token a row of probabilities [R, V] at uniforms [R] (see ops.sampling.sample_inverse_cdf_ref)");
  m.def("sample_logits", &bb::sample_logits,
        "the draw of softmax(logits * inv_t) at uniforms [R], fused (see ops.sampling.sample_logits_ref)");
  m.def("rms_norm", &bb::rms_norm, "RMSNorm (see ops.norm.rms_norm)");
  m.def("fused_add_rms_norm", &bb::fused_add_rms_norm, "residual add + RMSNorm (see ops.norm.fused_add_rms_norm_ref)");
  m.def("gated_rms_norm", &bb::gated_rms_norm, "GDN output norm (see ops.norm.gated_rms_norm)");
  m.def("silu_mul", &bb::silu_mul, "silu(gate) * up (see ops.activation.silu_mul_ref)");
  m.def("qk_norm_rope_write_kv", &bb::qk_norm_rope_write_kv,
        "q / k RMSNorm + RoPE + K/V cache write (see ops.rotary.qk_norm_rope_write_kv_ref)");
}
