"""bench/guided/guided_quality.py judges an output against the schema as written: a decimal `multipleOf` compares the
numbers the JSON text holds (jsonschema alone divides binary floats), and real violations stay invalid."""
import pytest

from bench.guided.guided_quality import explain_output

pytest.importorskip("jsonschema")
MONEY = {"type": "object", "properties": {"amount": {"type": "number", "multipleOf": 0.01}}}


@pytest.mark.parametrize("text,status", [
    ('{"amount": 10000.89}', "valid"),          # 10000.89 / 0.01 is 1000088.9999... in binary
    ('{"amount": 3}', "valid"),
    ('{"amount": 10000.891}', "invalid"),
    ('{"amount": "10"}', "invalid"),
    ('{"amount": 1', "unparsable"),
])
def test_multiple_of_is_checked_on_the_decimals_written(text, status):
    assert explain_output(MONEY, text)[0] == status


def test_other_keywords_still_fail_with_their_name():
    status, _, why = explain_output({"type": "object", "required": ["a"]}, "{}")
    assert status == "invalid" and why.startswith("required at (root)")
