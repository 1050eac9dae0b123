"""Logprobs over real HTTP with the official openai client (CPU): Chat Completions (`logprobs` / `top_logprobs`,
whole and streamed), Completions (`logprobs: N`), both server modes (the engine process sends them over its IPC
frames; --single-process hands them over in memory); each entry equals the engine's own."""
import openai
import pytest

from engine.requests.sequence import SamplingParams
from engine.server.openai.logprobs import token_table
from serving import CPU_ARGS, serve

ASK = [{"role": "user", "content": "Name three colours."}]
CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name", "age"]}


@pytest.fixture(scope="module", params=["split", "single-process"])
def server(request):
    extra = ("--single-process",) if request.param == "single-process" else ()
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512", *extra) as s:
        yield s


@pytest.fixture(scope="module")
def table(engine):
    return token_table(engine.tokenizer)


def engine_entries(engine, prompt, n, max_tokens, **kw):
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=n, **kw))
    return seq


def same_chat(table, content, seq, n):
    assert len(content) == len(seq.output_token_ids)
    for item, token, (lp, top) in zip(content, seq.output_token_ids, seq.logprobs):
        assert item.token == table.text(token) and item.bytes == list(table.raw(token))
        assert item.logprob == pytest.approx(lp, abs=1e-3)
        assert len(item.top_logprobs) == len(top) <= n      # a grammar may allow fewer
        assert [t.token for t in item.top_logprobs] == [table.text(t) for t, _ in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-3)


def test_chat_logprobs_whole_and_streamed(server, client, engine, table):
    seq = engine_entries(engine, engine.apply_chat_template(ASK), 3, 8)
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    same_chat(table, r.choices[0].logprobs.content, seq, 3)
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=server.model, messages=ASK, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    same_chat(table, streamed, seq, 3)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_chat_without_logprobs_has_none_and_zero_top_lists_only_the_token(server, client):
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=3, temperature=0, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 3 and all(i.top_logprobs == [] for i in r.choices[0].logprobs.content)


def test_guided_chat_logprobs_cover_every_token(server, client, engine, table):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=2, response_format=fmt)
    seq = engine_entries(engine, engine.apply_chat_template(ASK), 2, 24, json_schema=CAT)
    same_chat(table, r.choices[0].logprobs.content, seq, 2)


@pytest.mark.parametrize("body,param", [(dict(top_logprobs=2), "top_logprobs"),
                                        (dict(logprobs=True, top_logprobs=21), "top_logprobs")])
def test_bad_chat_logprobs_are_a_400(server, client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2, **body)
    assert err.value.body["param"] == param


def test_completions_logprobs_whole_and_streamed(server, client, engine, table):
    prompt = "The capital of France is"
    ids = engine.encode(prompt)
    seq = engine_entries(engine, ids, 2, 6)
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [table.text(t) for t in seq.output_token_ids]
    assert lp.token_logprobs == pytest.approx([e[0] for e in seq.logprobs], abs=1e-3)
    assert [list(d) for d in lp.top_logprobs] == [[table.text(t) for t, _ in top] for _, top in seq.logprobs]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=2, logprobs=21)
