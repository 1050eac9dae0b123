"""engine/requests/stop_strings.py: the automaton against a brute-force search, on random texts split at random."""
import random
import time

import pytest

from engine.requests.sequence import SamplingParams
from engine.requests.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS, StopStrings


def brute_cut(text: str, stops) -> int | None:
    """Where the text is cut: the earliest end of any stop string, the longest one ending there."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text.endswith(s, 0, end)]
        if found:
            return end - max(map(len, found))
    return None


def brute_held(text: str, stops) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def feed_pieces(auto: StopStrings, pieces):
    """Feed piece by piece as output.py does; returns (cut or None, held chars after each piece)."""
    state, text, helds = 0, "", []
    for piece in pieces:
        state, start = auto.feed(state, piece)
        if start is not None:
            return len(text) + start, helds
        text += piece
        helds.append((text, auto.held(state)))
    return None, helds


def split(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("seed", range(4))
def test_automaton_matches_brute_force(seed):
    for case in range(100):
        check_against_brute_force(random.Random(seed * 1000 + case), seed)


def check_against_brute_force(rng, seed):
    alphabet = "ab" if seed % 3 else "abc"
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))})
    text = "".join(rng.choice(alphabet + "x") for _ in range(rng.randint(0, 30)))
    cut, helds = feed_pieces(StopStrings(stops), split(rng, text) if text else [])
    assert cut == brute_cut(text, stops), (stops, text)
    for prefix, held in helds:
        assert held == brute_held(prefix, stops), (stops, prefix)


def test_cut_is_the_earliest_end_whatever_the_split():
    auto = StopStrings(("abcd", "bc"))
    assert feed_pieces(auto, ["abcd"])[0] == 1          # "bc" ends first; "abcd" would have needed one more char
    assert feed_pieces(auto, ["a", "b", "c", "d"])[0] == 1
    auto = StopStrings(("xbc", "bc"))
    assert feed_pieces(auto, ["axbcq"])[0] == 1          # both end at the same char: the longest, so the earliest start


def test_non_ascii_and_overlapping_prefixes():
    auto = StopStrings(("🎉🎉", "世界", "aab"))
    assert feed_pieces(auto, ["say 世", "界 ok"])[0] == 4
    assert feed_pieces(auto, ["aaaa", "ab"])[0] == 3
    _, helds = feed_pieces(auto, ["x🎉"])
    assert helds[-1][1] == 1


def test_long_stop_strings_build_and_match_in_linear_time():
    """The bound on one request: MAX_STOP_STRINGS strings of MAX_STOP_CHARS chars, fed 10,000 chars of
    near-misses. The old quadratic prefix table took seconds at this size; this takes milliseconds."""
    stops = tuple("a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(MAX_STOP_STRINGS))
    t0 = time.perf_counter()
    auto = StopStrings(stops)
    state, start = 0, None
    for _ in range(1000):
        state, start = auto.feed(state, "a" * 10)
    elapsed = time.perf_counter() - t0
    assert start is None and auto.held(state) == MAX_STOP_CHARS - 1
    assert len(auto.goto) == MAX_STOP_CHARS + MAX_STOP_STRINGS       # shared prefix: one chain, 16 leaves
    assert elapsed < 2.0, elapsed
    assert auto.feed(state, "c")[1] == -(MAX_STOP_CHARS - 1)


@pytest.mark.parametrize("stop,message", [
    (["x"] * (MAX_STOP_STRINGS + 1), f"stop: at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}"),
    ("y" * (MAX_STOP_CHARS + 1),
     f"stop: a stop string is at most {MAX_STOP_CHARS} characters, got {MAX_STOP_CHARS + 1}"),
    ([""], "stop must hold non-empty strings"),
])
def test_sampling_params_bound_stop_strings(stop, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SamplingParams(stop=stop)
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop="y" * MAX_STOP_CHARS)


def test_only_small_automata_are_shared():
    from engine.requests.stop_strings import CACHED_CHARS, stop_strings
    small = ("\n\n", "</s>")
    assert stop_strings(small) is stop_strings(small)
    big = ("x" * (CACHED_CHARS + 1),)
    assert stop_strings(big) is not stop_strings(big)
