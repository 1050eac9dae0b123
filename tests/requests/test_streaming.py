"""Streams and request handles: each sees only its own outputs and none are lost, a stop string is never
streamed, closing a stream aborts its request, and finished requests are not kept."""
import random

import pytest

from conftest import assert_no_leak
from engine.requests.sequence import SamplingParams

GREEDY = dict(temperature=0.0)


def _drain(engine):
    while engine.has_unfinished():
        engine.step()


@pytest.fixture(scope="module")
def finals(engine, chat_prompts):
    """Each prompt's greedy result run to the end with generate (the reference for the streams)."""
    return engine.generate(chat_prompts, SamplingParams(max_tokens=24, **GREEDY))


def test_concurrent_streams_each_get_exactly_their_own_outputs(engine, chat_prompts, finals):
    params = SamplingParams(max_tokens=24, **GREEDY)
    streams = [engine.stream(p, params) for p in chat_prompts]
    texts, tokens, ends = [""] * len(streams), [[] for _ in streams], [None] * len(streams)
    order = random.Random(0)
    live = list(range(len(streams)))
    while live:                                   # advance the streams in a random interleaving
        i = order.choice(live)
        out = next(streams[i], None)
        if out is None:
            live.remove(i)
            continue
        texts[i] += out.new_text
        tokens[i] += out.new_token_ids
        if out.finished:
            ends[i] = out
    for i, seq in enumerate(finals):
        assert tokens[i] == seq.output_token_ids and texts[i] == seq.text
        assert ends[i].finish_reason == seq.finish_reason
        assert list(ends[i].token_ids) == seq.output_token_ids and ends[i].text == seq.text
    _drain(engine)
    assert engine.num_live_requests() == 0 and not engine._finished and not engine._listeners
    assert_no_leak(engine)


def test_streamed_stop_string_never_leaks(engine, chat_prompts, finals):
    """The stop string is cut from the final text, and no streamed piece ever held any part of it."""
    free = finals[0].text                                  # "The capital of France is Paris..." for SmolLM2
    words = free.split()
    stop = " ".join(words[1:3])                            # several tokens long, starting after the first word
    pieces = [o.new_text for o in engine.stream(chat_prompts[0], SamplingParams(max_tokens=24, stop=[stop],
                                                                                 **GREEDY))]
    text = "".join(pieces)
    assert text == free[:free.index(stop)], (pieces, stop)
    assert all(stop[:2] not in p for p in pieces[-3:]) and stop not in text
    _drain(engine)
    assert_no_leak(engine)


def test_closing_a_stream_early_aborts_its_request(engine, chat_prompts):
    other = engine.open(chat_prompts[1], SamplingParams(max_tokens=12, **GREEDY))
    stream = engine.stream(chat_prompts[0], SamplingParams(max_tokens=64, ignore_eos=True, **GREEDY))
    first = next(stream)
    assert engine.num_live_requests() == 2
    stream.close()                                          # leaving a for loop early does the same
    assert first.request_id not in engine._seqs, "a closed stream's request must be aborted and forgotten"
    outs = list(other)                                      # the other request is unaffected
    assert outs[-1].finished and outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 12
    _drain(engine)
    assert engine.num_live_requests() == 0 and not engine._listeners
    assert_no_leak(engine)


def test_abort_ends_the_request_with_a_final_output_and_forgets_it(engine, chat_prompts):
    handle = engine.open(chat_prompts[0], SamplingParams(max_tokens=64, ignore_eos=True, **GREEDY))
    next(handle)
    assert engine.abort(handle.request_id)
    assert not engine.abort(handle.request_id), "a second abort finds nothing"
    rest = list(handle)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert handle.request_id not in engine._seqs and handle.request_id not in engine._finished
    _drain(engine)
    assert_no_leak(engine)


def test_outputs_are_copies(engine, chat_prompts):
    handle = engine.open(chat_prompts[0], SamplingParams(max_tokens=8, **GREEDY))
    outs = list(handle)
    assert all(isinstance(o.new_token_ids, tuple) for o in outs)
    final = outs[-1]
    assert isinstance(final.token_ids, tuple) and list(final.token_ids) == [t for o in outs for t in o.new_token_ids]
    _drain(engine)


def test_retained_requests_are_kept_until_taken(engine, chat_prompts):
    kept = engine.add_request(chat_prompts[4], SamplingParams(max_tokens=4, **GREEDY), retain=True)
    dropped = engine.add_request(chat_prompts[4], SamplingParams(max_tokens=4, **GREEDY))
    _drain(engine)
    assert kept in engine._finished and dropped not in engine._finished
    assert len(engine.take(kept).output_token_ids) == 4
    with pytest.raises(KeyError):
        engine.take(dropped)
    assert_no_leak(engine)


def test_many_streams_with_early_closes_lose_nothing(engine, chat_prompts, finals):
    """16 streams over 8 rows (so some queue), advanced in a random order; three are closed part-way."""
    params = SamplingParams(max_tokens=24, **GREEDY)
    n, closers = 16, {3: 2, 7: 5, 12: 1}                   # stream index -> close after this many outputs
    streams = [engine.stream(chat_prompts[i % 5], params) for i in range(n)]
    got, live, order = [[] for _ in range(n)], list(range(n)), random.Random(1)
    while live:
        i = order.choice(live)
        if len(got[i]) == closers.get(i, -1):
            streams[i].close()
            live.remove(i)
            continue
        out = next(streams[i], None)
        if out is None:
            live.remove(i)
            continue
        got[i].append(out)
    for i in range(n):
        if i in closers:
            assert len(got[i]) == closers[i] and not got[i][-1].finished
            continue
        ref = finals[i % 5]
        assert [t for o in got[i] for t in o.new_token_ids] == ref.output_token_ids
        assert "".join(o.new_text for o in got[i]) == ref.text and got[i][-1].finish_reason == ref.finish_reason
    _drain(engine)
    assert engine.num_live_requests() == 0 and not engine._listeners
    assert_no_leak(engine)
