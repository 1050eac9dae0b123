"""--variants of bench/spec/spec.py and bench/step/profile_step.py (bench/common.py's parse_variants): engine
overrides measured side by side with the same baseline; and the benches' --engine overrides (engine_overrides)."""
from types import SimpleNamespace

import pytest

from bench import common


def test_variants_parse_to_engine_overrides():
    assert common.parse_variants([]) == {"": {}}
    got = common.parse_variants(["whole:",
                                 "v16k:spec_draft_vocab=r.json,spec_draft_vocab_size=16384,draft_gather=true"])
    assert got == {"whole": {}, "v16k": {"spec_draft_vocab": "r.json", "spec_draft_vocab_size": 16384,
                                         "draft_gather": True}}


def test_an_inline_route_file_stays_text():
    """kernel_routes takes a route file's JSON as text; other values parse as JSON."""
    routes = '{"pins": [{"kernel": "cublas"}]}'
    got = common.engine_overrides(SimpleNamespace(engine=[f"kernel_routes={routes}", "kernels=auto", "depth=2"]))
    assert got == {"kernel_routes": routes, "kernels": "auto", "depth": 2}


@pytest.mark.parametrize("bad", [["noname"], [":a=1"], ["a:", "a:b=1"], ["a:=1"]])
def test_malformed_variants_are_refused(bad):
    with pytest.raises(SystemExit, match="--variants"):
        common.parse_variants(bad)
