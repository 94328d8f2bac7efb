"""Every Triton launch the engine can make, for one set of model shapes: the launchers called the
way the layers call them, over the batch sizes, query rows, contexts, dtypes and options the
engine can reach. Run inside host_compile.recording() to collect the distinct specialisations
(what a GPU compiles); no kernel runs and no tensor is read, so the tensors are torch.empty (a
27B-sized weight costs address space, not memory).

    KernelShapes      the dims the kernels see (QWEN35_27B, TINY: the tests' tiny hybrid)
    launch_all        every launcher over the engine's launch space for those shapes
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E = torch.empty
DTYPES = (torch.bfloat16, torch.float32)
DECODE_BATCH = (1, 2, 16, 64, 128, 256)      # requests of a uniform group (graph sizes and eager)
QUERY_ROWS = (1, 2, 4, 8, 17)                # L = 1 + k, k in [0, 16] (adaptive k changes it)
CONTEXTS = (1, 100, 255, 1000, 8192, 65536, 262144)   # block-table widths 1, 16, ...
GEMV_ROWS = (1, 2, 16, 24, 32, 48, 64, 256)  # draft rows (and prefill chunks of the draft head)
INT4_GROUPS = (32, 64, 128, 96)              # the quantizer's choices, and a non-power of two
INT4_GROUPS_CI = (64, 96)                    # the default, and the non-power of two
BLOCK_V_TUNING = (8, 16, 64, "head")   # besides the default (32); "head": dv (fused norm); gpu_check times these


@dataclass(frozen=True)
class KernelShapes:
    name: str
    hidden: int
    inter: int
    vocab: int
    nh: int
    nkv: int
    hd: int
    lk: int
    lv: int
    dk: int
    dv: int
    conv_k: int = 4
    block_size: int = 16
    rotary_dim: int = 0         # 0: a quarter of the head (Qwen3.5's partial rotary)

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.hd // 4)

    @property
    def conv_dim(self) -> int:
        return 2 * self.lk * self.dk + self.lv * self.dv

    @property
    def proj_dim(self) -> int:
        return self.conv_dim + self.lv * self.dv + 2 * self.lv

    def draft_linears(self) -> dict[str, tuple[int, int]]:
        """(N, K) of the draft head's int4 layers (the MTP layer: fc, gated attention, MLP)."""
        H, D = self.hidden, self.hd
        return {"fc": (H, 2 * H), "qkv_proj": (2 * self.nh * D + 2 * self.nkv * D, H),
                "o_proj": (H, self.nh * D), "gate_up_proj": (2 * self.inter, H),
                "down_proj": (H, self.inter)}


QWEN35_27B = KernelShapes("27b", hidden=5120, inter=17408, vocab=248320, nh=24, nkv=4, hd=256,
                          lk=16, lv=48, dk=128, dv=128)
TINY = KernelShapes("tiny", hidden=64, inter=96, vocab=1024, nh=4, nkv=2, hd=32,
                    lk=2, lv=4, dk=16, dv=24)
SHAPES = {s.name: s for s in (QWEN35_27B, TINY)}


def launch_norms(s: KernelShapes, dt: torch.dtype) -> None:
    from backboard.ops.triton import activation, norm
    for zc in (True, False):
        x = E(8, s.hidden, dtype=dt)
        norm.rms_norm(x, E(s.hidden, dtype=dt), 1e-6, zc)
        norm.fused_add_rms_norm(x, E(8, s.hidden, dtype=dt), E(s.hidden, dtype=dt), 1e-6, zc)
        q = E(8, s.nh, 2 * s.hd, dtype=dt)[..., :s.hd]                 # the query half of q_proj
        norm.rms_norm(q, E(s.hd, dtype=dt), 1e-6, zc)
        norm.rms_norm(E(8, s.nkv, s.hd, dtype=dt), E(s.hd, dtype=dt), 1e-6, zc)
    launch_rope(s, dt)
    proj = E(8, s.proj_dim, dtype=dt)
    z = proj[:, s.conv_dim:s.conv_dim + s.lv * s.dv].view(8, s.lv, s.dv)
    norm.gated_rms_norm(E(8, s.lv, s.dv, dtype=dt), z, E(s.dv, dtype=dt), 1e-6, dt)
    activation.silu_mul(E(8, 2 * s.inter, dtype=dt))


def launch_rope(s: KernelShapes, dt: torch.dtype) -> None:
    """The attention prologue as the layer calls it: q the query half of the joined projection,
    k / v its views; positions and slot_mapping slices of the step's int64 array at offsets that
    follow T (even and odd T); both norm conventions."""
    from backboard.ops.triton import rope
    q_rows, kv = 2 * s.nh * s.hd, s.nkv * s.hd
    cache = E(8, s.block_size, s.nkv, s.hd, dtype=dt)
    for T in (1, 4, 7):
        qkv = E(T, q_rows + 2 * kv, dtype=dt)
        q = qkv[:, :q_rows].view(T, s.nh, 2 * s.hd)[..., :s.hd]
        k = qkv[:, q_rows:q_rows + kv].view(T, s.nkv, s.hd)
        v = qkv[:, q_rows + kv:].view(T, s.nkv, s.hd)
        i64 = E(4 * T, dtype=torch.int64)
        for zc in (True, False):
            rope.qk_norm_rope_write_kv(q, k, v, E(s.hd, dtype=dt), E(s.hd, dtype=dt), 1e-6, zc,
                                       i64[T:2 * T], E(s.rotary_dim // 2, dtype=torch.float32),
                                       cache, cache, i64[2 * T:3 * T])


def _slots(B: int, L: int, per_position: bool, init: bool, offset: int):
    """Slot tensors as the layer passes them: slices of the step's [num_reqs] arrays."""
    src = E(offset + B, dtype=torch.int64)[offset:]
    dst = E(B, L, dtype=torch.int64) if per_position else src
    flags = E(offset + B, dtype=torch.bool)[offset:] if init else None
    return src, dst, flags


def launch_gdn(s: KernelShapes, dt: torch.dtype, block_vs: tuple = (None,)) -> None:
    """block_vs: None = the launcher's default (what the engine runs)."""
    from backboard.ops.triton import gdn_decode
    kw = dict(num_k_heads=s.lk, num_v_heads=s.lv, head_k_dim=s.dk, head_v_dim=s.dv, eps=1e-6)
    conv_state = E(8, s.conv_k - 1, s.conv_dim, dtype=dt)
    ssm_state = E(8, s.lv, s.dk, s.dv, dtype=torch.float32)
    for B in (1, 2, 16):
        for L in QUERY_ROWS:
            for init in (False, True):
                for offset in (0, 1):
                    src, dst, flags = _slots(B, L, L > 1, init, offset)
                    for bv in block_vs:
                        gdn_decode.gdn_decode(
                            E(B * L, s.proj_dim, dtype=dt), E(s.conv_dim, s.conv_k, dtype=dt),
                            conv_state, E(s.lv, dtype=torch.float32), E(s.lv, dtype=dt),
                            E(s.dv, dtype=dt), ssm_state, src, dst, flags, **kw,
                            block_v=s.dv if bv == "head" else bv)


PREFILL_SPANS = ([1], [64, 3], [300, 17, 2])   # one span; a chunk boundary; several spans


def launch_gdn_prefill(s: KernelShapes, dt: torch.dtype) -> None:
    """The prefill path: one specialisation per shape and dtype whatever the spans (cu_seqlens,
    chunk tables and slots are device arrays; the offsets of the slot slices vary)."""
    from backboard.ops.triton import gdn_prefill
    kw = dict(num_k_heads=s.lk, num_v_heads=s.lv, head_k_dim=s.dk, head_v_dim=s.dv, eps=1e-6)
    conv_state = E(8, s.conv_k - 1, s.conv_dim, dtype=dt)
    ssm_state = E(8, s.lv, s.dk, s.dv, dtype=torch.float32)
    for lens in PREFILL_SPANS:
        N, P = len(lens), sum(lens)
        cu = [0, *[sum(lens[:i + 1]) for i in range(N)]]
        for offset in (0, 1):
            slots = E(offset + N, dtype=torch.int64)[offset:]
            flags = E(offset + N, dtype=torch.bool)[offset:]
            gdn_prefill.gdn_prefill(E(P, s.proj_dim, dtype=dt), E(s.conv_dim, s.conv_k, dtype=dt),
                                    conv_state, E(s.lv, dtype=torch.float32), E(s.lv, dtype=dt),
                                    E(s.dv, dtype=dt), ssm_state, cu, slots, flags, **kw)


def launch_attention(s: KernelShapes, dt: torch.dtype) -> None:
    from backboard.ops.triton import attention
    kv = E(8, s.block_size, s.nkv, s.hd, dtype=dt)
    for B in DECODE_BATCH:
        for L in QUERY_ROWS:
            for ctx in CONTEXTS:
                max_len = ctx + L
                blocks = -(-max_len // s.block_size)
                for offset in (0, 1):
                    bt = E(offset + B, blocks, dtype=torch.int32)[offset:]
                    seq = E(offset + B, dtype=torch.int32)[offset:]
                    attention.paged_attention_decode(E(B, L, s.nh, s.hd, dtype=dt), kv, kv, bt, seq,
                                                     max_len, s.hd ** -0.5)


def launch_quant(s: KernelShapes, dt: torch.dtype, groups: tuple[int, ...] = INT4_GROUPS) -> None:
    from backboard.ops.triton import quant_gemm
    q8, s8 = E(s.vocab, s.hidden, dtype=torch.int8), E(s.vocab, dtype=torch.float32)
    for M in GEMV_ROWS:
        quant_gemm.int8_linear(E(M, s.hidden, dtype=dt), q8, s8)
    for N, K in s.draft_linears().values():
        for G in groups:
            if K % G:
                continue
            packed, scales = E(N, K // 2, dtype=torch.uint8), E(N, K // G, dtype=torch.float32)
            for M in GEMV_ROWS:
                quant_gemm.int4_linear(E(M, K, dtype=dt), packed, scales, G)


FAMILIES = {"norm": launch_norms, "gdn": launch_gdn, "gdn_prefill": launch_gdn_prefill,
            "attention": launch_attention, "quant": launch_quant}


def launch_all(s: KernelShapes, dtypes=DTYPES, families=tuple(FAMILIES), full: bool = True) -> None:
    """Every launch the engine can make at shapes `s`, and the recurrent kernel's whole-head
    block_v that gpu_check times; `full` adds the other block_v tuning candidates and every int4
    group size (not only the default and 96), which CI leaves to
    benchmarks/triton_compile_matrix.py."""
    for dt in dtypes:
        for family in families:
            if family == "quant" and not full:
                launch_quant(s, dt, INT4_GROUPS_CI)
            else:
                FAMILIES[family](s, dt)
        if "gdn" in families:                # the whole-head step (fused norm) is in CI too
            launch_gdn(s, dt, block_vs=BLOCK_V_TUNING if full else ("head",))
