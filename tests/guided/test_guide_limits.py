"""engine/guided/limits.py: each bound refuses with a message naming it, and the defaults pass every real schema."""
import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.guided.limits import check_guide
from engine.guided.guide import Guide

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench"
C = EngineConfig(device="cpu")
BOUNDS = (C.tuning.guide_max_bytes, C.tuning.guide_max_enum, C.tuning.guide_max_depth, C.tuning.guide_max_repeat)


def schema(obj) -> Guide:
    return Guide("json_schema", json.dumps(obj), False)


def deep(n: int) -> dict:
    node: dict = {"type": "integer"}
    for _ in range(n):
        node = {"type": "array", "items": node}
    return node


@pytest.mark.parametrize("guide,word", [
    (schema({"description": "x" * (C.tuning.guide_max_bytes + 1)}), "guide_max_bytes"),
    (schema({"properties": {"v": {"enum": list(range(C.tuning.guide_max_enum + 1))}}}), "guide_max_enum"),
    (Guide("choice", json.dumps([str(i) for i in range(C.tuning.guide_max_enum + 1)]), False), "guide_max_enum"),
    (schema(deep(C.tuning.guide_max_depth)), "guide_max_depth"),
    (schema({"type": "string", "pattern": "[a-z]{2000}"}), "guide_max_repeat"),
    (schema({"patternProperties": {"^a{5,20000}$": {}}}), "guide_max_repeat"),
    (Guide("regex", "(ab){3,1001}", False), "guide_max_repeat"),
    (Guide("ebnf", 'root ::= "a"{0,5000}', False), "guide_max_repeat"),
])
def test_each_bound_names_itself(guide, word):
    with pytest.raises(ValueError, match=word):
        check_guide(guide, *BOUNDS)


def test_within_bounds_passes_and_escaped_braces_are_text():
    check_guide(schema({"type": "string", "pattern": "[a-z]{1000}"}), *BOUNDS)
    check_guide(Guide("regex", r"\{99999\}", False), *BOUNDS)
    check_guide(schema({"properties": {"enum": {"type": "string"}, "pattern": {"type": "string"}}}), *BOUNDS)


@pytest.mark.skipif(not DATA.is_dir(), reason="the schema collection is not beside this checkout")
def test_every_real_schema_passes_the_default_bounds():
    files = sorted(DATA.rglob("*.json"))
    assert len(files) > 1000
    for f in files:
        data = json.loads(f.read_text())
        check_guide(schema(data["schema"] if "maskbench" in f.parts else data), *BOUNDS)


@pytest.mark.parametrize("obj, shortest", [
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3}}, "required": ["a"]}, '{"a":"xxx"}'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[0,0]"),
    ({"type": "object", "minProperties": 2}, '{"":0,"":0}'),
    ({"anyOf": [{"type": "string", "minLength": 5}, {"type": "integer"}]}, "0"),
    ({"allOf": [{"type": "string", "minLength": 5}, {"type": "string", "minLength": 2}]}, '"xxxxx"'),
    ({"enum": ["abc", [1, 2]]}, '"abc"'),
    ({"type": ["string", "null"], "minLength": 9}, "null"),
    ({"properties": {"a": {"type": "array", "minItems": 3}}, "required": ["a"]}, '{"a":[0,0,0]}'),
    ({"$ref": "#/definitions/x", "definitions": {"x": {"type": "string", "minLength": 99}}}, ""),
])
def test_min_chars_is_the_shortest_instance_where_it_can_tell(obj, shortest):
    from engine.guided.limits import min_chars
    assert min_chars(obj) == len(shortest)


@pytest.mark.skipif(not DATA.is_dir(), reason="the schema collection is not beside this checkout")
def test_min_chars_of_the_real_schemas_fits_a_small_context():
    """Only one real schema forces more than a few hundred characters (an array of minItems 600 objects)."""
    from engine.guided.limits import min_chars
    sizes = sorted(min_chars(json.loads(f.read_text()).get("schema", {}) if "maskbench" in f.parts
                             else json.loads(f.read_text())) for f in DATA.rglob("*.json"))
    assert sizes[-2] < 512 and sizes[-1] < 20_000, sizes[-3:]


def test_a_tracker_checks_each_guide_once_and_refuses_a_bad_one_every_time(monkeypatch):
    """GuidedTracker.check_guide: a guide within bounds is walked once (its later requests find it remembered); one
    past a bound raises at every request."""
    from engine.guided import limits
    from engine.guided.tracker import GuidedTracker
    walked = []
    check = limits.check_guide
    monkeypatch.setattr(limits, "check_guide", lambda guide, *b: walked.append(guide) or check(guide, *b))
    tracker = GuidedTracker(None, 100, (), C, cuda=False)
    good, bad = schema({"type": "string"}), schema(deep(C.tuning.guide_max_depth))
    for _ in range(3):
        tracker.check_guide(good)
        with pytest.raises(ValueError, match="guide_max_depth"):
            tracker.check_guide(bad)
    assert walked == [good] + [bad] * 3
