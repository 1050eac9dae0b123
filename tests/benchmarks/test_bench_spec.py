"""bench/spec/spec.py's --variants: engine overrides measured side by side with the same baseline."""
import pytest

from bench.spec import spec


def test_variants_parse_to_engine_overrides():
    assert spec.parse_variants([]) == {"": {}}
    got = spec.parse_variants(["whole:", "v16k:spec_draft_vocab=r.json,spec_draft_vocab_size=16384,draft_gather=true"])
    assert got == {"whole": {}, "v16k": {"spec_draft_vocab": "r.json", "spec_draft_vocab_size": 16384,
                                         "draft_gather": True}}


@pytest.mark.parametrize("bad", [["noname"], [":a=1"], ["a:", "a:b=1"], ["a:=1"]])
def test_malformed_variants_are_refused(bad):
    with pytest.raises(SystemExit, match="--variants"):
        spec.parse_variants(bad)
