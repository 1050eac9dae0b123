"""The API's edges over real HTTP (CPU): explicit nulls, 404s in OpenAI's shape, one model's card, vLLM's
extension fields (guides honoured, unsupported sampling options refused by name, chat template options), and
/tokenize and /detokenize."""
import json

import httpx
import jsonschema
import openai
import pytest

from serving import CPU_ARGS, serve

ASK = [{"role": "user", "content": "Give me a small JSON object about a cat."}]
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
       "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server():
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512", "--served-model-name", "smol", "smol-b",
               "--allow-cache-reset") as s:
        yield s


def post(server, path, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_explicit_nulls_take_the_defaults(server):
    body = {"model": server.model, "messages": ASK, "max_tokens": 4, "temperature": 0, "n": None, "stream": None,
            "presence_penalty": None, "frequency_penalty": None, "parallel_tool_calls": None, "logprobs": None,
            "stop": None, "seed": None, "response_format": None, "tools": None, "top_logprobs": None,
            "repetition_penalty": None, "min_p": None, "min_tokens": None, "logit_bias": None}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 4


def test_unknown_model_route_and_method_are_404_405_in_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=ASK, max_tokens=2)
    assert err.value.response.json()["error"]["code"] == "model_not_found"
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code == status and r.json()["error"]["message"].startswith(f"{method} {path}"), r.text


def test_several_served_names(server, client):
    assert server.model == "smol" and [m.id for m in client.models.list()] == ["smol", "smol-b"]
    r = client.chat.completions.create(model="smol-b", messages=ASK, max_tokens=2)
    assert r.model == "smol"                     # responses carry the first name
    with pytest.raises(openai.NotFoundError, match="'smol', 'smol-b'"):
        client.chat.completions.create(model="smol-c", messages=ASK, max_tokens=2)


def test_one_models_card(server, client):
    assert client.models.retrieve(server.model).id == server.model
    assert client.models.retrieve("smol-b").id == "smol-b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


@pytest.mark.parametrize("extra,check", [
    ({"guided_json": CAT}, lambda text: jsonschema.validate(json.loads(text), CAT)),
    ({"structured_outputs": {"json": CAT}}, lambda text: jsonschema.validate(json.loads(text), CAT)),
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no") or pytest.fail(text)),
    ({"structured_outputs": {"regex": "[0-9]{3}"}},
     lambda text: len(text) == 3 and text.isdigit() or pytest.fail(text)),
    ({"guided_grammar": 'root ::= "cat" | "dog"'}, lambda text: text in ("cat", "dog") or pytest.fail(text)),
])
def test_vllm_guides_are_honoured(server, client, extra, check):
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=48, temperature=0,
                                       extra_body=extra)
    check(r.choices[0].message.content)


@pytest.mark.parametrize("extra,word", [
    ({"guided_json": CAT, "guided_regex": "a"}, "at most one guide"),
    ({"guided_json": CAT, "response_format": {"type": "json_object"}}, "structured_outputs or guided_"),
    ({"structured_outputs": {"grammer": "x"}}, "structured_outputs.grammer"),
    ({"logit_bias": {"50256": -100}}, "logit_bias token ids out of range"),
    ({"logit_bias": {"the": 5}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"28": 120}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 3, "guided_json": CAT}, "min_tokens"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "the assistant's"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, client, extra, word):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2, extra_body=extra)
    assert word in err.value.response.json()["error"]["message"]


def test_penalties_min_p_and_min_tokens_are_honoured(server, client, engine):
    from engine.requests.sequence import SamplingParams
    fields = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.2, min_p=0.05, min_tokens=6)
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=12, temperature=0,
                                       presence_penalty=0.8, frequency_penalty=0.5,
                                       extra_body={k: fields[k] for k in ("repetition_penalty", "min_p", "min_tokens")})
    [seq] = engine.generate([engine.apply_chat_template(ASK)], SamplingParams(max_tokens=12, temperature=0, **fields))
    assert r.choices[0].message.content == seq.text and r.usage.completion_tokens == len(seq.output_token_ids)
    c = client.completions.create(model=server.model, prompt="One, two,", max_tokens=4, temperature=0,
                                  frequency_penalty=1.0, extra_body={"min_tokens": 2})
    assert c.usage.completion_tokens >= 2


def test_logit_bias_is_honoured(server, client, engine):
    from engine.requests.sequence import SamplingParams
    bias = {"28": 100, "30": -100}
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=5, temperature=0, logit_bias=bias)
    [seq] = engine.generate([engine.apply_chat_template(ASK)], SamplingParams(
        max_tokens=5, temperature=0, logit_bias={int(k): v for k, v in bias.items()}))
    assert seq.output_token_ids == [28] * 5 and r.choices[0].message.content == seq.text
    c = client.completions.create(model=server.model, prompt="One, two,", max_tokens=3, temperature=0,
                                  logit_bias={"28": 100})
    assert c.choices[0].text == seq.text[:len(c.choices[0].text)] and c.usage.completion_tokens == 3


def test_off_values_and_template_options_are_accepted(server, client):
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2, temperature=0, extra_body={
        "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens == 2


def test_tokenize_and_detokenize(server):
    from engine.models.loader import load_tokenizer, resolve_model
    tok = load_tokenizer(resolve_model("default"))
    r = post(server, "/tokenize",
             {"model": server.model, "prompt": "The capital of France", "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("The capital of France", add_special_tokens=False)
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 512
    back = post(server, "/detokenize", {"model": server.model, "tokens": r.json()["tokens"]})
    assert back.json() == {"prompt": "The capital of France"}
    assert post(server, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(server, "/tokenize", {"model": "gpt-17", "prompt": "x"}).status_code == 404


def test_continue_final_message_leaves_the_assistant_turn_open(server, client):
    convo = ASK + [{"role": "assistant", "content": '{"name": "Tom'}]
    opened = post(server, "/tokenize", {"messages": convo, "continue_final_message": True,
                                        "add_generation_prompt": False}).json()["tokens"]
    closed = post(server, "/tokenize", {"messages": ASK}).json()["tokens"]
    from engine.models.loader import load_tokenizer, resolve_model
    text = load_tokenizer(resolve_model("default")).decode(opened)
    assert text.endswith('{"name": "Tom') and opened[:len(closed)] == closed
    r = client.chat.completions.create(model=server.model, messages=convo, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.completion_tokens >= 1


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.mark.parametrize("question", ["What is the weather in Paris right now?", "Say hello in JSON."])
def test_tools_with_a_response_format_under_auto_give_calls_or_the_format(server, client, question):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": question}],
                                       tools=TOOLS, response_format=FORMAT, max_tokens=64, temperature=0,
                                       parallel_tool_calls=False)
    message = r.choices[0].message
    if message.tool_calls:
        assert not message.content and r.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    else:
        jsonschema.validate(json.loads(message.content), ANSWER)


def test_a_required_tool_call_with_a_response_format_is_calls(server, client):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, tool_choice="required", response_format=FORMAT, max_tokens=48,
                                       temperature=0)
    assert r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), WEATHER)


def test_tools_under_auto_with_a_regex_guide_is_a_400(server, client):
    with pytest.raises(openai.BadRequestError, match="only with a JSON response format"):
        client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, max_tokens=2,
                                       extra_body={"guided_regex": "[a-z]+"})


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(server, client):
    system = {"role": "system", "content": "You answer questions about the weather in one short sentence. " * 8}
    ask = [system, {"role": "user", "content": "Is it cold in Oslo in January?"}]
    first = client.chat.completions.create(model=server.model, messages=ask, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=server.model, messages=ask, max_tokens=4, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0          # whole pages, one token computed
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "specdec_prefix_cache_hits_total" in metrics
    reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200 and reset.json()["reset_pages"] >= cached // 16
    cold = client.chat.completions.create(model=server.model, messages=ask, max_tokens=4, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == first.choices[0].message.content


def test_guided_backend_is_honoured_and_a_bad_one_is_a_400(server, client):
    schema = {"type": "object",
              "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"type": "integer", "maximum": 9}},
              "required": ["a"], "dependentRequired": {"b": ["a"]}, "not": {"required": ["b"]}}
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=24, temperature=0,
                                       extra_body={"guided_json": schema, "guided_backend": "auto"})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2,
                                       extra_body={"guided_json": CAT, "guided_backend": "outlines"})
    assert err.value.response.json()["error"]["param"] == "guided_backend"
    assert "outlines" in err.value.response.json()["error"]["message"]
