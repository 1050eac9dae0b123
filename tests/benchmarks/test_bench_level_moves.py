"""bench/spec/level_moves.py's cost arguments: LEVEL:MS pairs, refused when malformed."""
import pytest

from bench.spec.level_moves import COSTS_MS, costs_of, parse_args


def test_costs_parse_and_default_to_every_level_of_k6():
    assert costs_of(["0:0.5", "3:0.75"]) == {0: 0.5, 3: 0.75}
    assert costs_of(parse_args([]).costs) == COSTS_MS and set(COSTS_MS) == {0, 1, 3, 6}


@pytest.mark.parametrize("item", ["3", "x:0.5", "3:0", "3:-1"])
def test_malformed_costs_are_refused(item):
    with pytest.raises(ValueError, match="LEVEL:MS"):
        costs_of([item])
