"""Tensor parallelism on the CPU: ranks are processes joined by gloo (engine/parallel/, engine/workers/).

TP = 2 must give the very tokens of TP = 1 (float32, the same weights cut Megatron-style), through every
step kind: prefill chunks, decode, guided masks (filled by rank 0, broadcast), speculative drafts (n-gram,
a draft head, a draft model). A worker that dies or hangs ends the engine with TensorParallelError, and no
worker outlives its engine or its engine's process.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine, TensorParallelError
from engine.requests.sequence import SamplingParams

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TINY = dict(model="dummy:tiny", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
DEFAULT = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=4, max_num_batched_tokens=64)


def generate(prompts, params, tp: int, **config):
    eng = LLMEngine(tensor_parallel_size=tp, **config)
    try:
        outs = eng.generate(prompts, params)
        stats = (eng.timings.spec_rows, eng.timings.spec_accepted)
        assert eng.blocks.num_free == eng.blocks.num_blocks, "KV pages leaked"
        return [o.output_token_ids for o in outs], stats
    finally:
        eng.close()


def same_as_tp1(prompts, params, **config):
    """TP = 2's tokens equal TP = 1's -> (tokens, TP = 2's (spec rows, accepted drafts)). Drafts of a head may
    differ where its argmax is a near tie: TP sums the same products in another order."""
    one, _ = generate(prompts, params, 1, **config)
    two, stats = generate(prompts, params, 2, **config)
    assert two == one
    return one, stats


def tiny_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 40, 3)] + [[7, 8, 9] * 6]


def test_tiny_greedy_and_sampled_equal_tp1():
    """Chunked prefill (40 tokens over a 32-token budget), decode, depth 1 and 2, greedy and seeded sampling (at
    depth 2, queued behind the greedy rows on the same engines: each TP = 2 engine start costs seconds)."""
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    same_as_tp1(tiny_prompts(), greedy, depth=1, **TINY)
    out, _ = same_as_tp1(tiny_prompts() * 2, [greedy] * 4 + [sampled] * 4, depth=2, **TINY)
    assert len({tuple(o) for o in out[4:]}) > 1


def test_tiny_penalties_and_logprobs_equal_tp1():
    """Every rank keeps the penalty rows and runs the step's extras variant (penalties change what it samples)."""
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=1.5, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True, repetition_penalty=1.4,
                             min_p=0.1),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=1.0),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    same_as_tp1(tiny_prompts(), params, **TINY)


def test_tiny_speculative_ngram_and_draft_model_equal_tp1():
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    _, (rows, _) = same_as_tp1(tiny_prompts(), params, speculative="ngram", **TINY)
    assert rows > 0
    _, (rows, accepted) = same_as_tp1(tiny_prompts(), params, speculative="draft_model",
                                      spec_draft_model="dummy:tiny", **TINY)
    assert rows > 0 and accepted > 0         # the draft is the target itself: its drafts are accepted


def test_tiny_prefix_cache_hits_equal_tp1_without_it():
    """Rank 0 finds the cached pages; every rank maps them (the block tables go out with the step)."""
    head = tiny_prompts()[1]
    rounds = [[head + [3, 4]], [head + [5, 6, 7], head + [3, 4]]]       # the second round hits the first's pages
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for tp, caching in ((1, False), (2, True)):
        eng = LLMEngine(tensor_parallel_size=tp, prefix_caching=caching, **TINY)
        try:
            outs.append([[s.output_token_ids for s in eng.generate(r, params)] for r in rounds])
            assert eng.blocks.num_free == eng.blocks.num_blocks, "KV pages leaked"
            hits = eng.prefix_cache_stats()["prefix_hit_tokens"]
        finally:
            eng.close()
    assert outs[1] == outs[0] and hits >= 2 * 32


@pytest.mark.slow
def test_default_model_guided_and_eagle_equal_tp1(chat_prompts):
    """SmolLM2-135M: 9 query / 3 KV heads split 6+3 / 2+1, tied embeddings; guided masks from rank 0 (rows of
    plain and guided requests in one step, then verifications), the shipped draft head with grammar-masked and
    grammar-forced drafts."""
    prompts = chat_prompts[:3]
    guided = SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMA)
    short = SamplingParams(max_tokens=24, temperature=0, json_schema=SCHEMA)
    same_as_tp1(prompts, [SamplingParams(max_tokens=12, temperature=0), short, short], **DEFAULT)
    _, (rows, _) = same_as_tp1(prompts, guided, speculative="eagle", guided_draft_masks=True,
                               guided_forced_drafts=True, **DEFAULT)
    assert rows > 0


def test_more_ranks_than_kv_heads_is_refused_before_starting():
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        LLMEngine(tensor_parallel_size=3, **TINY)


def _worker(eng) -> subprocess.Popen:
    return eng.cluster.workers[0]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _raises_tp_error(eng, match: str, within: float) -> None:
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=match):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert time.monotonic() - start < within
    with pytest.raises(TensorParallelError, match=match):       # and on every later call
        eng.step()


def test_dead_worker_ends_the_engine():
    eng = LLMEngine(tensor_parallel_size=2, **TINY)
    try:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
        worker = _worker(eng)
        worker.kill()
        _raises_tp_error(eng, r"worker 1 \(pid \d+\) exited with code -9", within=10)
    finally:
        eng.close()
    assert _gone(worker.pid)


def test_hung_worker_ends_the_engine_after_the_timeout():
    eng = LLMEngine(tensor_parallel_size=2, tp_timeout_s=3, **TINY)
    try:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
        worker = _worker(eng)
        os.kill(worker.pid, signal.SIGSTOP)
        _raises_tp_error(eng, "tensor parallelism failed", within=20)
    finally:
        eng.close()
    assert _gone(worker.pid)


def test_workers_exit_with_their_engine_process():
    script = textwrap.dedent("""
        import sys, time
        from engine.llm_engine import LLMEngine
        eng = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", tensor_parallel_size=2)
        print(eng.cluster.workers[0].pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the worker outlived its engine's process"
