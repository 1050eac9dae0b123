"""Stop strings as one Aho-Corasick automaton: O(total length) to build, O(new text) per commit.

The text is cut as soon as it contains a stop string: at the earliest position where one ends, and of the stop
strings ending there, the longest (so the cut is the earliest start among them). That makes the cut independent
of how the text was split into tokens. The automaton's state after the text is the longest tail of the text that
a stop string starts with, which is exactly what a stream must hold back: its depth.
"""
from __future__ import annotations

import functools

# Bounds on one request's stop strings (SamplingParams checks them). The OpenAI API takes at most 4; vLLM takes
# any number. These leave room for agent frameworks that pass a handful, and keep a request's automaton small.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


class StopStrings:
    """Immutable automaton over a tuple of stop strings; a request keeps its own state (an int, 0 = root)."""
    __slots__ = ("stops", "goto", "fail", "depth", "match")

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        terminal = [False]
        for s in stops:
            state = 0
            for ch in s:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    terminal.append(False)
                state = nxt
            terminal[state] = True
        self.fail = [0] * len(self.goto)
        # match[s]: length of the longest stop string that is a suffix of state s's string (0 if none)
        self.match = [self.depth[s] if terminal[s] else 0 for s in range(len(self.goto))]
        self._link()

    def _link(self) -> None:
        """Failure links breadth first: a state's link is the longest proper suffix of it that is in the trie."""
        queue = list(self.goto[0].values())
        for state in queue:             # the list grows as we go: breadth-first order
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                link = self.goto[f].get(ch, 0)
                self.fail[nxt] = link if link != nxt else 0
                if not self.match[nxt]:
                    self.match[nxt] = self.match[self.fail[nxt]]
                queue.append(nxt)

    def feed(self, state: int, text: str) -> tuple[int, int | None]:
        """Advance over `text`. Returns (state, start): where the first stop string to end in `text` starts,
        relative to text[0] (negative when it began in earlier text), or None. The request ends at a match, so
        the state returned with one is not fed again."""
        goto, fail, match = self.goto, self.fail, self.match
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state]:
                return state, i + 1 - match[state]
        return state, None

    def held(self, state: int) -> int:
        """Chars at the end of the text that a stop string starts with: they may still become one."""
        return self.depth[state]


CACHED_CHARS = 256      # automata of at most this many chars in all are shared; larger ones are built per request


def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton for these stop strings. Common small sets are shared (an automaton is never mutated); a
    large one is built for its request alone, so distinct hostile sets (up to 4 MB each at the bounds) are
    never kept."""
    return _shared(stops) if sum(map(len, stops)) <= CACHED_CHARS else StopStrings(stops)


@functools.lru_cache(maxsize=256)
def _shared(stops: tuple[str, ...]) -> StopStrings:
    return StopStrings(stops)
