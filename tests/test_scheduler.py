"""Scheduler and block manager in isolation (no model)."""
import pytest

from engine.memory.block_manager import BlockManager
from engine.requests.sequence import SamplingParams, Sequence, Status
from engine.scheduler import Scheduler


def _seq(i, n):
    return Sequence(i, list(range(1, n + 1)), SamplingParams(max_tokens=8), seed=0)


def _run_step(sched, rows):
    for r in rows:                               # pretend the step ran and sampled token 7
        r.seq.num_computed_tokens = r.start + r.num_tokens
        if r.sample:
            r.seq.output_token_ids.append(7)


def test_chunked_prefill_respects_budget_and_resumes():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    a, b = _seq(0, 25), _seq(1, 3)
    sched.add(a); sched.add(b)
    rows = sched.schedule()
    assert [(r.seq.seq_id, r.start, r.num_tokens, r.sample) for r in rows] == [(0, 0, 10, False)]
    _run_step(sched, rows)
    rows = sched.schedule()
    assert [(r.seq.seq_id, r.start, r.num_tokens) for r in rows] == [(0, 10, 10)]
    _run_step(sched, rows)
    rows = sched.schedule()
    assert [(r.seq.seq_id, r.start, r.num_tokens, r.sample) for r in rows] == [(0, 20, 5, True), (1, 0, 3, True)]
    _run_step(sched, rows)
    rows = sched.schedule()
    assert [(r.seq.seq_id, r.num_tokens) for r in rows] == [(0, 1), (1, 1)]


def test_preempts_latest_and_requeues_first():
    blocks = BlockManager(2, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(0, 4), _seq(1, 4)
    sched.add(a); sched.add(b)
    rows = sched.schedule()
    _run_step(sched, rows)                      # a and b each hold one full page, none free
    rows = sched.schedule()                     # both need a new page: b is preempted for a
    assert [r.seq.seq_id for r in rows] == [0]
    assert b.status is Status.WAITING and sched.waiting[0] is b and b.num_computed_tokens == 0
    assert blocks.num_free == 0 and len(a.block_table) == 2


def test_finish_defers_free_while_in_flight():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, 4, 64)
    a = _seq(0, 5)
    sched.add(a)
    sched.schedule()
    a.inflight_refs = 1
    sched.finish(a, "stop")
    assert blocks.num_free == 6 and a.finalized
    a.inflight_refs = 0
    sched.release_if_idle(a)
    assert blocks.num_free == 8


def test_block_manager_errors():
    bm = BlockManager(2, 4)
    got = bm.allocate(2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(1)
    bm.free(got)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(got[:1])
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_pending_token_is_scheduled_and_capped_sequence_is_not():
    """Pipelined planning: a token sampled on the device but not committed counts as the next input."""
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=2), seed=0)
    b = Sequence(1, [1, 2, 3, 4], SamplingParams(max_tokens=5), seed=0)
    sched.add(a); sched.add(b)
    for r in sched.schedule():                  # prefill launched: each now has one token in flight
        r.seq.num_computed_tokens, r.seq.num_pending = r.start + r.num_tokens, 1
    rows = sched.schedule()
    assert [(r.seq.seq_id, r.start, r.num_tokens, r.sample) for r in rows] == [(0, 3, 1, True), (1, 4, 1, True)]
    for r in rows:
        r.seq.num_computed_tokens, r.seq.num_pending = r.start + 1, 2
    assert a.capped and not b.capped             # a's second (last) token is in flight
    assert [r.seq.seq_id for r in sched.schedule()] == [1]
