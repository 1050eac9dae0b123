"""A bad request fails alone: clear errors at add_request, and an engine that survives an exception in plan,
launch or commit (the request it belongs to ends "error", its pages come back, everyone else goes on)."""
import pytest

from conftest import assert_no_leak
from engine.sampling.sampler import NO_TOKEN
from engine.requests.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _forged(**fields) -> SamplingParams:
    """Params that slipped past validation (as a future field or a bug might): the engine must still cope."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.fixture(scope="module")
def alone(engine, chat_prompts):
    """Greedy tokens of prompts 0 and 1, each run alone."""
    return [engine.generate([p], GREEDY)[0].output_token_ids for p in chat_prompts[:2]]


def _run(engine, requests):
    """Add (prompt, params) pairs together, run to the end; {id: final RequestOutput} and the ids in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
    return ids, finals


@pytest.mark.parametrize("fields,match", [
    (dict(seed=2 ** 64), "seed"), (dict(seed=-2 ** 64), "seed"), (dict(top_k=2 ** 63), "top_k"),
    (dict(stop=[1]), "stop"), (dict(stop=["ok", None]), "stop"), (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature="0.5"), "temperature"),
    (dict(top_p=float("inf")), "top_p"), (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(max_tokens=2 ** 40), "max_tokens"), (dict(stop_token_ids=[-1]), "stop token"),
    (dict(stop_token_ids="3"), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params_raise_value_error_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_bad_requests_raise_at_add_request_and_leave_nothing(engine, chat_prompts):
    live = engine.num_live_requests()
    cases = [((chat_prompts[0], "greedy"), "SamplingParams"), ((None, GREEDY), "prompt"),
             (([1, "2"], GREEDY), "integers"), (([1, True], GREEDY), "integers"),
             ((chat_prompts[0], SamplingParams(stop_token_ids=[engine.runner.vocab])), "stop_token_ids")]
    for (prompt, params), match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate(chat_prompts[:2], [GREEDY])
    with pytest.raises(ValueError, match="out of range"):        # all or nothing: the first is not left running
        engine.generate([chat_prompts[0], [10 ** 9]], GREEDY)
    assert engine.num_live_requests() == live and not engine._finished
    assert_no_leak(engine)


@pytest.mark.parametrize("fields", [dict(seed=2 ** 64), dict(top_k=2 ** 63)])
def test_a_request_that_slipped_past_validation_fails_alone(engine, chat_prompts, alone, fields):
    """Before validation caught these, their OverflowError while the slot was filled stopped every request."""
    ids, finals = _run(engine, [(chat_prompts[0], GREEDY), (chat_prompts[1], _forged(**fields))])
    good, bad = finals[ids[0]], finals[ids[1]]
    assert good.finish_reason == "length" and list(good.token_ids) == alone[0]
    assert bad.finish_reason == "error" and "prepare" in bad.error and "OverflowError" in bad.error, bad
    assert engine.num_live_requests() == 0
    assert_no_leak(engine)


def test_an_exception_at_commit_fails_that_request_alone(engine, chat_prompts, alone, monkeypatch):
    """Whichever way a row commits in Python (the common row's short path or the general one), its failure fails
    it alone."""
    victim = {}
    monkeypatch.setattr(engine.commits, "native", False)

    def failing(real):
        def commit(seq, tokens):
            if seq.seq_id == victim.get("id") and len(seq.output_token_ids) == 4:
                raise TypeError("injected commit failure")
            return real(seq, tokens)
        return commit

    for name in ("commit", "commit_plain"):
        monkeypatch.setattr(engine.output, name, failing(getattr(engine.output, name)))
    good = engine.add_request(chat_prompts[0], GREEDY)
    victim["id"] = engine.add_request(chat_prompts[1], GREEDY)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    bad = finals[victim["id"]]
    assert bad.finish_reason == "error" and "injected commit failure" in bad.error
    assert list(bad.token_ids) == alone[1][:4]
    assert list(finals[good].token_ids) == alone[0]
    assert_no_leak(engine)


class _Unreadable:
    """An output state every read of which raises."""

    def __getattr__(self, name):
        raise TypeError("injected commit failure")


def test_a_row_the_native_commit_cannot_read_fails_alone(engine, chat_prompts, alone):
    """The native commit stops before a row it cannot read; the Python loop then fails that request alone."""
    assert engine.commits.native
    good = engine.add_request(chat_prompts[0], GREEDY)
    bad_id = engine.add_request(chat_prompts[1], GREEDY)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        seq = engine._seqs.get(bad_id)
        if seq is not None and len(seq.output_token_ids) == 4 and not isinstance(seq.out, _Unreadable):
            seq.out = _Unreadable()
    bad = finals[bad_id]
    assert bad.finish_reason == "error" and "injected commit failure" in bad.error
    assert list(bad.token_ids) == alone[1][:4]
    assert list(finals[good].token_ids) == alone[0]
    assert_no_leak(engine)


def test_an_exception_at_launch_fails_that_steps_requests_and_the_loop_goes_on(engine, chat_prompts, alone,
                                                                               monkeypatch):
    launch, calls = engine.runner.launch, []

    def flaky(slot, step_index, all_greedy, snapshot=None):
        calls.append(step_index)
        if len(calls) == 3:
            raise RuntimeError("injected launch failure")
        return launch(slot, step_index, all_greedy, snapshot)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    ids, finals = _run(engine, [(chat_prompts[0], GREEDY), (chat_prompts[1], GREEDY)])
    assert {finals[i].finish_reason for i in ids} == {"error"}
    assert all("injected launch failure" in finals[i].error for i in ids)
    assert_no_leak(engine)
    assert all(s.inflight_refs == 0 for s in engine.scheduler.running)
    later = engine.generate([chat_prompts[1]], GREEDY)[0]          # the engine still serves
    assert later.output_token_ids == alone[1]
    assert_no_leak(engine)


def test_a_scheduler_exception_fails_its_requests_and_frees_their_pages(engine, chat_prompts, alone, monkeypatch):
    schedule, calls = engine.scheduler.schedule, []

    def broken():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected scheduler bug")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    ids, finals = _run(engine, [(chat_prompts[0], GREEDY), (chat_prompts[1], GREEDY)])
    assert all(finals[i].finish_reason == "error" and "injected" in finals[i].error for i in ids)
    assert_no_leak(engine)
    monkeypatch.undo()
    assert engine.generate([chat_prompts[0]], GREEDY)[0].output_token_ids == alone[0]


def test_a_row_whose_mask_allowed_nothing_fails_alone(engine, chat_prompts, alone, monkeypatch):
    """The sampler marks such a row NO_TOKEN (tests/sampling/test_sampler.py); the commit fails that request only, and
    the carry-over feeds the next step a valid id meanwhile."""
    sample, victim = engine.runner.program.sample, {}

    def poisoned(slot, logits, rows, greedy, mask=None, *extras):
        sample(slot, logits, rows, greedy, mask, *extras)
        for row in slot.rows:
            seq = row.seq                        # tokens before this one: committed + in flight (this row's too)
            if row.sample and seq.seq_id == victim.get("id") and len(seq.output_token_ids) + seq.num_pending > 3:
                slot.sampled[row.sample_idx] = NO_TOKEN

    monkeypatch.setattr(engine.runner.program, "sample", poisoned)
    good = engine.add_request(chat_prompts[0], GREEDY)
    victim["id"] = engine.add_request(chat_prompts[1], GREEDY)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[victim["id"]].finish_reason == "error" and "mask" in finals[victim["id"]].error
    assert len(finals[victim["id"]].token_ids) == 3
    assert list(finals[good].token_ids) == alone[0]
    assert_no_leak(engine)
