"""Incremental detokenization: UTF-8 never half-emitted, stop strings across token boundaries,
streamed pieces concatenating to exactly the full decode."""

from __future__ import annotations

import random

import pytest

from backboard.engine.detokenizer import IncrementalDetokenizer
from backboard.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(hybrid_model):
    return Tokenizer(hybrid_model)


def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.update([t]) for t in ids]
    pieces.append(d.finish())
    return d, pieces


def test_multibyte_never_split(tok):
    text = "naïve café — 你好, мир! 🎉 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 2      # byte-level pieces: characters span tokens
    _, pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    for p in pieces:
        assert "\ufffd" not in p                   # no half characters


def test_random_tokens_concatenate_to_full_decode(tok):
    rnd = random.Random(0)
    for _ in range(20):
        ids = [rnd.randrange(len(tok)) for _ in range(rnd.randint(1, 40))]
        d, pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == d.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "the engine serves tokens quickly and then stops here"
    ids = tok.encode(text)
    d, pieces = _stream(tok, ids, stop=["quickly and"], include_stop_str_in_output=include)
    assert d.stopped_by == "quickly and"
    want = "the engine serves tokens " + ("quickly and" if include else "")
    assert "".join(pieces) == want == d.text
    # tokens after the stop are never fed
    assert tok.decode(d.token_ids).startswith(want) and len(d.token_ids) < len(ids)


def test_held_back_text_is_released_when_not_a_stop(tok):
    ids = tok.encode("abcabd")
    d, pieces = _stream(tok, ids, stop=["abcx"])
    assert d.stopped_by is None and "".join(pieces) == "abcabd"
    # nothing that could still become "abcx" was emitted before the end
    d2 = IncrementalDetokenizer(tok, stop=["abcx"])
    out = "".join(d2.update([t]) for t in tok.encode("xxabc"))
    assert not out.endswith("abc")


def test_earliest_of_several_stops(tok):
    d, pieces = _stream(tok, tok.encode("one two three four"), stop=["four", "two"])
    assert d.stopped_by == "two" and d.text == "one "
