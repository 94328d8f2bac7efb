"""Greedy decoding's INT8 screen of the LM head (ops/argmax_screen.py, sample/greedy_screen.py, the
C++ scan in ops/cpu/argmax.h): the scan against its reference on every ISA level, the error bound
against the kernels' own logits, and the screened argmax against the full head's argmax, on heads
built to fool the INT8 copy (near-ties it ranks the wrong way, duplicate rows)."""

from __future__ import annotations

import pytest
import torch

from backboard.ops import dispatch
from backboard.ops.argmax_screen import build_screen, row_norms, screen_candidates_ref
from backboard.ops.cpu import decode_ops
from backboard.sample.greedy_screen import screened_argmax
from tests.ops.cpu_isas import built, isa_param

CHUNK = 16384          # kArgmaxChunk


def _full_argmax(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return dispatch.argmax(dispatch.linear(h, w, out_dtype=torch.float32))


def _head(V: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, K, generator=g) * 0.05).bfloat16()


@isa_param
@pytest.mark.parametrize("R,N", [(1, 7), (3, CHUNK + 5), (4, 3 * CHUNK - 1)])
def test_scan_matches_reference(isa, R, N):
    built(isa)
    approx = torch.randn(R, N)
    slack = torch.rand(N) * 1e-3
    norm = torch.tensor([0.0, 50.0, 400.0, 1e4][:R])      # no slack at all; a few; most of the row
    approx[0, [3, N - 1]] = approx[0].max() + 1.0          # an exact tie at the top
    got = decode_ops.screen_candidates(approx, slack, norm, isa=isa)
    want = screen_candidates_ref(approx, slack, norm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1][:2].tolist() == [3, N - 1]               # row 0: the two tied maxima only


def test_bound_holds_against_the_kernels():
    """|the bf16 head's fp32 logits - the INT8 copy's| <= slack * ||x||_1, for random rows and
    rows aligned with each head row's quantization error (the worst case of the bound's shape)."""
    w = _head(4099, 512)
    screen = build_screen(w)
    err = w.float() - screen.q.float() * screen.scale[:, None]
    x = torch.cat([torch.randn(8, 512), torch.sign(err[:8]) * 3.0]).bfloat16()
    exact = dispatch.linear(x, w, out_dtype=torch.float32)
    approx = dispatch.int8_linear(x, screen.q, screen.scale, out_dtype=torch.float32)
    gap = (exact - approx).abs() / (screen.slack[None, :] * row_norms(x)[:, None])
    assert float(gap.max()) <= 1.0
    assert float(gap[8:].diagonal().min()) > 0.2            # the aligned rows come near the bound


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_screened_argmax_is_the_full_argmax(kernels, R):
    with dispatch.override(kernels):
        for seed in range(4):
            w = _head(3 * CHUNK + 11, 192, seed)
            h = torch.randn(R, 192, generator=torch.Generator().manual_seed(100 + seed)).bfloat16()
            assert screened_argmax(h, w, build_screen(w)).tolist() == _full_argmax(h, w).tolist()


def _fooling_head(h: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A head whose INT8 copy ranks two near-tied rows the wrong way for h [1, K]: -> (head, the
    exact winner, the row INT8 puts first)."""
    w = _head(2 * CHUNK + 3, h.shape[1], 7) * 0.1         # logits far below the pair's
    for _ in range(2000):
        a, b = (torch.randn(2, h.shape[1]) * 0.05).bfloat16()
        a[0] = b[0] = 1.0                                   # both far above the rest, near-tied
        pair = torch.stack([a, b])
        screen = build_screen(pair)
        exact = dispatch.linear(h, pair, out_dtype=torch.float32)[0]
        approx = dispatch.int8_linear(h, screen.q, screen.scale, out_dtype=torch.float32)[0]
        if (exact[0] - exact[1]) * (approx[0] - approx[1]) < 0:
            w[5], w[CHUNK + 9] = a, b
            return w, (5 if exact[0] > exact[1] else CHUNK + 9), (5 if approx[0] > approx[1] else CHUNK + 9)
    raise AssertionError("no pair the INT8 copy ranks the wrong way was found")


def test_a_pair_the_int8_copy_misranks():
    h = torch.randn(1, 128).bfloat16()
    h[0, 0] = 4.0
    w, winner, int8_first = _fooling_head(h)
    screen = build_screen(w)
    assert int8_first != winner
    approx = dispatch.int8_linear(h, screen.q, screen.scale, out_dtype=torch.float32)
    assert int(approx.argmax()) == int8_first              # INT8 alone would pick the wrong row
    assert screened_argmax(h, w, screen).tolist() == _full_argmax(h, w).tolist() == [winner]


def test_duplicate_rows_take_the_first():
    w = _head(CHUNK + 40, 64, 3)
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    tops = _full_argmax(h, w).tolist()
    for t in tops:
        w[CHUNK + 30 + tops.index(t)] = w[t]                # a copy later in the vocabulary
        w[t - 1] = w[t]                                     # and one earlier: it is the first
    got = screened_argmax(h, w, build_screen(w))
    assert got.tolist() == _full_argmax(h, w).tolist() == [t - 1 for t in tops]


def test_non_finite_rows_fall_back_to_the_full_head():
    w = _head(CHUNK + 40, 64, 3)
    h = torch.randn(3, 64).bfloat16()
    h[1, 5] = float("inf")
    h[2, 9] = float("nan")
    assert screened_argmax(h, w, build_screen(w)).tolist() == _full_argmax(h, w).tolist()


def test_no_screen_for_a_non_finite_head():
    w = _head(64, 32)
    w[3, 4] = float("inf")
    assert build_screen(w) is None
