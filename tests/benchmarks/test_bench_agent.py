"""bench/serving/agent.py end to end on the CPU: a two-layer model with the default model's vocabulary and tokenizer
(`--model dummy:smollm2-tiny --tokenizer default`, the way a larger dummy shape is measured), caching on and off."""
import importlib.util
import json

from bench.serving.agent import main


def test_agents_with_dummy_weights_and_a_borrowed_tokenizer(tmp_path):
    out = tmp_path / "agent.json"
    main(["--model", "dummy:smollm2-tiny", "--tokenizer", "default", "--device", "cpu", "--dtype", "float32",
          "--agents", "2", "--turns", "2", "--system-tokens", "300", "--max-tokens", "40", "--out", str(out)])
    records = json.loads(out.read_text())
    records = records["records"] if isinstance(records, dict) else records
    by_mode = {r["mode"]: r for r in records}
    assert set(by_mode) == {"caching on", "caching off"}
    on, off = by_mode["caching on"], by_mode["caching off"]
    assert on["model"] == "dummy:smollm2-tiny" and on["system_tokens"] >= 300
    assert on["requests"] == off["requests"] == 4
    # the second turn's prompt extends the first, and the two agents share the system prompt
    assert on["cached_frac"] > 0.5 and off["cached_frac"] == 0
    assert (tmp_path / "agent.md").exists()
    # the plot needs the bench extra (matplotlib), which `make test` does not install
    assert (tmp_path / "agent.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
