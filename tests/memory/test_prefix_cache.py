"""Automatic prefix caching: full KV pages keyed by a digest of every token up to their end, shared and kept
after their request, evicted least recently freed first. Greedy outputs with caching equal outputs without."""
import hashlib
import random
from array import array

import pytest

from conftest import assert_no_leak
from engine.memory.block_manager import ROOT, BlockManager, prefix_digests
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CAT, CPU, drive

SYSTEM = ("You are a tool-calling assistant. Tools: get_weather(city, unit), search(query), "
          "book_table(restaurant, time, people). Answer with one tool call as JSON, nothing else. ") * 3
QUESTIONS = ["Weather in Paris?", "Find pizza near me.", "Book a table for two at eight.", "Weather in Oslo?"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


# ---- the page allocator -----------------------------------------------------------------------------------------
def test_digests_chain_over_the_whole_prefix():
    a = prefix_digests(list(range(12)), 4, ROOT)
    assert len(a) == 3 and len(set(a)) == 3
    assert prefix_digests(list(range(4, 12)), 4, a[0]) == a[1:]          # resumable from any page
    b = prefix_digests([99] + list(range(1, 12)), 4, ROOT)              # one token differs in page 0
    assert all(x != y for x, y in zip(a, b))                             # ... so every later page differs


def test_a_digest_is_blake2b_of_its_parent_and_its_pages_int64_tokens():
    """The definition, page by page with an array of int64 (prefix_digests packs each page with struct)."""
    rng = random.Random(0)
    tokens, parent, want = [rng.randrange(-3, 1 << 40) for _ in range(4 * 37 + 3)], ROOT, []
    for i in range(37):
        parent = hashlib.blake2b(parent, digest_size=16)
        parent.update(array("q", tokens[4 * i:4 * i + 4]).tobytes())
        parent = parent.digest()
        want.append(parent)
    assert prefix_digests(tokens, 4, ROOT) == want and prefix_digests(tokens[:3], 4, ROOT) == []


def _two_registered_pages():
    """A 4-page manager holding two registered pages: (the manager, their digests, the pages)."""
    bm = BlockManager(4, 4, caching=True)
    d = prefix_digests(list(range(8)), 4, ROOT)
    pages = bm.allocate(2)
    assert bm.register_pages(pages, d, 0, 2) == [0, 1]
    return bm, d, pages


def test_pages_are_shared_kept_and_evicted_oldest_first():
    bm, d, pages = _two_registered_pages()
    assert bm.match(d) == pages                     # a second holder
    bm.free(pages)
    bm.free(pages)                                  # nobody holds them: cached, and still allocatable
    assert bm.num_free == 4 and bm.num_cached == 2
    assert bm.match(d[:1]) == pages[:1]
    bm.free(pages[:1])                              # page 0 is now the most recently freed
    got = bm.allocate(3)                            # two free pages, then the oldest cached one (page 1)
    assert pages[1] in got and pages[0] not in got and bm.evictions == 1
    assert bm.match(d) == [pages[0]]                # page 1's digest is gone; page 0 still matches
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(got + [pages[0]] + [pages[0]])


def test_reset_forgets_cached_pages_but_not_held_ones():
    bm, d, pages = _two_registered_pages()
    bm.free(pages[1:])
    assert bm.reset_cache() == 2 and bm.num_cached == 0 and bm.match(d) == []
    bm.free(pages[:1])
    assert bm.num_free == 4 and sorted(bm.allocate(4)) == [0, 1, 2, 3]


def test_a_freed_table_gives_up_its_last_pages_first():
    """A cached prefix is usable only from its first page: a freed table's tail is evicted before its head, so an
    allocation that evicts leaves the head of the prefix mapped."""
    bm = BlockManager(3, 4, caching=True)
    d = prefix_digests(list(range(8)), 4, ROOT)
    pages = bm.allocate(2)
    bm.register_pages(pages, d, 0, 2)
    bm.free(pages)
    got = bm.allocate(2)                            # the one free page, then the table's last page
    assert pages[1] in got and pages[0] not in got
    assert bm.match(d) == pages[:1]


def test_take_page_is_allocate_of_one_or_none():
    """A decode row's next page (the scheduler's native walk): a free page, else the oldest cached one, else None;
    the page it gives is held once, as allocate's."""
    bm, d, pages = _two_registered_pages()
    spare = [bm.take_page(), bm.take_page()]
    assert not set(spare) & set(pages) and bm.num_free == 0 and bm.take_page() is None
    bm.free(pages)                                              # cached, the table's last page first
    assert bm.take_page() == pages[1] and bm.evictions == 1
    assert bm.take_page() == pages[0] and bm.take_page() is None and bm.evictions == 2
    bm.free(spare[:1])
    assert bm.take_page() == spare[0]
    bm.free(spare[:1])
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(spare[:1])


# ---- the engine ------------------------------------------------------------------------------------------------
def _engine(caching: bool, **cfg):
    return LLMEngine(**(CPU | dict(prefix_caching=caching, max_model_len=1024) | cfg))


def _prompts(eng):
    return [eng.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def _workload(eng):
    """A shared system prompt (two requests at once, two later), a repeated prompt, a prompt cut inside a page
    and a second turn that extends a first turn's prompt with its answer."""
    p = _prompts(eng)
    turn2 = p[0] + eng.encode("{\"name\": \"get_weather\"}") + eng.apply_chat_template(
        [{"role": "user", "content": "And in Rome?"}])
    return [(0, p[0], GREEDY), (0, p[1], GREEDY), (4, p[2], GREEDY), (4, p[0], GREEDY),
            (6, p[3][:len(p[3]) - 5], GREEDY), (8, turn2, GREEDY),
            (9, p[1], SamplingParams(max_tokens=16, temperature=0, json_schema=CAT))]


def _run(caching: bool, **cfg):
    eng = _engine(caching, **cfg)
    seqs = drive(eng, _workload(eng))
    assert_no_leak(eng)
    return eng, [s.output_token_ids for s in seqs], seqs


@pytest.fixture(scope="module")
def reference():
    return _run(False)[1]


@pytest.mark.parametrize("depth", [1, 2])
def test_cached_prefixes_give_the_tokens_of_full_prefills(reference, depth):
    eng, got, seqs = _run(True, depth=depth)
    assert got == reference
    stats = eng.prefix_cache_stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["prefix_cached_pages"] > 0
    assert (eng.timings.prefix_query_tokens, eng.timings.prefix_hit_tokens) == \
        (stats["prefix_query_tokens"], stats["prefix_hit_tokens"])
    assert eng.timings.prefix_query_tokens == sum(len(s.prompt_token_ids) for s in seqs)
    assert seqs[0].num_cached_tokens == 0 and seqs[3].num_cached_tokens >= len(seqs[0].prompt_token_ids) - 16
    # added with the first: it waits one step for the shared pages the first computes, instead of computing them
    assert seqs[1].num_cached_tokens > 0
    assert seqs[2].num_cached_tokens > 0 and seqs[4].num_cached_tokens > 0 and seqs[6].num_cached_tokens > 0
    assert seqs[5].num_cached_tokens >= len(seqs[0].prompt_token_ids) - 16       # the second turn reuses the first
    assert all(s.num_cached_tokens < len(s.prompt_token_ids) for s in seqs)     # one token is always computed


def test_requests_added_together_compute_their_shared_head_once(reference):
    """Four requests with one system prompt arrive at once: the first computes the shared pages, the others wait
    one step for them (instead of computing them in the same step) and the outputs stay those of full prefills."""
    eng = _engine(True)
    p = _prompts(eng)
    seqs = drive(eng, [(0, q, GREEDY) for q in p])
    assert [s.output_token_ids for s in seqs[:2]] == reference[:2]
    shared = len(eng.encode(SYSTEM)) // eng.blocks.block_size * eng.blocks.block_size
    assert seqs[0].num_cached_tokens == 0 and all(s.num_cached_tokens >= shared for s in seqs[1:])
    assert_no_leak(eng)


def test_a_burst_behind_one_head_waits_for_it_and_is_looked_up_a_batch_at_a_time():
    """200 requests with one 40-page head arrive at once: the first computes it (in chunks), the others wait for
    its pages instead of computing them too, and a step looks up at most a batch of them (each lookup digests
    the whole head)."""
    from engine.scheduler import Scheduler
    from engine.requests.sequence import Sequence
    sched = Scheduler(BlockManager(4096, 16, caching=True), max_num_seqs=8, max_num_batched_tokens=256)
    head = list(range(1, 641))
    seqs = [Sequence(i, head + [1000 + i], SamplingParams(max_tokens=2), seed=0, max_len=700) for i in range(200)]
    for seq in seqs:
        sched.add(seq)
    rows = sched.schedule()
    assert [r.seq.seq_id for r in rows] == [0] and rows[0].num_tokens == 256
    assert sum(bool(s.block_digests) for s in seqs) <= sched.max_num_seqs + 2
    sched.launched(rows)                             # its first 16 pages are registered
    rows = sched.schedule()
    assert [r.seq.seq_id for r in rows] == [0]       # the rest's next page is still being computed by it
    assert all(s.block_table == [] for s in seqs[1:])


def test_eviction_under_pressure_and_preemption(reference):
    """Few pages: requests preempt each other, cached pages are evicted to make room, and the outputs stay."""
    eng, got, _ = _run(True, num_kv_blocks=16, max_num_batched_tokens=64)
    assert got == reference
    assert eng.blocks.evictions > 0 and eng.scheduler.num_preemptions > 0


def test_abort_while_pages_are_shared(reference):
    eng = _engine(True)
    p = _prompts(eng)
    first = eng.add_request(p[0], GREEDY, retain=True)
    for _ in range(3):
        eng.step()
    second = eng.add_request(p[0], GREEDY, retain=True)
    eng.step()
    eng.abort(first)                                 # the second still reads the pages the first computed
    while eng.has_unfinished():
        eng.step()
    assert eng.take(second).output_token_ids == reference[0]
    assert_no_leak(eng)
    assert eng.reset_prefix_cache() > 0 and eng.blocks.num_cached == 0
    assert_no_leak(eng)


@pytest.mark.parametrize("drafter,k", [("ngram", 2), ("eagle", 1), ("draft_model", 2)])   # each drafter, each K
def test_speculation_after_a_cache_hit(reference, drafter, k):
    cfg = dict(speculative=drafter, num_speculative_tokens=k)
    if drafter == "draft_model":
        cfg["spec_draft_model"] = "default"
    eng, got, _ = _run(True, **cfg)
    assert got == reference
    assert eng.prefix_cache_stats()["prefix_hit_tokens"] > 0


def test_ngram_history_holds_the_cached_prompt():
    """The n-gram drafter searches the sequence's token history by position, which the steps of a cached
    prefix never wrote: the runner writes it before the sequence's first step, so drafts after a hit see the
    whole prompt, as after a full prefill."""
    eng = _engine(True, speculative="ngram", num_speculative_tokens=2)
    p = _prompts(eng)
    other = eng.encode("Count the sheep: one sheep, two sheep, three sheep. " * 20)
    assert len(other) > len(p[0])
    for prompt in (p[0], other):                        # fill the cache, then overwrite the pool row's history
        eng.generate([prompt], GREEDY)
    rid = eng.add_request(p[0], GREEDY, retain=True)
    eng.step()
    seq = eng._seqs[rid]
    assert seq.num_cached_tokens >= len(p[0]) - 16
    history = eng.runner.pool.history[seq.pool_row, :len(p[0])].tolist()
    assert history == p[0]
    while eng.has_unfinished():
        eng.step()
    assert_no_leak(eng)


def test_penalized_and_biased_requests_take_the_cache_with_their_counts():
    """A request holding a penalty row that maps cached pages gets its row set to the cached prefix's counts
    (repetition marks the prompt) and its bias written before its first step: the tokens of a full prefill."""
    runs = []
    for caching in (False, True):
        eng = _engine(caching)
        p = _prompts(eng)[0]
        bias = {eng.encode(" the")[0]: -5.0}
        params = [GREEDY, SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3),
                  SamplingParams(max_tokens=10, temperature=0, logit_bias=bias), GREEDY]
        runs.append([eng.generate([p], sp)[0] for sp in params])
        assert_no_leak(eng)
    off, on = runs
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    assert [s.num_cached_tokens > 0 for s in on] == [False, True, True, True]


def test_penalized_requests_preempted_with_outputs_in_their_cached_prefix():
    """Preempted, a penalized request recomputes from the cache: its cached prefix holds output tokens, which
    its row counts again (frequency penalty), so it still samples as without the cache."""
    params = SamplingParams(max_tokens=60, temperature=0, frequency_penalty=0.5, repetition_penalty=1.1)
    runs, counted = [], []
    for caching in (False, True):
        eng = _engine(caching, num_kv_blocks=10, max_num_batched_tokens=64)
        write_span = eng.runner.penalties.write_span        # (recording what the real one writes)
        eng.runner.penalties.write_span = lambda w: (counted.extend(len(out) for _, _, out in w), write_span(w))
        prompts = [eng.encode(f"Count slowly from {i} upward, one number per line:") for i in range(4)]
        seqs = drive(eng, [(0, p, params) for p in prompts])
        runs.append([s.output_token_ids for s in seqs])
        assert_no_leak(eng)
    assert runs[1] == runs[0]
    assert max(counted) > 0                 # a recompute mapped pages holding its own output tokens


@pytest.mark.parametrize("drafter", ["eagle", "draft_model"])
def test_drafts_after_a_hit_accept_as_after_a_full_prefill(drafter):
    """The head's and the draft model's KV live in the target's pages, so cached pages carry theirs too: the same
    requests one after another accept the same drafts with and without the cache."""
    runs = []
    for caching in (False, True):
        cfg = dict(speculative=drafter, num_speculative_tokens=3)
        if drafter == "draft_model":
            cfg["spec_draft_model"] = "default"
        eng = _engine(caching, **cfg)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        runs.append([eng.generate([p], params)[0] for p in _prompts(eng)[:3]])
    off, on = runs
    assert [s.num_cached_tokens > 0 for s in on] == [False, True, True]
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    assert [s.spec.as_dict() for s in on] == [s.spec.as_dict() for s in off]


def test_output_pages_are_registered_when_their_request_ends():
    """A running sequence registers its prompt's full pages as their steps launch and its outputs' pages as it
    gives its pages back (no other prompt holds its outputs while it runs). A second turn that extends the
    first turn's prompt with its answer maps the answer's pages, and decodes as without the cache."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng = _engine(True)
    bs = eng.config.block_size
    p = _prompts(eng)[0]
    rid, running = eng.add_request(p, params, retain=True), 0
    while eng.has_unfinished():
        eng.step()
        seq = eng._seqs.get(rid)
        if seq is not None and not seq.finalized:
            assert seq.num_registered <= len(p) // bs
            running += 1
    first = eng.take(rid)
    assert running >= 30
    assert eng.prefix_cache_stats()["prefix_cached_pages"] >= (len(p) + len(first.output_token_ids) - 1) // bs
    turn2 = p + first.output_token_ids + eng.encode(" And in Rome?")
    got = eng.generate([turn2], GREEDY)[0]
    assert got.num_cached_tokens > len(p) // bs * bs            # past the prompt: the answer's pages
    assert got.output_token_ids == _engine(False).generate([turn2], GREEDY)[0].output_token_ids
    assert_no_leak(eng)
