"""`specdec serve --data-parallel-size N`: N engine processes behind the same API processes. A request goes to the
engine whose prefix cache holds its prompt (learnt from the engines' KV events), else to the least loaded; a killed
engine fails only its own requests and the others keep serving; options that cannot run are refused at start."""
import argparse
import json
import os
import signal
import threading
import time

import httpx
import pytest

from engine.memory.block_manager import ROOT, prefix_digests
from engine.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from engine.server.metrics import combine_stats, DEAD_STATS
from engine.server.processes.placement import Placement
from serving import CPU_ARGS, serve

BS = 16


def stored(tokens: list[int]) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(prefix_digests(tokens, BS, ROOT), None, tokens, BS, None, "GPU")])


# ---- placement -------------------------------------------------------------------------------------------------
def test_a_prompt_goes_where_its_prefix_is_cached_else_to_the_least_loaded():
    p = Placement(3, BS)
    a, b = list(range(100, 164)), list(range(500, 564))
    p.apply(2, stored(a[:48]))
    assert p.choose(a) == 2 and p.choose(a[:40] + [7] * 30) == 2      # two pages of it are cached there
    p.load = [3, 1, 0]
    assert p.choose(b) == 2                                            # nothing cached: the least loaded
    p.load = [1, 1, 1]
    assert {p.choose(b) for _ in range(6)} == {0, 1, 2}                # ties go round
    p.apply(2, KVEventBatch(0.0, [BlockRemoved(prefix_digests(a[:16], BS, ROOT), "GPU")]))
    p.load = [0, 5, 5]
    assert p.choose(a) == 0                                            # its first page is gone: no match left
    p.apply(1, stored(b))
    p.apply(1, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert p.matched(1, prefix_digests(b, BS, ROOT)) == 0


def test_a_dead_engine_is_never_chosen_and_none_left_is_an_error():
    p = Placement(2, BS)
    a = list(range(64))
    p.apply(0, stored(a))
    p.forget(0)
    assert all(p.choose(a) == 1 for _ in range(4))
    p.forget(1)
    with pytest.raises(LookupError, match="every engine process has stopped"):
        p.choose(a)


def test_stats_of_several_engines_add_up():
    one = dict(DEAD_STATS, running=2, kv_used=10, kv_total=100, prefix_hit_tokens=32, up=1.0, spec_rows=10,
               acceptance_length=3.0)
    two = dict(DEAD_STATS, running=1, kv_used=5, kv_total=100, prefix_hit_tokens=16, up=1.0, spec_rows=30,
               acceptance_length=2.0)
    s = combine_stats([one, two])
    assert (s["running"], s["kv_used"], s["kv_total"], s["prefix_hit_tokens"], s["up"]) == (3, 15, 200, 48, 2.0)
    assert s["acceptance_length"] == pytest.approx(2.25)
    assert combine_stats([one]) is one


# ---- options ---------------------------------------------------------------------------------------------------
def _setups(n: int, share: bool = False, visible=("0",), **config):
    from engine.config import EngineConfig
    from engine.server.processes.supervisor import engine_setups
    args = argparse.Namespace(data_parallel_size=n, data_parallel_share_device=share)
    return engine_setups(EngineConfig(**config), args, list(visible))


def test_each_engine_gets_a_gpu_or_a_share_of_one():
    setups = _setups(2, visible=("3", "5"), device="cuda")
    assert [env for _, env in setups] == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    shared = _setups(2, share=True, device="cuda", kv_cache_memory_fraction=0.5)
    assert [(c.kv_cache_memory_fraction, env) for c, env in shared] == [(0.25, {}), (0.25, {})]
    assert [env for _, env in _setups(3, device="cpu")] == [{}, {}, {}]


@pytest.mark.parametrize("n, config, message", [
    (0, {}, "--data-parallel-size must be >= 1"),
    (2, dict(device="cuda"), "needs 2 GPUs and 1 are visible"),
    (2, dict(device="cpu", tensor_parallel_size=2), "with --tensor-parallel-size > 1 is not supported"),
    (2, dict(device="cpu", kv_events_endpoint="tcp://*:5557"), "--kv-events-endpoint names one socket"),
], ids=["zero", "more-than-the-gpus", "tensor-parallel", "kv-events"])
def test_what_cannot_run_is_refused_naming_it(n, config, message):
    with pytest.raises(ValueError, match=message):
        _setups(n, **config)


def test_the_cli_refuses_data_parallel_in_one_process():
    import subprocess
    import sys

    from serving import ROOT as REPO
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--single-process", "--data-parallel-size", "2",
                        *CPU_ARGS], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode != 0 and "--single-process runs one engine on a thread" in r.stderr, r.stderr[-2000:]


# ---- a real server ---------------------------------------------------------------------------------------------
def _chat(server, agent: int, turn: int, max_tokens: int = 4, **extra) -> httpx.Response:
    words = " ".join(f"record{(agent * 13 + i) % 97}" for i in range(40))
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json=dict(
        model=server.model, max_tokens=max_tokens, temperature=0, **extra,
        messages=[{"role": "system", "content": f"Agent {agent}. You keep {words}."},
                  {"role": "user", "content": f"Question {turn}"}]))


def test_two_engines_keep_each_agent_where_its_prompt_is_and_survive_a_kill():
    """Three agents on two engines: every later turn finds its prompt cached (an odd number of agents: going by
    load alone would move each agent to the other engine every turn, and find it cached one turn in three). Then
    one engine is
    killed under load: requests on it fail with an error naming it, those on the other finish, later requests all
    succeed, and no KV page is left held."""
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--data-parallel-size", "2", "--num-kv-blocks", "64") as server:
        assert "engine pids" in server.line
        engines = [int(p) for p in server.line.split("engine pids ")[1].split(",")[0].split()]
        before = server.metrics()
        for turn in range(3):
            for agent in range(3):
                assert _chat(server, agent, turn).status_code == 200
        m = server.metrics()
        asked = m["specdec_prefix_cache_queries_total"] - before["specdec_prefix_cache_queries_total"]
        found = m["specdec_prefix_cache_hits_total"] - before["specdec_prefix_cache_hits_total"]
        assert found / asked > 0.55, (found, asked)        # two of three turns, less each question's last page
        assert m["specdec_engine_up"] == 2
        per_engine = [m[f"vllm:prefix_cache_hits_total{{engine={i},model_name={server.model}}}"] for i in (0, 1)]
        assert all(per_engine) and sum(per_engine) == m["specdec_prefix_cache_hits_total"], per_engine  # spread
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
        for agent in range(2):          # its grammar compiles on the engine it is placed on, then runs there
            r = _chat(server, agent, 3, max_tokens=40, response_format={
                "type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
            assert r.status_code == 200 and "city" in json.loads(r.json()["choices"][0]["message"]["content"]), r.text

        outcomes = []

        def long_request(agent: int):
            outcomes.append(_chat(server, agent, 9, max_tokens=60, ignore_eos=True))
        threads = [threading.Thread(target=long_request, args=(a,)) for a in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while server.metrics()["specdec_running_requests"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(engines[1], signal.SIGKILL)
        for t in threads:
            t.join(180)
        failed = [r for r in outcomes if r.status_code != 200]
        assert len(outcomes) == 4 and 0 < len(failed) < 4, [r.status_code for r in outcomes]
        assert all("engine" in r.json()["error"]["message"] for r in failed), [r.text for r in failed]
        time.sleep(1.0)
        assert all(_chat(server, agent, 10).status_code == 200 for agent in range(4))
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert server.wait_idle()["specdec_engine_up"] == 1
