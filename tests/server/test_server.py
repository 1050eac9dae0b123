"""`specdec serve` on the default model (CPU), driven by the official openai client over real HTTP."""
import json

import httpx
import jsonschema
import openai
import pytest

from engine.requests.sequence import SamplingParams
from serving import CPU_ARGS, serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server():
    with serve(*CPU_ARGS, "--max-num-seqs", "8", "--max-model-len", "512") as s:
        yield s


def chat(client, server, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model, **kw)


def check_calls(calls):
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_models_and_health(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == [server.model] and data[0]["max_model_len"] == 512
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 404     # only with --allow-cache-reset


def test_chat_equals_the_engine_token_for_token(server, client, engine):
    ids = engine.apply_chat_template(ASK)
    [seq] = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0))
    r = chat(client, server, max_tokens=24)
    assert r.choices[0].message.content == seq.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(seq.output_token_ids)
    assert r.choices[0].finish_reason == ("length" if len(seq.output_token_ids) == 24 else "stop")


def test_stream_gives_the_same_text_with_usage(server, client):
    full = chat(client, server, max_tokens=16).choices[0].message.content
    chunks = list(chat(client, server, max_tokens=16, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    running = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert running == sorted(running) and running[-1] == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_json_schema_output_validates(server, client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    r = chat(client, server, max_tokens=40, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = chat(client, server, max_tokens=40, response_format={"type": "json_object"}, temperature=0.7, seed=3,
             messages=[{"role": "user", "content": "Describe a cat as JSON"}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_choice_required_named_and_none(server, client):
    r = chat(client, server, max_tokens=60, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1 and not msg.content
    check_calls(msg.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, server, max_tokens=60, tools=TOOLS, tool_choice=named)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    check_calls(r.choices[0].message.tool_calls)
    plain = chat(client, server, max_tokens=8)
    r = chat(client, server, max_tokens=8, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens     # "none" leaves the tools out of the prompt


def test_parallel_tool_calls_and_streamed_calls(server, client):
    """With parallel calls allowed the grammar takes several calls; each streams as one whole delta."""
    r = chat(client, server, max_tokens=120, tools=TOOLS, tool_choice="required",
             messages=[{"role": "user", "content": "Weather in Paris and in Rome, and the time in CET?"}])
    calls = r.choices[0].message.tool_calls
    assert calls
    check_calls(calls)
    chunks = list(chat(client, server, max_tokens=120, tools=TOOLS, tool_choice="required", stream=True,
                       messages=[{"role": "user", "content": "Weather in Paris and in Rome, and the time in CET?"}]))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.index for tc in streamed] == list(range(len(streamed)))
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in calls]


def test_tool_choice_auto_gives_text_or_valid_calls(server, client):
    # a past turn shows the format; auto leaves the choice to the model and constrains what it calls
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "And in Rome?"}]
    r = chat(client, server, max_tokens=60, tools=TOOLS, tool_choice="auto", messages=messages)
    choice = r.choices[0]
    assert choice.message.tool_calls or choice.message.content
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)


def test_n_choices_and_completions(server, client):
    r = chat(client, server, max_tokens=6, n=2, temperature=0.9, seed=5)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    c = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=5, temperature=0)
    ids = client.completions.create(model=server.model, prompt=[504, 3575, 282, 4649, 314], max_tokens=5, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens == 5 and ids.usage.prompt_tokens == 5
    streamed = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, stream=True)
    assert "".join(x.choices[0].text for x in streamed) == c.choices[0].text


BAD = [
    ("temperature", dict(temperature=3)),
    ("top_p", dict(top_p=0)),
    ("max_tokens", dict(max_tokens=0)),
    ("n", dict(n=0)),
    ("top_logprobs", dict(logprobs=True, top_logprobs=21)),
    ("invalid json_schema", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}})),
    ("unsatisfiable schema", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}})),
    ("unknown tool", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})),
    ("tool_choice without tools", dict(tool_choice="required")),
    ("bad role", dict(messages=[{"role": "wizard", "content": "hi"}])),
    ("image content", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    ("prompt longer than the context", dict(messages=[{"role": "user", "content": "word " * 600}])),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_that_affects_nobody_else(server, client, case):
    kw = dict(model=server.model, messages=ASK, max_tokens=4) | case[1]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw)
    body = err.value.response.json()["error"]
    assert body["type"] == "invalid_request_error" and body["message"]
    assert chat(client, server, max_tokens=2).choices[0].message.content is not None
    server.wait_idle()


def test_malformed_bodies(server):
    for body in (b"{bad", b"[1, 2]", json.dumps({"model": "m"}).encode()):
        r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_disconnect_mid_stream_frees_the_pages(server):
    before = server.metrics()
    body = {"model": server.model, "messages": ASK, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 6:
                break
    after = server.wait_idle()
    assert after["specdec_request_finish_total{reason=abort}"] > before.get(
        "specdec_request_finish_total{reason=abort}", 0)
    assert after["specdec_generation_tokens_total"] < before["specdec_generation_tokens_total"] + 400


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(server):
    body = {"model": server.model, "messages": ASK, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=1.5))
    server.wait_idle()


def test_metrics_move(server, client):
    before = server.metrics()
    chat(client, server, max_tokens=5)
    after = server.metrics()
    key = "specdec_requests_total{endpoint=chat,status=200}"
    assert after[key] == before.get(key, 0) + 1
    assert after["specdec_generation_tokens_total"] >= before["specdec_generation_tokens_total"] + 5
    assert after["specdec_time_to_first_token_seconds_count"] == before["specdec_time_to_first_token_seconds_count"] + 1
    assert after["specdec_steps_total"] > before["specdec_steps_total"]
    for part in ("host_plan", "host_commit", "server_io"):       # where the engine process's loop spent its time
        name = f"specdec_{part}_seconds_total"
        assert after[name] > before[name], name
    assert after["specdec_engine_up"] == 1 and after["specdec_kv_blocks_total"] > 0


def test_metrics_under_vllms_names_say_what_ours_say(server, client):
    """Routers and dashboards built for vLLM (llm-d's endpoint picker, autoscalers) read these names."""
    labels = f"engine=0,model_name={server.model}"
    before = server.metrics()
    chat(client, server, max_tokens=5)
    after = server.wait_idle()

    def moved(name):
        return after[f"{name}{{{labels}}}"] - before.get(f"{name}{{{labels}}}", 0)
    assert moved("vllm:time_to_first_token_seconds_count") == 1 and moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:generation_tokens_total") == 5 and moved("vllm:prompt_tokens_total") > 0
    success = f"vllm:request_success_total{{engine=0,finished_reason=length,model_name={server.model}}}"
    assert after[success] == before.get(success, 0) + 1
    for ours, theirs in (("specdec_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                         ("specdec_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")):
        assert moved(theirs) == after[ours] - before[ours]
    assert after[f"vllm:num_requests_running{{{labels}}}"] == after["specdec_running_requests"] == 0
    assert after[f"vllm:num_requests_waiting{{{labels}}}"] == after["specdec_queue_length"] == 0
    assert after[f"vllm:kv_cache_usage_perc{{{labels}}}"] == after["specdec_kv_cache_usage_ratio"]
    assert after[f"vllm:num_preemptions_total{{{labels}}}"] >= 0
