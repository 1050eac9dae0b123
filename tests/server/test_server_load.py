"""`specdec serve` under load, on a cheap dummy model with SmolLM2's tokenizer (CPU): many concurrent streams,
the bounded queue."""
import asyncio

import openai

from serving import CPU_ARGS, api_client, serve

DUMMY = ("--model", "dummy:smollm2-tiny", "--tokenizer", "default", *CPU_ARGS)


async def _stream(client, model, i, max_tokens=24):
    chunks = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=max_tokens, temperature=0.8,
        seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, usage, finish = "", None, None
    async for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
        usage = c.usage or usage
    return text, usage, finish


def test_fifty_concurrent_streaming_clients_all_finish():
    async def run(url, model):
        client = api_client(url, timeout=300, asynchronous=True)
        return await asyncio.gather(*(_stream(client, model, i) for i in range(50)), return_exceptions=True)

    with serve(*DUMMY, "--max-num-seqs", "16") as server:
        results = asyncio.run(run(server.url, server.model))
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(usage.completion_tokens == 24 and finish == "length" for _, usage, finish in results)
        m = server.wait_idle()
        assert m["specdec_requests_total{endpoint=chat,status=200}"] == 50
        assert m["specdec_request_finish_total{reason=length}"] == 50


def test_a_full_queue_answers_429_and_recovers():
    async def run(url, model):
        client = api_client(url, timeout=300, asynchronous=True)
        # long enough that all six overlap (tens of ms a token through the server): three get in, the others find
        # the queue full
        return await asyncio.gather(*(_stream(client, model, i, 160) for i in range(6)), return_exceptions=True)

    with serve(*DUMMY, "--max-num-seqs", "2", "--max-queued", "1") as server:
        results = asyncio.run(run(server.url, server.model))
        limited = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert limited and len(served) >= 3 and len(limited) + len(served) == 6
        assert limited[0].response.json()["error"]["code"] == "overloaded"
        server.wait_idle()
        again = asyncio.run(run(server.url, server.model))    # capacity comes back as requests finish
        assert sum(not isinstance(r, BaseException) for r in again) >= 3


def test_speculative_server_reports_acceptance_and_keeps_greedy_tokens():
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    prompt = [int(t) for t in (list(range(100, 140)) * 3)]       # repeats, so prompt lookup finds drafts
    plain = LLMEngine(model="dummy:smollm2-tiny", tokenizer="default", device="cpu", dtype="float32",
                      attention_backend="torch")
    [want] = plain.generate([prompt], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    plain.close()
    with serve(*DUMMY, "--speculative", "ngram", "--num-draft-tokens", "3") as server:
        client = api_client(server.url, timeout=300)
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text
        spec = r.usage.model_extra["speculative"]
        assert spec["steps"] > 0 and spec["acceptance_length"] >= 1.0
        m = server.metrics()
        assert m["specdec_spec_verify_rows_total"] >= spec["steps"] and m["specdec_spec_acceptance_length"] >= 1.0


def test_an_engine_thread_that_dies_fails_its_requests_and_answers_503():
    """A bug inside step() (injected here) stops the engine thread: what was in flight ends with an error
    output, later submissions raise EngineDead (HTTP 503), and the thread does not hang."""
    import pytest

    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from engine.server.processes.async_engine import AsyncEngine, EngineDead

    engine = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", attention_backend="torch")
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected bug")
        return real_step()

    engine.step = failing_step
    aengine = AsyncEngine(engine)

    async def run():
        aengine.start(asyncio.get_running_loop())
        sub = await aengine.submit([1, 2, 3], [SamplingParams(max_tokens=50, ignore_eos=True)])
        outs = []
        while not outs or not outs[-1][1].finished:
            outs += await asyncio.wait_for(sub.next_batch(), 30)
        with pytest.raises(EngineDead, match="injected bug"):
            await aengine.submit([1, 2, 3], [SamplingParams(max_tokens=5)])
        return outs[-1][1]

    last = asyncio.run(run())
    aengine.engine_thread.join(10)
    assert last.finish_reason == "error" and "injected bug" in last.error
    assert not aengine.engine_thread.is_alive() and not aengine.healthy() and aengine.live == 0
    engine.close()


def test_tensor_parallel_server_equals_one_rank_and_stops_when_a_worker_dies():
    """-tp 2: a gloo worker beside the server; the same greedy text as one rank. Killing the worker ends the
    engine: /health and new requests answer 503, naming the lost worker."""
    import os
    import signal
    import time

    import httpx
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    prompt = list(range(200, 240))
    plain = LLMEngine(model="dummy:smollm2-tiny", tokenizer="default", device="cpu", dtype="float32",
                      attention_backend="torch")
    [want] = plain.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    plain.close()
    with serve(*DUMMY, "--tensor-parallel-size", "2") as server:
        client = api_client(server.url, timeout=300)
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text
        [worker] = _workers_of(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0)
            except openai.APIStatusError as exc:
                if exc.status_code == 503:
                    break
            time.sleep(0.2)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "worker 1" in health.json()["error"]


def _workers_of(root: int) -> list[int]:
    """Tensor-parallel worker processes under `root` (the server, or its engine process)."""
    from serving import descendants
    return [pid for pid, cmd in descendants(root) if b"engine.workers.worker" in cmd]
