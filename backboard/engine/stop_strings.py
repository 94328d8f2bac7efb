"""Stop strings matched in one pass over new text: an Aho-Corasick automaton over the request's
stop strings, built once per distinct list (and shared by the n completions of a request), and a
per-completion matcher that keeps its automaton state between tokens.

Each new character costs one amortized transition whatever the number of stop strings, and the
text already seen is never searched again (a stop string that spans tokens is found because the
state carries over). The reported match is the one that starts earliest among those ending in the
new text, as a search of the whole text would find."""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """The goto / failure / output functions of Aho-Corasick over `stops` (immutable)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.goto: list[dict[str, int]] = [{}]
        self.fail: list[int] = [0]
        # the longest stop string that ends at each state (itself, or via failure links): -1 none
        self.out: list[int] = [-1]
        for k, s in enumerate(stops):
            self._insert(s, k)
        self._link()

    def _insert(self, s: str, k: int) -> None:
        state = 0
        for ch in s:
            nxt = self.goto[state].get(ch)
            if nxt is None:
                nxt = len(self.goto)
                self.goto[state][ch] = nxt
                self.goto.append({})
                self.fail.append(0)
                self.out.append(-1)
            state = nxt
        if self.out[state] < 0:                  # a duplicate keeps the first one
            self.out[state] = k

    def _link(self) -> None:
        """Failure links breadth-first; a state without a stop of its own inherits its failure
        state's (the longest proper suffix that is a stop string)."""
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[nxt] = self.goto[f].get(ch, 0) if self.goto[f].get(ch, 0) != nxt else 0
                if self.out[nxt] < 0:
                    self.out[nxt] = self.out[self.fail[nxt]]
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


@lru_cache(maxsize=128)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """One automaton per distinct stop list (requests reuse their clients' usual lists)."""
    return StopAutomaton(stops)


class StopMatcher:
    """One completion's position in the automaton."""

    def __init__(self, stops: list[str]) -> None:
        self.auto = automaton(tuple(stops))
        self.state = 0
        self.max_len = max((len(s) for s in stops), default=0)

    def feed(self, text: str, offset: int) -> tuple[int, str] | None:
        """Advance over `text`, which starts at character `offset` of the completion's text.
        Returns (start, stop string) of the earliest-starting match ending in it, or None."""
        auto, state, best = self.auto, self.state, None
        out, stops = auto.out, auto.stops
        for j, ch in enumerate(text):
            state = auto.step(state, ch)
            k = out[state]
            if k >= 0:
                start = offset + j + 1 - len(stops[k])
                if best is None or start < best[0]:
                    best = (start, stops[k])
        self.state = state
        return best
