"""The stop-string matcher (engine/stop_strings.py) against a plain search of the whole text: the
same match (earliest start; at one start, the one completed first) whatever the stop strings
overlap, and whatever pieces the text arrives in."""

from __future__ import annotations

import random

import pytest

from backboard.engine.stop_strings import StopMatcher


def _search(text: str, stops: list[str]) -> tuple[int, str] | None:
    """What a search of the whole text finds: the earliest start, then the shortest."""
    hits = [(i, len(s), s) for s in stops if (i := text.find(s)) >= 0]
    return min(hits)[::2] if hits else None


def _feed(stops: list[str], pieces: list[str]) -> tuple[int, str] | None:
    """The matcher fed piece by piece, stopping at its first match (as the detokenizer does)."""
    m, offset = StopMatcher(stops), 0
    for p in pieces:
        hit = m.feed(p, offset)
        if hit is not None:
            return hit
        offset += len(p)
    return None


def _split(rnd: random.Random, text: str) -> list[str]:
    cuts = sorted(rnd.sample(range(1, len(text)), k=min(len(text) - 1, rnd.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("seed", range(8))
def test_same_match_as_a_whole_text_search(seed):
    rnd = random.Random(seed)
    for _ in range(300):
        stops = ["".join(rnd.choices("abc", k=rnd.randint(1, 5))) for _ in range(rnd.randint(1, 8))]
        text = "".join(rnd.choices("abcd", k=rnd.randint(1, 40)))
        pieces = _split(rnd, text)
        got, want = _feed(stops, pieces), None
        # the whole-text search, cut where the piece that completed the match ends
        seen = ""
        for p in pieces:
            seen += p
            want = _search(seen, stops)
            if want is not None:
                break
        assert got == want, (stops, pieces)


def test_overlapping_and_nested_stops():
    # in one piece the earliest start wins; token by token, "bc" completes first and ends the text
    assert _feed(["abcd", "bc"], ["abcd"]) == (0, "abcd")
    assert _feed(["abcd", "bc"], ["ab", "c", "d"]) == (1, "bc")
    # a stop that is a suffix of a longer one, reached through failure links
    assert _feed(["xyz", "aaxy"], ["aax", "yz"]) == (0, "aaxy")
    assert _feed(["she", "he", "hers"], ["ushers"]) == (1, "she")
    assert _feed(["abab"], ["aba", "bab"]) == (0, "abab")
    assert _feed(["zz"], ["abc", "def"]) is None


def test_many_stop_strings_share_one_automaton():
    """100,000 stop strings (the issue's probe): found across pieces, and the automaton is built
    once for the n completions of a request (one per distinct list)."""
    stops = [f"never{i:07d}" for i in range(100_000)] + ["the end"]
    a, b = StopMatcher(stops), StopMatcher(list(stops))
    assert a.auto is b.auto
    assert _feed(stops, ["and so never00 it was the e", "nd of it"]) == (len("and so never00 it was "), "the end")
    assert _feed(stops, ["xx never0099", "999 yy"]) == (3, "never0099999")
