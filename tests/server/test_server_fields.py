"""Every field of the OpenAI and vLLM protocols is honoured or refused (CPU, real HTTP, the openai client): vLLM's
sampling fields change the output as they say, those the server cannot honour get a 400 naming them, unknown fields
are ignored with a `specdec-warning` header saying so, and requests that cannot work are refused up front."""
import json

import httpx
import openai
import pytest

from serving import CPU_ARGS, serve

ASK = [{"role": "user", "content": "Name three colours."}]
WARNING = "specdec-warning"


@pytest.fixture(scope="module")
def server():
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512") as s:
        yield s


def chat(client, server, max_tokens: int = 12, **extra):
    """The raw response of a greedy chat request with `extra` fields (vLLM's go in the body as they are)."""
    return client.chat.completions.with_raw_response.create(model=server.model, messages=ASK, max_tokens=max_tokens,
                                                            temperature=0, extra_body=extra)


def text_of(raw) -> str:
    return raw.parse().choices[0].message.content


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": server.model} | body, timeout=120)


@pytest.fixture(scope="module")
def free(client, server) -> str:
    return text_of(chat(client, server, 24))


def test_an_unknown_field_is_ignored_and_the_response_says_so(client, server, free):
    raw = chat(client, server, 24, frobnicate=1, zeta={"a": 1})
    assert text_of(raw) == free
    assert raw.headers[WARNING] == "ignored unknown fields: frobnicate, zeta"
    plain = chat(client, server, 24, user="u1", metadata={"k": "v"}, use_beam_search=False, priority=0)
    assert text_of(plain) == free and WARNING not in plain.headers, "defaults and no-ops are honoured silently"
    r = post(server, "/v1/completions", {"prompt": "Colours:", "max_tokens": 4, "frobnicate": True})
    assert r.status_code == 200 and r.headers[WARNING] == "ignored unknown fields: frobnicate"


REFUSED = [("use_beam_search", True), ("length_penalty", 0.5), ("skip_special_tokens", False),
           ("allowed_token_ids", [1, 2]), ("logits_processors", ["x.y"]), ("priority", 1), ("chat_template", "{{x}}"),
           ("cache_salt", "s"), ("store", True), ("modalities", ["text", "audio"]), ("functions", [{"name": "f"}]),
           ("reasoning_effort", "high"), ("echo", True), ("best_of", 3)]


@pytest.mark.parametrize("field, value", REFUSED, ids=[f for f, _ in REFUSED])
def test_a_field_the_server_cannot_honour_is_refused_naming_it(client, server, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, server, **{field: value})
    assert info.value.body["param"] == field and field in info.value.body["message"], info.value.body


def test_top_k_minus_one_is_off(client, server):
    sampled = [text_of(chat(client, server, 16, temperature=1.0, seed=7, **k)) for k in ({}, {"top_k": -1},
                                                                                         {"top_k": 0})]
    assert sampled[0] == sampled[1] == sampled[2]


def test_stop_strings_and_ids_and_whether_the_stop_string_stays(client, server, free):
    word = free.split()[2]
    cut = text_of(chat(client, server, 24, stop=[word]))
    kept = text_of(chat(client, server, 24, stop=[word], include_stop_str_in_output=True))
    assert cut == free[:free.index(word)] and kept == free[:free.index(word) + len(word)], (cut, kept)
    r = post(server, "/v1/completions", {"prompt": "Colours: red, green,", "max_tokens": 16, "temperature": 0})
    ids = r.json()
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": ids["choices"][0]["text"],
                                                     "add_special_tokens": False}).json()["tokens"]
    stopped = post(server, "/v1/completions", {"prompt": "Colours: red, green,", "max_tokens": 16, "temperature": 0,
                                               "stop_token_ids": [tok[3]]}).json()
    assert stopped["usage"]["completion_tokens"] <= 4 and stopped["choices"][0]["finish_reason"] == "stop", stopped


def test_bad_words_are_never_generated(client, server, free):
    word = free.split()[1].strip(".,:")                 # "Red" from "1. Red: ..."
    other = text_of(chat(client, server, 24, bad_words=[word]))
    assert word not in other and other != free, other
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, server, bad_words=["xylophonically"])
    assert info.value.body["param"] == "bad_words" and "tokens" in info.value.body["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, server):
    long = post(server, "/v1/completions", {"prompt": "one two three four five six seven eight", "max_tokens": 4,
                                            "temperature": 0, "truncate_prompt_tokens": 3}).json()
    short = post(server, "/v1/completions", {"prompt": " six seven eight", "max_tokens": 4, "temperature": 0}).json()
    assert long["usage"]["prompt_tokens"] == 3 == short["usage"]["prompt_tokens"]
    assert long["choices"][0]["text"] == short["choices"][0]["text"]


def test_prompt_logprobs_score_each_prompt_token(server):
    body = post(server, "/v1/completions", {"prompt": "The capital of France is Paris", "max_tokens": 2,
                                            "temperature": 0, "prompt_logprobs": 2}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == body["usage"]["prompt_tokens"]
    of = scored[2]                           # " of" after "The capital": the model's first choice
    token, entry = next((t, e) for t, e in of.items() if e["decoded_token"] == " of")
    assert entry["rank"] == 1 and len(of) == 2 and all(e["logprob"] <= 0 for e in of.values())
    chat_body = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(chat_body["prompt_logprobs"]) == chat_body["usage"]["prompt_tokens"]
    assert chat_body["choices"][0]["logprobs"] is None
    streamed = post(server, "/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_request_id_names_the_response(client, server):
    assert chat(client, server, 2, request_id="abc-1").parse().id == "chatcmpl-abc-1"


def test_a_capped_max_tokens_is_reported(client, server):
    raw = chat(client, server, 10 ** 9, stop=["."])         # the first "." ends it: no need to fill the context
    assert raw.parse().usage.completion_tokens > 0
    assert "max_tokens 1000000000 is more than the" in raw.headers[WARNING], raw.headers.get(WARNING)


def test_guided_decoding_backend_is_vllms_name_for_the_backend(client, server):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    out = text_of(chat(client, server, 24, guided_json=schema, guided_decoding_backend="guidance"))
    assert json.loads(out)["colour"] in ("red", "green")
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, server, guided_json=schema, guided_decoding_backend="outlines")
    assert info.value.body["param"] == "guided_decoding_backend"


BAD = [  # (what, body fields, param, words of the message)
    ("a NaN temperature", b'"temperature": NaN', "temperature", "finite number"),
    ("a tool whose parameters are a string",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "type 'object'"),
    ("a tool message answering no call",
     {"messages": ASK + [{"role": "tool", "tool_call_id": "call_1", "content": "42"}]}, "messages[1].role",
     "must answer a tool call"),
    ("a tool message answering another call",
     {"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "call_2", "content": "42"}]},
     "messages[2].tool_call_id", "answers no tool call"),
    ("a minLength past the context",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
         "type": "object", "properties": {"a": {"type": "string", "minLength": 10 ** 6}}, "required": ["a"]}}}},
     "response_format", "cannot fit the context"),
    ("a minItems past the context",
     {"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 10 ** 6}}, "response_format",
     "cannot fit the context"),
    ("a forced tool call past the context",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"a": {"type": "array", "minItems": 10 ** 6}}, "required": ["a"]}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "cannot fit the context"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_request_that_cannot_work_is_refused_naming_the_problem(server, case):
    _, fields, param, words = case
    if isinstance(fields, bytes):
        content = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], %s}' % (server.model.encode(),
                                                                                           fields)
        r = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
    else:
        r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4} | fields)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


PERSON = {"type": "object", "properties": {"first_name": {"type": "string"}, "last_name": {"type": "string"}},
          "required": ["first_name", "last_name"]}


def person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_a_guided_output_closes_before_its_budget_and_says_so(client, server):
    """A structured output at a budget the model overruns: it ends valid with finish_reason "stop" and
    `closed_by`; with close_at_budget false it is cut. A budget no output fits is a 400 naming the minimum."""
    ask = [{"role": "user", "content": "Describe a person at great length, with a long biography in first_name."}]
    closed = client.chat.completions.create(model=server.model, messages=ask, max_tokens=14, temperature=0,
                                            response_format=person_format())
    choice = closed.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra.get("closed_by") == "budget", choice
    assert set(json.loads(choice.message.content)) == {"first_name", "last_name"}
    assert closed.usage.completion_tokens <= 14
    cut = client.chat.completions.create(model=server.model, messages=ask, max_tokens=14, temperature=0,
                                         response_format=person_format(), extra_body={"close_at_budget": False})
    assert cut.choices[0].finish_reason == "length" and "closed_by" not in cut.choices[0].model_extra
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=ask, max_tokens=3, temperature=0,
                                       response_format=person_format())
    assert "max_tokens=3" in str(info.value) and "the shortest takes" in str(info.value)
    assert info.value.body["param"] == "max_tokens"
