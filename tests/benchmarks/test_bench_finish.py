"""bench/guided/finish.py end to end on the CPU: random weights (`dummy:smollm2-tiny` with the default model's
tokenizer) wander inside their JSON until the budget, so with closing off the outputs come back cut and with it on
every one ends "stop" and validates."""
import json
from pathlib import Path

import pytest

from bench.guided.finish import main

DATA = Path(__file__).resolve().parents[1] / "data"


def test_closing_turns_cut_outputs_into_valid_ones(tmp_path):
    pytest.importorskip("jsonschema")
    main(["--model", "dummy:smollm2-tiny", "--tokenizer", "default", "--device", "cpu", "--datasets", "JME",
          "--data", str(DATA), "--limit", "3", "--max-tokens", "48", "--max-num-seqs", "4", "--out", str(tmp_path)])
    body = json.loads((tmp_path / "finish.json").read_text())
    runs = {r["closing"]: r for r in body["records"]}
    off, on = runs["off"], runs["on"]
    assert off["requests"] == on["requests"] == 3 and body["model"] == "dummy:smollm2-tiny"
    assert on["valid_frac"] == on["required_frac"] == 1.0 and on["stop"] == 3 and on["length"] == 0
    assert off["length"] > 0 and off["valid_frac"] < 1.0
    assert on["closed_budget"] + on["closed_repetition"] >= off["length"]
    assert (tmp_path / "finish.md").read_text().count("| JME |") == 2
