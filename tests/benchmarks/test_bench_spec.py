"""--variants of bench/spec/spec.py and bench/step/profile_step.py (bench/common.py's parse_variants): engine
overrides measured side by side with the same baseline; the benches' --engine overrides (engine_overrides); and
the draft budget's view a spec run records."""
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


def test_a_run_records_the_budgets_view():
    """bench/spec/spec.py's budget_state: the pass rate of each draft position (K of them) and the step costs
    (none without graphs); nothing for an engine that does not speculate."""
    from bench.spec.spec import budget_state
    from engine.llm_engine import LLMEngine
    from helpers import CPU
    eng = LLMEngine(**CPU, speculative="ngram", num_speculative_tokens=3, max_num_seqs=2)
    state = budget_state(eng)
    assert len(state["budget_rates"]) == 3 and all(0 < r < 1 for r in state["budget_rates"])
    assert state["budget_costs_ms"] == {}
    assert budget_state(LLMEngine(**CPU, max_num_seqs=2)) == {}


def test_warm_grammars_leaves_each_schema_compiled():
    """bench/spec/spec_guided.py --warm-grammars: every schema of the calls is in the engine's grammar cache before
    they are timed, so a call's submit finds its grammar compiled."""
    from bench.guided.guided_quality import guided_params
    from bench.spec.spec_guided import warm_grammars
    from engine.llm_engine import LLMEngine
    from helpers import CPU
    eng = LLMEngine(**CPU, max_num_seqs=2)
    schemas = [{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
               {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}]
    work = [(s, None, guided_params(s, 16)) for s in schemas]
    try:
        warm_grammars(eng, work)
        for _, _, params in work:
            assert params.guide in eng.guided.service._cache
    finally:
        eng.close()
