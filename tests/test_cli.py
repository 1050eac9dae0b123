"""The console script, run as a user would: a real subprocess on the default model."""
import subprocess
import sys


def _run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_streams_and_reports_speed():
    r = _run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stderr


def test_chat_answers_then_exits():
    r = _run("chat", "--max-tokens", "12", "--device", "cpu", stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tokens/s" in r.stderr


def test_bad_arguments_give_clear_errors():
    r = _run("generate", "--prompt", "hi", "--max-tokens", "0", "--device", "cpu")
    assert r.returncode == 2 and "max_tokens" in r.stderr
    r = _run("generate", "--prompt", "hi", "--model", "/no/such/dir", "--device", "cpu")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_a_request_that_fails_exits_non_zero_and_says_why(tmp_path):
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "objekt"}')
    r = _run("generate", "--prompt", "hi", "--max-tokens", "4", "--device", "cpu", "--json-schema", str(schema))
    assert r.returncode == 1 and "specdec: error: invalid json_schema" in r.stderr, r.stderr
    r = _run("chat", "--max-tokens", "8", "--device", "cpu", "--json-schema", str(schema), stdin="hi\n/exit\n")
    assert r.returncode == 0 and "specdec: error: invalid json_schema" in r.stderr, r.stderr


def test_guided_speculative_generate_gives_a_valid_tool_call():
    import json
    r = _run("generate", "--prompt", "Call get_weather for Paris in celsius.", "--max-tokens", "48", "--device", "cpu",
             "--speculative", "eagle", "--json-schema", "docs/examples/get_weather.schema.json", "--draft-masks",
             "--forced-drafts")
    assert r.returncode == 0, r.stderr
    call = json.loads(r.stdout.strip())
    assert call["name"] == "get_weather" and call["arguments"]["unit"] in ("celsius", "fahrenheit")


def test_generate_over_two_tensor_parallel_ranks():
    """-tp 2 on the CPU: a gloo worker process; the same answer, and no worker left behind."""
    r = _run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--device", "cpu",
             "--tensor-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tensor-parallel worker" in r.stderr
