"""The C++ GDN decode / verify step (ops/cpu/gdn_decode.h) against its torch reference
(ops.gdn.decode.gdn_decode_ref): output, conv states and recurrent states of every slot, at
shapes that are not multiples of the vector width, on every ISA level the machine runs."""

from __future__ import annotations

import pytest
import torch

from backboard.ops.cpu import decode_ops
from backboard.ops.gdn.decode import gdn_decode_ref
from tests.ops.cpu_isas import built, isa_param
from tests.ops.test_gdn_decode import _wrong_gqa_ref

NUM_SLOTS = 20
# bf16: a one-ulp difference in a rounded conv output (our exp vs torch's in the SiLU) moves the
# l2-normalised q / k and propagates through the recurrence; fp32 is tight
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=6e-2)}

CASES = {
    # B, L, nk, nv, dk, dv, K, dst kind, init
    "decode-gqa-alias": (3, 1, 2, 4, 16, 32, 4, "alias", "mixed"),
    "decode-odd-dims": (2, 1, 1, 3, 20, 24, 4, "other", None),
    "verify-r3-odd": (3, 2, 2, 6, 24, 40, 4, "per-position-alias", "mixed"),
    "verify-qwen-dims": (2, 4, 2, 2, 128, 128, 4, "per-position", "all"),
    "rows-final-only": (2, 3, 1, 1, 8, 72, 3, "other", "mixed"),
    # a prompt: many rows, state columns in several blocks with a tail (kColBlock = 4 vectors)
    "prefill-column-blocks": (2, 29, 1, 2, 24, 136, 4, "other", "mixed"),
    "prefill-blocks-per-position": (1, 11, 1, 1, 16, 72, 4, "per-position-alias", "all"),
    # an odd key dim: the second FMA chain's tail row; each row's k^T S from the previous row's pass
    "prefill-odd-dk": (2, 9, 1, 2, 13, 40, 4, "other", "mixed"),
}


def make_inputs(B, L, nk, nv, dk, dv, K, dst_kind, init, dtype, index_dtype=torch.int64, A_range=(1, 16)):
    C = 2 * nk * dk + nv * dv
    proj = torch.randn(B * L, C + nv * dv + 2 * nv).to(dtype)
    weight = (torch.randn(C, K) * 0.5).to(dtype)
    conv = torch.randn(NUM_SLOTS, K - 1, C).to(dtype)
    ssm = torch.randn(NUM_SLOTS, nv, dk, dv) * 0.1
    A_log = torch.empty(nv).uniform_(*A_range).log()
    dt_bias = torch.randn(nv).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(dv)).to(dtype)
    src = torch.tensor([3, 7, 1])[:B]
    if dst_kind.startswith("per-position"):
        dst = torch.arange(B * L).view(B, L) + 8            # slots 8.. (disjoint from src)
        if dst_kind.endswith("alias"):
            dst[:, 0] = src                                 # row 0 overwrites the source slot
    else:
        dst = src.clone() if dst_kind == "alias" else torch.tensor([12, 5, 9])[:B]
    has_init = {"mixed": torch.tensor([True, False, True])[:B], None: None,
                "all": torch.ones(B, dtype=torch.bool)}[init]
    kw = dict(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, eps=1e-6)
    args = (proj, weight, conv, A_log, dt_bias, norm_w, ssm, src.to(index_dtype), dst.to(index_dtype), has_init)
    return args, kw


def run_both(args, kw, fn):
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    ref = gdn_decode_ref(proj, w, c1, A_log, dt_bias, nw, s1, src.long(), dst.long(), init, **kw)
    out = fn(proj, w, c2, A_log, dt_bias, nw, s2, src, dst, init, **kw)
    return (out, c2, s2), (ref, c1, s1)


@isa_param
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gdn_decode_matches_reference(case, dtype, isa, close):
    built(isa)
    B, L, nk, nv, dk, dv, K, dst_kind, init = CASES[case]
    args, kw = make_inputs(B, L, nk, nv, dk, dv, K, dst_kind, init, dtype)
    (out, conv, ssm), (ref, conv_ref, ssm_ref) = run_both(
        args, kw, lambda *a, **k: decode_ops.gdn_decode(*a, **k, isa=isa))
    assert out.shape == (B * L, nv * dv) and out.dtype == dtype
    close(out, ref, **TOL[dtype])
    assert torch.equal(conv, conv_ref)                  # every slot, written or not: exact copies
    close(ssm, ssm_ref, **TOL[dtype])
    assert not torch.equal(ssm_ref, args[6])            # the states really moved


@isa_param
@pytest.mark.parametrize("A_range", [(0.002, 0.02), (0.2, 1.0)], ids=["never-rescales", "rescales-often"])
def test_long_prompt_keeps_the_decay_as_a_scale(A_range, isa, close):
    """A prompt's rows keep the state divided by the running product of decays (ops/cpu/
    gdn_decode.h, delta_span): over 300 rows at mild decays that product falls to ~1e-2 and is
    never folded back, at stronger ones it passes kMinScale every few dozen rows and the tile is
    rescaled; both match the reference row by row, and the final state in real scale."""
    built(isa)
    args, kw = make_inputs(1, 300, 1, 2, 128, 128, 4, "other", "all", torch.float32, A_range=A_range)
    (out, conv, ssm), (ref, conv_ref, ssm_ref) = run_both(
        args, kw, lambda *a, **k: decode_ops.gdn_decode(*a, **k, isa=isa))
    close(out, ref, **TOL[torch.float32])
    close(ssm, ssm_ref, **TOL[torch.float32])
    assert torch.equal(conv, conv_ref)


@isa_param
def test_int32_slots_and_strided_proj(isa, close):
    """int32 slot tensors, and proj as a column slice of a wider matrix (row stride != width)."""
    built(isa)
    args, kw = make_inputs(2, 2, 2, 4, 16, 24, 4, "per-position", "all", torch.float32, torch.int32)
    proj = args[0]
    wide = torch.randn(proj.shape[0], proj.shape[1] + 7)
    wide[:, 3:3 + proj.shape[1]] = proj
    view = wide[:, 3:3 + proj.shape[1]]
    (out, conv, ssm), (ref, conv_ref, ssm_ref) = run_both(
        (view, *args[1:]), kw, lambda *a, **k: decode_ops.gdn_decode(*a, **k, isa=isa))
    close(out, ref, **TOL[torch.float32])
    close(ssm, ssm_ref, **TOL[torch.float32])
    assert torch.equal(conv, conv_ref)


def test_verify_slot_t_holds_the_state_after_row_t(close):
    """dst_slots [B, L]: slot dst[b, t] holds the state after row t, which is the final state of
    the same step run over the first t + 1 rows only."""
    built(decode_ops.cpu_isa())
    args, kw = make_inputs(2, 3, 2, 4, 16, 16, 4, "per-position", "mixed", torch.float32)
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args
    c, s = conv.clone(), ssm.clone()
    decode_ops.gdn_decode(proj, w, c, A_log, dt_bias, nw, s, src, dst, init, **kw)
    rows = proj.view(2, 3, -1)
    for t in range(3):
        c2, s2 = conv.clone(), ssm.clone()
        part = rows[:, :t + 1].reshape(-1, proj.shape[1])
        decode_ops.gdn_decode(part, w, c2, A_log, dt_bias, nw, s2, src, dst[:, t].contiguous(), init, **kw)
        close(s[dst[:, t]], s2[dst[:, t]], **TOL[torch.float32])
        assert torch.equal(c[dst[:, t]], c2[dst[:, t]])


def test_comparison_catches_plausible_bugs(differs):
    """The tolerances used above are tight enough to see a wrong GQA mapping (value head j on
    key head j % nk) in bf16, and a verify step that writes only the final state."""
    built(decode_ops.cpu_isa())
    args, kw = make_inputs(2, 1, 2, 4, 16, 32, 4, "other", "all", torch.bfloat16)
    (out, _, ssm), (_, _, _) = run_both(args, kw, decode_ops.gdn_decode)
    (wrong, _, ssm_wrong), _ = run_both(args, kw, _wrong_gqa_ref)
    differs(out, wrong, **TOL[torch.bfloat16])
    differs(ssm, ssm_wrong, **TOL[torch.bfloat16])
    args, kw = make_inputs(2, 3, 2, 4, 16, 16, 4, "per-position", "all", torch.float32)
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args
    s1, s2 = ssm.clone(), ssm.clone()
    decode_ops.gdn_decode(proj, w, conv.clone(), A_log, dt_bias, nw, s1, src, dst, init, **kw)
    gdn_decode_ref(proj, w, conv.clone(), A_log, dt_bias, nw, s2, src, dst[:, -1].contiguous(), init, **kw)
    differs(s1, s2, **TOL[torch.float32])


def test_rejects_bad_arguments():
    built(decode_ops.cpu_isa())
    args, kw = make_inputs(2, 1, 2, 4, 16, 32, 4, "other", "mixed", torch.float32)
    proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init = args

    def call(**over):
        a = dict(proj=proj, conv_weight=w, conv_state=conv, A_log=A_log, dt_bias=dt_bias,
                 norm_weight=nw, ssm_state=ssm, src_slots=src, dst_slots=dst, has_initial_state=init)
        a.update(over)
        return decode_ops.gdn_decode(**a, **kw)

    with pytest.raises(ValueError, match="ssm_state must be float32"):
        call(ssm_state=ssm.to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of B"):
        call(proj=proj[:1], src_slots=torch.tensor([0, 1, 2]), dst_slots=torch.tensor([0, 1, 2]),
             has_initial_state=None)
    with pytest.raises(ValueError, match="dst_slots"):
        call(dst_slots=torch.zeros(2, 2, dtype=torch.int64))       # [B, L] with the wrong L
    with pytest.raises(ValueError, match="conv_state"):
        call(conv_state=conv[:, :2])                               # K-1 columns expected
    with pytest.raises(ValueError, match="contiguous last dim"):
        call(proj=torch.randn(proj.shape[1], 2).t())
    with pytest.raises(ValueError, match="has_initial_state"):
        call(has_initial_state=torch.ones(2))                      # bool expected
    with pytest.raises(ValueError, match=r"outside \[0, 20\)"):
        call(src_slots=torch.tensor([3, 20]))                      # no write past the state pool
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        decode_ops.gdn_decode(proj, w, conv, A_log, dt_bias, nw, ssm, src, dst, init,
                              **{**kw, "num_k_heads": 3})
