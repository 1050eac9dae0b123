"""Engine behaviour on the real default model: preemption, stops, seeds, bad input, no page leaks."""
import pytest

from conftest import assert_no_leak
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(engine, chat_prompts):
    return [s.output_token_ids for s in engine.generate(chat_prompts, GREEDY)]


def test_preemption_under_tiny_pool_keeps_greedy_outputs(chat_prompts, reference):
    # 9 pages of 16 tokens: enough for the longest request alone, far too few for all five together
    tiny = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=9,
                     max_num_seqs=8, max_num_batched_tokens=256)
    seqs = tiny.generate(chat_prompts, GREEDY)
    assert [s.output_token_ids for s in seqs] == reference
    assert tiny.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert_no_leak(tiny)


def test_seeded_sampling_reproducible_across_batching(engine, chat_prompts):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([chat_prompts[1]], params)[0].output_token_ids
    batched = engine.generate(chat_prompts, params)[1].output_token_ids
    again = engine.generate([chat_prompts[1]], params)[0].output_token_ids
    assert alone == batched == again
    other = engine.generate([chat_prompts[1]], SamplingParams(max_tokens=12, temperature=0.9, seed=99))
    assert other[0].output_token_ids != alone
    assert_no_leak(engine)


def test_stops_eos_stop_string_stop_token_and_length(engine, chat_prompts):
    free = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=64, temperature=0))[0]
    assert free.finish_reason == "stop" and free.output_token_ids[-1] in engine.eos_ids
    assert "<|im_end|>" not in free.text and free.text
    word = free.text.split()[2]
    cut = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=64, temperature=0, stop=[word]))[0]
    assert cut.finish_reason == "stop" and word not in cut.text and free.text.startswith(cut.text)
    tok = free.output_token_ids[3]
    by_id = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=64, temperature=0,
                                                              stop_token_ids=[tok]))[0]
    assert by_id.output_token_ids == free.output_token_ids[:free.output_token_ids.index(tok) + 1]
    short = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert short.finish_reason == "length" and len(short.output_token_ids) == 3
    assert_no_leak(engine)


def test_bad_input_is_rejected_and_others_unaffected(engine, chat_prompts, reference):
    good = engine.add_request(chat_prompts[0], GREEDY, retain=True)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request([1] * engine.max_model_len, GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 10**9], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(chat_prompts[0], SamplingParams(max_tokens=0))
    while engine.has_unfinished():
        engine.step()
    assert engine.take(good).output_token_ids == reference[0]
    assert_no_leak(engine)


def test_abort_frees_pages(engine, chat_prompts):
    a = engine.add_request(chat_prompts[0], GREEDY)
    engine.add_request(chat_prompts[1], SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    assert engine.abort(a)
    assert a not in engine._seqs, "an aborted request is forgotten"
    while engine.has_unfinished():
        engine.step()
    assert engine.num_live_requests() == 0 and not engine._finished
    assert_no_leak(engine)


@pytest.mark.parametrize("spec,match", [("/no/such/model", "does not exist"), ("dummy:llama-99b", "unknown dummy"),
                                        (__file__, "not a .gguf")])
def test_bad_model_path(spec, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(model=spec, device="cpu")


def test_bad_config():
    with pytest.raises(ValueError, match="depth"):
        LLMEngine(depth=3)
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine(block_size=12)


def test_dummy_model_runs_from_token_ids():
    dummy = LLMEngine(model="dummy:smollm2-135m", device="cpu", dtype="float32", max_model_len=256)
    [seq] = dummy.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(seq.output_token_ids) == 5
    with pytest.raises(ValueError, match="no tokenizer"):
        dummy.add_request("text needs a tokenizer")


def test_a_batch_written_natively_decodes_as_each_request_alone(engine, chat_prompts, monkeypatch):
    """Steps of 8 decode rows take rows.py's _fill_decode (one native call); each request's greedy tokens are
    those it gets alone, where every step is one row written by the row-by-row writer."""
    import helpers
    from engine.runner import rows
    prompts = chat_prompts + [engine.apply_chat_template([{"role": "user", "content": p}])
                              for p in helpers.EXTRA_PROMPTS]
    assert len(prompts) == engine.config.max_num_seqs
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    fill_decode = rows._fill_decode
    with monkeypatch.context() as m:
        m.setattr(rows, "_fill_decode", lambda slot, step_rows, bs, spec=False: rows._fill_rows(slot, step_rows, bs, 0))
        alone = [engine.generate([p], params)[0].output_token_ids for p in prompts]
    fast = []
    monkeypatch.setattr(rows, "_fill_decode", lambda slot, step_rows, bs, spec=False: fast.append(len(step_rows)) or
                        fill_decode(slot, step_rows, bs, spec))
    batched = [s.output_token_ids for s in engine.generate(prompts, params)]
    assert fast and max(fast) == len(prompts)
    assert batched == alone
    assert_no_leak(engine)
