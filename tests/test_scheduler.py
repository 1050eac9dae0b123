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


class _Closer:
    """A guided row's closer as the scheduler sees it: hold() sits the row out on some steps, counted."""

    stepwise = False

    def __init__(self):
        self.calls, self.wake = 0, 0

    def hold(self, seq) -> bool:
        if len(seq.output_token_ids) < self.wake:       # Closer.hold: nothing to decide, nothing changed
            return False
        self.calls += 1
        self.wake = len(seq.output_token_ids) + (seq.seq_id + self.calls) % 4
        return (seq.seq_id + self.calls) % 3 == 0

    def closes_now(self, seq) -> bool:
        return False


def _world(seed: int, native: bool):
    """A pipelined run of one scheduler (depth 2: a step's rows land after the next step launched) over sequences
    that arrive, decode, finish, wait for their grammar, close and get preempted (few pages, prefix caching on).
    Returns every step's rows and every sequence's counters after each step."""
    import random
    from types import SimpleNamespace as NS
    rng = random.Random(seed)
    sched = Scheduler(BlockManager(30, 4, caching=True), max_num_seqs=12, max_num_batched_tokens=48)
    sched.native = native
    seqs, trace, inflight = [], [], []
    for step in range(120):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            seq = Sequence(len(seqs), [rng.randrange(1, 9) for _ in range(rng.randrange(1, 14))],
                           SamplingParams(max_tokens=rng.randrange(1, 30)), seed=0)
            kind = rng.random()
            if kind < 0.15:
                seq.guided = NS(ready=False)
            elif kind < 0.3:
                seq.closer = _Closer()
            seqs.append(seq)
            sched.add(seq)
        for seq in seqs:
            if seq.guided is not None and rng.random() < 0.3:
                seq.guided.ready = True
        rows = sched.schedule()
        for i, row in enumerate(rows):
            row.sample_idx = i
        sched.launched(rows)
        trace.append([(r.seq.seq_id, r.start, r.num_tokens, r.sample, r.epoch) for r in rows])
        inflight.append(rows)
        if len(inflight) > 1:
            for row in inflight.pop(0):
                if not sched.landed(row) or not row.sample:
                    continue
                row.seq.output_token_ids.append(rng.randrange(1, 9))
                if row.seq.num_tokens >= row.seq.max_len or rng.random() < 0.05:
                    sched.finish(row.seq, "stop")
        trace.append([(s.num_computed_tokens, s.num_pending, s.pending_src, s.inflight_refs, s.num_registered,
                       len(s.block_table), s.status, getattr(s.closer, "calls", 0)) for s in seqs])
    return trace, sched.num_preemptions


@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_the_native_walks_schedule_and_launch_as_the_python_ones(seed):
    """engine/requests/csrc/hostpath.cpp (runs of common decode rows) against the scheduler's Python, their
    definition: the same rows every step, and the same counters and closer calls after it."""
    native, preemptions = _world(seed, native=True)
    python, _ = _world(seed, native=False)
    assert preemptions > 0                      # the run exercises preemption
    for step, (got, want) in enumerate(zip(native, python)):
        assert got == want, step // 2
