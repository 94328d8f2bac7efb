"""The grammar backend (xgrammar) on the tiny tokenizer: specs checked and compiled, the reasoning
gate, tentative acceptance and rollback, the step bitmask over draft rows, and the CPU mask op
against its reference."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from backboard.ops.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref
from backboard.sample.grammar import GrammarCompiler, GrammarError, check_structured_outputs
from backboard.sample.grammar_mask import GrammarBatch, accept_step_tokens, cut_drafts, fill_step_bitmask
from backboard.sample.grammar_state import ACTIVE, REASONING, START, RequestGrammar
from backboard.sampling_params import StructuredOutputsParams as SO

VOCAB = 1024
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "n"]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from backboard.models.tiny import build_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(path)
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok[0], VOCAB, [tok[1].convert_tokens_to_ids("<|im_end|>")])
    yield c
    c.shutdown()


def ids(tok, text: str) -> list[int]:
    return tok[1].encode(text, add_special_tokens=False)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:VOCAB]).flatten().tolist())


def state(compiler, so: SO) -> RequestGrammar:
    return RequestGrammar(compiler.get(so), so)


# ---- specs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("so, param", [
    (SO(json='{"type": "objec"}'), "json"),
    (SO(json='{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'), "json"),
    (SO(regex="(ab"), "regex"),
    (SO(grammar="root ::= foo"), "grammar"),
])
def test_bad_specs_name_their_field(so, param):
    with pytest.raises(GrammarError) as e:
        check_structured_outputs(so)
    assert e.value.param == param
    assert "/project/" not in str(e.value) and str(e.value).startswith("invalid")


def test_spec_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        SO()


def test_compile_is_cached_by_key(compiler):
    a = compiler.submit(SO(json=json.dumps(SCHEMA)))
    b = compiler.submit(SO(json=json.dumps(SCHEMA)))
    c = compiler.submit(SO(regex="[0-9]+"))
    assert a is b and a is not c
    assert a.result(60) is not None and c.result(60) is not None


# ---- one request ------------------------------------------------------------------------------
def test_vocabulary_is_built_by_the_first_compile_not_at_start_up(tok, monkeypatch):
    # built at start-up, its seconds of one core fell on the first steps after /health said ready
    loads = []
    real = GrammarCompiler._load_vocabulary
    monkeypatch.setattr(GrammarCompiler, "_load_vocabulary", lambda self: (loads.append(1), real(self))[1])
    c = GrammarCompiler(tok[0], VOCAB, [tok[1].convert_tokens_to_ids("<|im_end|>")])
    try:
        time.sleep(0.3)
        assert loads == [] and not c.vocabulary_started
        assert c.get(SO(regex="ab")) is not None and loads == [1]
        c.get(SO(regex="abc"))
        assert loads == [1]
    finally:
        c.shutdown()


def test_json_schema_accepts_valid_and_refuses_invalid(tok, compiler):
    so = SO(json=json.dumps(SCHEMA))
    good = json.dumps({"name": "x", "n": 3, "tags": ["a"]})    # compact: ", " and ": "
    g = state(compiler, so)
    assert g.legal_prefix(ids(tok, good)) == len(ids(tok, good))
    bad = ids(tok, '{"name": 3}')
    assert g.legal_prefix(bad) < len(bad)
    g.accept_committed(ids(tok, good))
    assert g.num_rejected == 0 and not g.is_terminated
    g.accept_committed([tok[1].convert_tokens_to_ids("<|im_end|>")])
    assert g.is_terminated


def test_choice_and_regex(tok, compiler):
    g = state(compiler, SO(choice=["yes", "no way"]))
    assert g.legal_prefix(ids(tok, "no way")) == len(ids(tok, "no way"))
    assert g.legal_prefix(ids(tok, "maybe")) == 0
    g = state(compiler, SO(regex=r"[0-9]{3}-[a-z]+"))
    assert g.legal_prefix(ids(tok, "123-abc")) == len(ids(tok, "123-abc"))
    assert g.legal_prefix(ids(tok, "12a")) < len(ids(tok, "12a"))


def test_rollback_restores_state(tok, compiler):
    g = state(compiler, SO(json=json.dumps(SCHEMA)))
    bm = torch.full((2, 32), -1, dtype=torch.int32)
    g.fill(bm, 0)
    t = ids(tok, '{"name": "ab')
    assert g.legal_prefix(t) == len(t)             # accepts, then rolls back
    g.fill(bm, 1)
    assert torch.equal(bm[0], bm[1])


def test_reasoning_gate(tok, compiler):
    think, end = tok[1].convert_tokens_to_ids(["<think>", "</think>"])
    so = SO(choice=["yes"], think_token_ids=(think, end), think_open=True)
    g = state(compiler, so)
    assert g.gate == REASONING
    bm = torch.zeros(1, 32, dtype=torch.int32)
    assert g.fill(bm, 0) is False and len(allowed(bm, 0)) == VOCAB     # anything while reasoning
    free = ids(tok, "maybe not")
    assert g.legal_prefix(free) == len(free)
    g.accept_committed(free + [end])
    assert g.gate == ACTIVE
    assert g.legal_prefix(ids(tok, "maybe")) == 0 and g.legal_prefix(ids(tok, "yes")) > 0
    # not opened by the prompt: the grammar, or <think> as the first token
    g = state(compiler, SO(choice=["yes"], think_token_ids=(think, end)))
    assert g.gate == START
    g.fill(bm, 0)
    assert {think, ids(tok, "yes")[0]} <= allowed(bm, 0) and ids(tok, "maybe")[0] not in allowed(bm, 0)
    assert g.accept(think) and g.gate == REASONING
    g.rollback(1)
    assert g.gate == START
    assert g.accept(ids(tok, "yes")[0]) and g.gate == ACTIVE


# ---- a step -----------------------------------------------------------------------------------
def test_step_bitmask_masks_each_draft_row_by_the_state_after_earlier_drafts(tok, compiler):
    digits = SO(regex="[0-9]+x")
    batch = GrammarBatch(compiler.get)
    batch.add("a", digits, [])
    batch.add("b", digits, ids(tok, "12"))
    grammars = batch.of(["a", "free", "b"])
    one, x = ids(tok, "1")[0], ids(tok, "x")[0]
    drafts = [[one, x, one], [], [x]]            # a: the 3rd draft breaks the grammar
    num_logits = np.array([4, 1, 2])
    logit_start = np.array([0, 4, 5])
    bm, rows = fill_step_bitmask(grammars, drafts, logit_start, num_logits, VOCAB)
    assert bm.shape == (7, 32)
    assert rows == [0, 1, 2, 5, 6]               # a's rows 0-2, b's rows 5-6; row 3 and 4 free
    assert one in allowed(bm, 0) and x not in allowed(bm, 0)       # a: nothing yet, a digit first
    assert x in allowed(bm, 1)                                    # after "1": "x" allowed
    assert allowed(bm, 2) == {tok[1].convert_tokens_to_ids("<|im_end|>")}   # after "1x": the end
    assert len(allowed(bm, 3)) == VOCAB and len(allowed(bm, 4)) == VOCAB
    assert x in allowed(bm, 5)
    # the states are untouched by the tentative drafts
    assert grammars[0].legal_prefix([one, x]) == 2
    assert cut_drafts(grammars, [[one, x, one], [5], [x, x]]) == [[one, x], [5], [x]]
    accept_step_tokens(grammars, [[one], [7], [x]])
    assert grammars[2].legal_prefix(ids(tok, "1")) == 0           # b finished its "x"
    assert grammars[0].legal_prefix([x]) == 1


def test_drafts_past_the_stop_token_and_ignore_eos(tok, compiler):
    eos = tok[1].convert_tokens_to_ids("<|im_end|>")
    g = RequestGrammar(compiler.get(SO(regex="[0-9]x")), SO(regex="[0-9]x"))
    g.accept_committed(ids(tok, "1x"))
    bm, rows = fill_step_bitmask([g], [[eos, 5, 6]], np.array([0]), np.array([4]), VOCAB)
    assert rows == [0] and allowed(bm, 0) == {eos}
    g.accept_committed([eos])                      # ignore_eos: the request goes on
    bm, rows = fill_step_bitmask([g], [[]], np.array([0]), np.array([1]), VOCAB)
    assert rows == [0] and allowed(bm, 0) == {eos}


def test_preempted_request_replays_its_outputs(tok, compiler):
    so = SO(regex="[0-9]+x")
    batch = GrammarBatch(compiler.get)
    batch.add("r", so, ids(tok, "12x"))
    assert batch.states["r"].legal_prefix(ids(tok, "1")) == 0
    batch.remove("r")
    assert batch.of(["r"]) is None


# ---- the mask op ------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [1024, 50000])
def test_apply_bitmask_matches_reference(V):
    g = torch.Generator().manual_seed(0)
    W = (V + 31) // 32
    bm = torch.full((5, W), -1, dtype=torch.int32)
    bm[0] = 0
    bm[0, 3] = 0b1011                                   # sparse: 3 tokens
    bm[1] = torch.randint(-2**31, 2**31 - 1, (W,), generator=g, dtype=torch.int32)   # dense, mixed
    bm[2, 7] = 0                                        # nearly full
    bm[4] = 0
    bm[4, W - 1] = -1                                   # sparse, bits past V
    logits = torch.randn(5, V, generator=g)
    want = logits.clone()
    apply_token_bitmask_ref(want, bm, [0, 1, 2, 4])
    got = logits.clone()
    apply_token_bitmask(got, bm, [0, 1, 2, 4])
    assert torch.equal(got, want)
    assert torch.equal(got[3], logits[3])               # not listed: untouched
    assert torch.isfinite(got[0]).sum() == 3 and got[0].argmax() in (96, 97, 99)
