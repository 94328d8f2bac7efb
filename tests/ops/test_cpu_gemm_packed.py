"""The CPU GEMM's K-interleaved bf16 copy (gemm_packed.h, ops/cpu/gemm.py's
pack_widened): its layout, its kernel against the fp32 reference on every tested ISA level, and
which calls take it."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.cpu import gemm
from tests.ops.cpu_isas import isa_param


def _mod(isa):
    mod = gemm.module(isa)
    assert mod is not None, f"the gemm CPU kernels did not build for {isa}"
    return mod


@isa_param
def test_the_copy_holds_each_tiles_channels_side_by_side_at_every_k(isa):
    """Tile t, step k: position 2j is channel t TN + j, position 2j + 1 channel t TN + VW + j, zeros
    past the last channel (N = 2 tiles + 3 channels)."""
    mod = _mod(isa)
    TN, VW = mod.PACKED_TN, mod.VW
    assert TN == 2 * VW
    N, K = 2 * TN + 3, 5
    w = torch.arange(N * K, dtype=torch.float32).view(N, K).bfloat16()    # exact below 256
    p = mod.pack_bf16(w)
    assert p.shape == (3, K, TN) and p.dtype == torch.bfloat16
    for t in range(3):
        for j in range(TN):
            n = t * TN + j
            pos = 2 * j if j < VW else 2 * (j - VW) + 1
            want = w[n] if n < N else torch.zeros(K, dtype=torch.bfloat16)
            assert torch.equal(p[t, :, pos], want), (t, j)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
@isa_param
def test_packed_rows_match_the_fp32_reference(isa, x_dtype):
    """1-300 rows (groups of 4 and each 1-3 row rest), a partial last tile, K odd (the last step
    alone) and K = 1, bias or none, fp32 or bf16 out, strided rows of x, 1 or 2 threads; rows in
    several of a thread's row blocks (K 4100: blocks of 12 rows, K 70000: of 4)."""
    mod, kept = _mod(isa), torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for M, N, K in ((1, 67, 37), (2, 5, 1), (3, 2 * mod.PACKED_TN, 64), (4, 33, 100), (5, 67, 37),
                            (7, 1, 8), (13, 100, 19), (48, 71, 130), (128, 40, 33), (300, 37, 64),
                            (37, 35, 4100), (9, 20, 70000)):
                xs = torch.randn(M, K + 3).to(x_dtype)[:, 1:K + 1]            # rows strided
                w, b = torch.randn(N, K).bfloat16(), torch.randn(N)
                p = mod.pack_bf16(w)
                ref = xs.float() @ w.float().t()
                y = mod.linear_bf16_packed(xs, p, N, b, True)
                tol = 1e-4 * max(1, K / 1000)                                  # fp32 sums of K products
                torch.testing.assert_close(y, ref + b, rtol=1e-5, atol=tol, msg=f"M={M} N={N} K={K}")
                y16 = mod.linear_bf16_packed(xs, p, N)
                assert y16.dtype == torch.bfloat16 and y16.shape == (M, N)
                torch.testing.assert_close(y16.float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-2)
    finally:
        torch.set_num_threads(kept)


def test_a_copy_that_does_not_fit_is_refused_with_what_it_needs():
    mod = _mod(None)
    w = torch.randn(40, 16).bfloat16()
    p = mod.pack_bf16(w)
    with pytest.raises(RuntimeError, match="does not fit"):
        mod.linear_bf16_packed(torch.randn(2, 16), p, 40 + mod.PACKED_TN)
    with pytest.raises(RuntimeError, match="pack_bf16's"):
        mod.linear_bf16_packed(torch.randn(2, 16), w, 40)
    with pytest.raises(RuntimeError, match="K=17"):
        mod.linear_bf16_packed(torch.randn(2, 17), p, 40)


def test_linear_bf16_takes_the_copy_at_every_row_count(monkeypatch):
    """With a copy attached (pack_widened's attribute), linear_bf16 runs it for decode's rows and
    prefill's (past the panel path's start), decode_linear too; a copy of another tile width is not
    used."""
    mod = _mod(None)
    w = torch.randn(50, 64).bfloat16()
    p = mod.pack_bf16(w)
    setattr(w, gemm.K_PACKED_ATTR, p)
    calls, real = [], mod.linear_bf16_packed
    monkeypatch.setattr(mod, "linear_bf16_packed",
                        lambda x, q, n, *a: calls.append((len(x), q is p, n)) or real(x, q, n, *a))
    counts = (1, 4, 128, 300)
    assert gemm._panel(mod, 300, False, True)
    for M in counts:
        x = torch.randn(M, 64).bfloat16()
        ref = x.float() @ w.float().t()
        torch.testing.assert_close(gemm.linear_bf16(x, w, out_dtype=torch.float32, mod=mod), ref,
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gemm.decode_linear(M, mod)(x, w).float(), ref, rtol=1e-2, atol=1e-2)
    assert calls == [(M, True, 50) for M in counts for _ in range(2)]
    assert gemm._k_packed(w, mod) is p
    setattr(w, gemm.K_PACKED_ATTR, p.view(p.shape[0], p.shape[1] // 2, 2 * p.shape[2]))
    assert gemm._k_packed(w, mod) is None


def test_the_copies_are_made_where_this_level_widens_and_they_fit(monkeypatch):
    """pack_widened: on PACKED_ISAS levels every distinct bf16 weight gets its copy (the tied LM
    head once), all or nothing against PACK_MAX_SHARE of the memory available; elsewhere none."""
    mod = _mod(None)
    a, b = torch.randn(48, 32).bfloat16(), torch.randn(20, 32).bfloat16()
    weights, nbytes = [a, b, a, torch.randn(4, 4)], (48 + 20) * 32 * 2
    monkeypatch.setattr(gemm, "PACKED_ISAS", (mod.isa(),))
    assert gemm.pack_widened(weights, int(nbytes / gemm.PACK_MAX_SHARE) - 1, mod=mod) == 0
    assert not hasattr(a, gemm.K_PACKED_ATTR) and not hasattr(b, gemm.K_PACKED_ATTR)
    assert gemm.pack_widened(weights, None, mod=mod) == 0
    assert gemm.pack_widened(weights, int(nbytes / gemm.PACK_MAX_SHARE) + 1, mod=mod) == nbytes
    for w in (a, b):
        assert torch.equal(getattr(w, gemm.K_PACKED_ATTR), mod.pack_bf16(w))
    c = torch.randn(8, 32).bfloat16()
    monkeypatch.setattr(gemm, "PACKED_ISAS", ())
    assert gemm.pack_widened([c], 1 << 40, mod=mod) == 0 and not hasattr(c, gemm.K_PACKED_ATTR)


def test_the_runner_packs_the_layers_and_the_lm_head_for_decode(monkeypatch):
    """warm_cpu_gemm hands pack_widened the Linear weights and the LM head's, and only on the CPU
    with the kernels on."""
    seen = []
    monkeypatch.setattr(gemm, "pack_widened", lambda ws, avail, mod=None: seen.append(ws) or 0)
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    monkeypatch.delenv("BACKBOARD_CPU_KERNELS", raising=False)
    layers, head = [torch.randn(8, 4).bfloat16()], torch.randn(16, 4).bfloat16()
    dispatch.warm_cpu_gemm(torch.device("cpu"), layers, 64, head)
    dispatch.warm_cpu_gemm(torch.device("cuda"), layers, 64, head)
    with dispatch.override("torch"):
        dispatch.warm_cpu_gemm(torch.device("cpu"), layers, 64, head)
    assert len(seen) == 1 and seen[0][0] is layers[0] and seen[0][1] is head


def test_an_engine_serves_prefill_and_decode_from_the_copies_it_made(hybrid_model, monkeypatch):
    """The runner, after its caches, gives every bf16 Linear weight and the LM head's its copy (here
    on this machine's level whatever it is), and a greedy generation's prefill and decode steps then
    read them: the tokens match an engine that made none."""
    from backboard import LLM, SamplingParams
    from backboard.layers.linear import bf16_linear_weights
    monkeypatch.delenv("BACKBOARD_KERNELS", raising=False)
    monkeypatch.delenv("BACKBOARD_CPU_KERNELS", raising=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    # the LM head's full GEMV, not greedy decoding's INT8 screen of it (sample/greedy_screen.py)
    monkeypatch.setattr(dispatch, "argmax_screen_rows_max", lambda device: 0)
    monkeypatch.setattr(gemm, "PACKED_ISAS", ())
    plain = LLM(hybrid_model, dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    model = plain.engine.runner.model
    assert not hasattr(model.lm_head.weight, gemm.K_PACKED_ATTR)
    want = [o.outputs[0].token_ids for o in plain.generate([[5, 6, 7], [9, 10]], params)]
    monkeypatch.setattr(gemm, "PACKED_ISAS", (gemm.module().isa(),))
    llm = LLM(hybrid_model, dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    model = llm.engine.runner.model
    assert all(hasattr(w, gemm.K_PACKED_ATTR) for w in [*bf16_linear_weights(model), model.lm_head.weight])
    mod, taken = gemm.module(), []
    real = mod.linear_bf16_packed
    monkeypatch.setattr(mod, "linear_bf16_packed", lambda x, p, n, *a: taken.append((len(x), n)) or real(x, p, n, *a))
    got = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [9, 10]], params)]
    assert {m for m, _ in taken} == {5, 2}        # the prompts' 5 rows, then the logits and decode of both
    layers = {w.shape[0] for w in bf16_linear_weights(model)}
    assert {n for m, n in taken if m == 5} == layers
    assert {n for m, n in taken if m == 2} == layers | {model.lm_head.weight.shape[0]}
    assert got == want and len(got[0]) == 8
