"""The pipelined loop (depth=2) gives exactly the tokens of the blocking loop (depth=1).

The workload mixes every way a request can end (EOS, stop string, stop token, max_tokens), requests that
arrive while others run, a seeded sampled request, and a KV pool small enough to force preemption. On the
CPU each launch runs synchronously, but the host still plans step t+1 before it has seen step t's tokens:
carry-over, pending tokens, zombies and deferred page release all run for real.
"""
import math

import pytest
import torch

from conftest import assert_no_leak, prefill_logits
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import PREEMPTING, ROOMY, EagerGraphs, drive


def _run(depth, workload, graph_layout=False, **cfg):
    eng = LLMEngine(**(dict(device="cpu", dtype="float32", attention_backend="torch", depth=depth) | cfg))
    if graph_layout:
        eng.runner.graphs = EagerGraphs(eng.runner)
    refs_seen = []
    launch = eng.runner.launch

    def probe(slot, step_index, all_greedy, snapshot=None, **kw):   # refs peak: t+1 launched, t not committed
        refs_seen.extend(r.seq.inflight_refs for r in slot.rows)
        return launch(slot, step_index, all_greedy, snapshot, **kw)

    eng.runner.launch = probe
    seqs = drive(eng, workload)
    assert min(refs_seen) >= 1 and max(refs_seen) <= depth
    return eng, seqs


def _parted_at_near_ties(eng, workload, got, ref) -> dict:
    """{index: divergence} of the greedy sequences whose tokens part; each must part at a near-tie: the two
    tokens' logits (a one-shot prefill of the common prefix on `eng`) within 2 bf16 ulps, at any token (an H200
    run parted a sequence at its third token, 1 ulp apart). A sampled sequence must not part."""
    parted = {}
    for i, ((_, prompt, params), g, r) in enumerate(zip(workload, got, ref)):
        gi, ri = g.output_token_ids, r.output_token_ids
        j = next((j for j, (a, b) in enumerate(zip(gi, ri)) if a != b), None)
        if j is None:
            continue
        assert params.temperature == 0, f"sampled sequence {i} parted at token {j}"
        logits = prefill_logits(eng, list(prompt) + ri[:j])
        gap, top = float(logits[ri[j]] - logits[gi[j]]), float(logits[ri[j]])
        ulp = 2.0 ** (math.floor(math.log2(abs(top))) - 7)
        parted[i] = dict(index=j, gap=gap, ulp=ulp)
        assert abs(gap) <= 2 * ulp, (i, parted[i])
    return parted


GPU_BF16_GRAPHS = dict(device="cuda", dtype="bfloat16", attention_backend="triton", max_model_len=1024)


# the prompts share their chat template's head: with prefix caching the small pool rarely runs out, so the
# preempting cases turn it off to make sure preemption happens (tests/memory/test_prefix_cache.py has both at once)
UNCACHED = dict(PREEMPTING, prefix_caching=False)


@pytest.mark.parametrize("cfg", [ROOMY, UNCACHED, PREEMPTING, pytest.param(
    GPU_BF16_GRAPHS, marks=pytest.mark.gpu), pytest.param(GPU_BF16_GRAPHS | UNCACHED, marks=pytest.mark.gpu)],
    ids=["roomy", "preempting", "small-pool-cached", "gpu-bf16-graphs", "gpu-bf16-graphs-preempting"])
def test_pipelined_equals_blocking(workload, cfg):
    blocking, ref = _run(1, workload, **cfg)
    pipelined, got = _run(2, workload, **cfg)
    if cfg.get("dtype") == "bfloat16" and cfg.get("prefix_caching") is False:
        # preemption gives the two loops other step compositions, so a row's matmuls run at other row counts
        # (the decode GEMV up to 4 rows, cuBLAS past them) and bf16 rounds differently: a greedy sequence may part
        # at a near-tie, after which the workload's timing differs too. Every other sequence stays exact.
        parted = _parted_at_near_ties(blocking, workload, got, ref)
        assert len(parted) <= len(ref) // 4, parted
        got, ref = ([s for i, s in enumerate(seqs) if i not in parted] for seqs in (got, ref))
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in ref]
    assert [s.text for s in got] == [s.text for s in ref]
    reasons = [s.finish_reason for s in ref]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 3, reasons
    assert pipelined.timings.zombie_rows > 0, "EOS/stop requests should have ridden along one extra step"
    assert blocking.timings.zombie_rows == 0
    if cfg.get("prefix_caching") is False:
        preemptions = (blocking.scheduler.num_preemptions, pipelined.scheduler.num_preemptions)
        assert min(preemptions) > 0, preemptions
    for eng in (blocking, pipelined):
        assert_no_leak(eng)
        assert not eng._inflight


@pytest.mark.parametrize("cfg", [ROOMY, PREEMPTING], ids=["roomy", "preempting"])
def test_graph_padding_changes_no_token(workload, cfg):
    """Every step padded to its graph's shape (decode rows, mixed token/sequence buckets) gives the tokens of
    the unpadded blocking loop: padding writes no KV and no real row reads a padding one."""
    _, ref = _run(1, workload, **cfg)
    eng, got = _run(2, workload, graph_layout=True, **cfg)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref]
    assert {k for k, v in eng.runner.graphs.replays.items() if v} == {"decode", "mixed"}, eng.runner.graphs.replays
    assert 0 < eng.timings.replay < eng.timings.launch          # the replays' host time, a part of the launches'
    assert_no_leak(eng)


def test_length_capped_requests_make_no_zombie_rows(chat_prompts):
    """A request whose last token is in flight is not scheduled again: max_tokens costs no extra row."""
    eng = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", depth=2)
    seqs = eng.generate(chat_prompts[:3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert all(len(s.output_token_ids) == 6 for s in seqs)
    assert eng.timings.zombie_rows == 0 and eng.timings.tokens == 18
    assert_no_leak(eng)


def test_abort_while_in_flight_frees_pages_after_the_step(chat_prompts):
    eng = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", depth=2)
    a = eng.add_request(chat_prompts[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    b = eng.add_request(chat_prompts[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), retain=True)
    for _ in range(3):
        eng.step()
    seq = eng._seqs[a]
    assert seq.inflight_refs == 1 and seq.block_table
    eng.abort(a)
    assert seq.finalized and seq.block_table, "pages stay while a launched step still holds the row"
    assert a not in eng._seqs and a not in eng._finished, "an aborted request is forgotten at once"
    eng.step()
    assert seq.inflight_refs == 0 and not seq.block_table
    while eng.has_unfinished():
        eng.step()
    assert len(eng.take(b).output_token_ids) == 8
    assert not eng._seqs and not eng._finished
    assert_no_leak(eng)


def test_the_token_pool_carries_last_tokens_and_drafts_by_row():
    """carry_src -1 keeps the host's id, 0 takes the row's last token, j its draft j; padding rows (-1) read and
    write the dummy row; a NO_TOKEN (a failed row) is written as 0 so the next step's embedding stays in range."""
    from engine.memory.token_pool import TokenPool
    pool = TokenPool(3, 2, torch.device("cpu"))
    pool.emit(torch.tensor([2, 0, -1]), torch.tensor([11, -1, 99]))        # -1: indexing wraps to the dummy
    pool.drafts[2] = torch.tensor([21, 22])
    ids = torch.tensor([5, 0, 0, 0, 7])
    src = torch.tensor([-1, 0, 1, 2, 0])
    rows = torch.tensor([2, 2, 2, 2, 0])
    assert pool.carried(ids, src, rows).tolist() == [5, 11, 21, 22, 0]
    assert pool.carried(torch.tensor([0]), torch.tensor([0]), torch.tensor([-1])).tolist() == [99]
    assert pool.last_token[pool.dummy] == 99 and pool.last_token[1] == 0
    plain = TokenPool(2, 0, torch.device("cpu"))
    plain.emit(torch.tensor([1]), torch.tensor([8]))
    assert plain.carried(torch.tensor([4, 0]), torch.tensor([-1, 0]), torch.tensor([0, 1])).tolist() == [4, 8]