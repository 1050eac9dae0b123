"""`specdec serve` as an engine process behind API processes: the text the API process detokenizes equals the
engine's own, several API processes share one port and one engine, and killing any process is handled (CPU)."""
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine.requests.sequence import SamplingParams
from serving import CPU_ARGS, api_client, ROOT, descendants, serve

DUMMY = ("--model", "dummy:smollm2-tiny", "--tokenizer", "default", *CPU_ARGS)
ASK = [{"role": "user", "content": "Name three colours, one per line."}]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pids, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])         # utime + stime


# ---- the text --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    dict(max_tokens=40, temperature=0),
    dict(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True),
    dict(max_tokens=40, temperature=0, stop_token_ids=(13,)),
], ids=["greedy", "sampled-ignore-eos", "stop-token-id"])
def test_text_from_token_ids_equals_the_engines(engine, chat_prompts, params):
    """What an API process makes of the engine's token ids (TextStream) is the engine's own text, piece by piece
    joined, for the same tokens: EOS and stop ids stay out of the text, held bytes come out at the end."""
    from engine.server.processes.engine_client import TextStream
    from engine.server.processes.ipc import Out
    sp = SamplingParams(**params)
    for prompt in chat_prompts[:3]:
        want = engine.stream(prompt, sp)
        texts, ids, reason = [], [], None
        for out in want:
            texts.append(out.new_text)
            ids.append(list(out.new_token_ids))
            reason = out.finish_reason
        stream = TextStream(engine.tokenizer, sp, frozenset(engine.eos_ids))
        got = [stream.output(Out(0, 0, step, None, i == len(ids) - 1, reason if i == len(ids) - 1 else None)).new_text
               for i, step in enumerate(ids)]
        assert "".join(got) == "".join(texts) and reason is not None


@pytest.fixture(scope="module")
def default_server():
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512") as s:
        yield s


def test_stop_strings_cut_the_text_where_the_engine_does(default_server, engine, chat_prompts):
    """A choice with stop strings is detokenized by the engine process (it stops on the text) and sent along."""
    client = api_client(default_server.url)
    prompt = engine.apply_chat_template(ASK)
    [free] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))
    stop = free.text[len(free.text) // 2:][:3]
    [want] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    r = client.chat.completions.create(model=default_server.model, messages=ASK, max_tokens=40, temperature=0,
                                       stop=[stop])
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=default_server.model, messages=ASK, max_tokens=40,
                                              temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
    default_server.wait_idle()


def test_single_process_mode_gives_the_same_text(default_server):
    """The same text from the engine on a thread of the HTTP process. Only processes of their own (the engine's
    and the API's) freeze their start-up heap out of the garbage collector's reach."""
    body = dict(model=default_server.model, messages=ASK, max_tokens=24, temperature=0)
    split = httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=120).json()
    frozen = default_server.metrics()
    assert frozen["specdec_engine_frozen_objects"] > 10_000 and frozen["specdec_api_frozen_objects"] > 10_000
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512", "--single-process") as one:
        assert one.pids() == (None, [])
        one_metrics = one.metrics()
        assert one_metrics["specdec_engine_frozen_objects"] == 0 == one_metrics["specdec_api_frozen_objects"]
        single = httpx.post(f"{one.url}/v1/chat/completions", json=body, timeout=120).json()
    assert single["choices"][0]["message"] == split["choices"][0]["message"]


# ---- several API processes -------------------------------------------------------------------------------------
def test_two_api_processes_share_the_port_and_the_metrics():
    with serve(*DUMMY, "--api-server-count", "2", "--max-num-seqs", "8") as server:
        engine_pid, apis = server.pids()
        assert len(apis) == 2 and engine_pid not in apis
        before = {pid: _cpu_ticks(pid) for pid in apis}
        body = dict(model=server.model, messages=ASK, max_tokens=8)
        results = []

        def one():                     # a new connection each: the kernel spreads them over both processes
            results.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code)
        threads = [threading.Thread(target=one) for _ in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 48
        assert all(_cpu_ticks(pid) > before[pid] for pid in apis), "one API process got no requests"
        m = server.wait_idle()
        assert m["specdec_requests_total{endpoint=chat,status=200}"] == 48     # summed over both processes
        assert m["specdec_engine_up"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(), ("--single-process",)], ids=["processes", "single-process"])
def test_ctrl_c_ends_open_responses_whole_and_stops_quietly(mode):
    """Ctrl-C (SIGINT to the server) with two streams and a whole response open, each longer than the shutdown's
    grace: every response ends whole (a stream with an error event and [DONE], the waiting one 503), the server
    exits 0, and nothing prints a traceback or, from its teardown, nanobind's leak report (the engine process's
    frozen heap outlived the interpreter)."""
    import openai
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "1024", *mode) as server:
        client = api_client(server.url)
        long = dict(model=server.model, messages=ASK, max_tokens=900, extra_body={"ignore_eos": True})
        outcomes = []

        def streamed():
            chunks = 0
            try:
                for _ in client.chat.completions.create(stream=True, **long):
                    chunks += 1
                outcomes.append(("stream ended without its error", chunks))
            except openai.APIError as err:
                outcomes.append(("stream", chunks, err.message))

        def whole():
            try:
                client.chat.completions.create(**long)
                outcomes.append(("whole finished",))
            except openai.APIStatusError as err:
                outcomes.append(("whole", err.status_code, err.message))
        threads = [threading.Thread(target=f) for f in (streamed, streamed, whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while server.metrics()["specdec_running_requests"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        for t in threads:
            t.join(30)
        log = server.log.read_text()
    stopped = "the engine stopped: the server is shutting down"
    assert sorted(o[0] for o in outcomes) == ["stream", "stream", "whole"], outcomes
    assert all(o[-1] == stopped and o[1] > 0 for o in outcomes if o[0] == "stream"), outcomes
    assert [(o[1], stopped in o[2]) for o in outcomes if o[0] == "whole"] == [(503, True)], outcomes
    assert "Traceback" not in log and "leaked" not in log, log[-3000:]


# ---- killing one side ------------------------------------------------------------------------------------------
def test_a_killed_engine_process_turns_requests_and_health_into_503():
    with serve(*DUMMY, "--max-num-seqs", "4") as server:
        engine_pid, [api] = server.pids()
        outcome = {}

        def long_request():
            outcome["r"] = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json=dict(
                model=server.model, messages=ASK, max_tokens=4000, ignore_eos=True))
        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        while server.metrics()["specdec_running_requests"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(engine_pid, signal.SIGKILL)
        t.join(60)
        r = outcome["r"]
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"], r.text
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "the engine process exited" in health.json()["error"]
        again = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                           json=dict(model=server.model, messages=ASK, max_tokens=4))
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_stopped"
        assert _alive(api) and server.metrics()["specdec_engine_up"] == 0


def test_a_killed_api_process_stops_the_server_and_its_engine():
    with serve(*DUMMY) as server:
        engine_pid, [api] = server.pids()
        os.kill(api, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert _gone([engine_pid]), "the engine process outlived the server"


def test_a_killed_supervisor_leaves_no_process_behind():
    with serve(*DUMMY, "--api-server-count", "2") as server:
        children = [pid for pid, _ in descendants(server.proc.pid)]
        engine_pid, apis = server.pids()
        assert {engine_pid, *apis} <= set(children)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert _gone(children), "a server process outlived the one that started it"


def test_an_engine_that_fails_to_start_stops_the_api_processes_waiting_for_it():
    """The API processes start beside the engine process and wait for its model info: an engine that fails (here a
    model path that does not exist) ends the server with its error, and nothing it started is left."""
    import subprocess
    import sys

    from serving import ROOT
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--model", "/no/such/dir",
                             "--api-server-count", "2", *CPU_ARGS], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    children: set[int] = set()
    while proc.poll() is None and len(children) < 3:          # the engine process and both API processes
        children |= {pid for pid, _ in descendants(proc.pid)}
        time.sleep(0.05)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "does not exist" in err and "listening" not in out
    assert children and _gone(children), "a process of the failed server was left"


def test_an_api_process_serves_without_torch():
    """An API process's modules and the default model's tokenizer (chat template, encode, decode) load no torch:
    ~250 MB and ~2 s of start-up less for each of `--api-server-count` processes."""
    code = ("import sys, uvicorn; from engine.server.api.app import create_app, ServerState; "
            "from engine.server.processes.engine_client import EngineClient; "
            "from engine.models.loader import load_tokenizer, resolve_model; "
            "tok = load_tokenizer(resolve_model('default')); "
            "ids = tok.encode(tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, "
            "add_generation_prompt=True), add_special_tokens=False); "
            "assert 'hi' in tok.decode(ids) and len(tok.get_vocab()) > 1000; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_supervisor_checks_the_options_without_torch():
    """`specdec serve`'s first process (and each child's start: spawn imports engine.cli again) builds and checks
    the EngineConfig but loads no torch: ~3.5 s of CPU and ~200 MB saved a server start."""
    code = ("import sys; from engine.cli import parser; from engine.options import engine_config; "
            "from engine.server.processes import api_process, supervisor; "
            "engine_config(parser().parse_args(['serve', '--device', 'cpu', '--dtype', 'float32'])); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("mode", [(), ("--single-process",)], ids=["processes", "single-process"])
def test_a_port_in_use_is_a_clear_error(mode):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), *DUMMY, *mode],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and f"specdec: error: cannot listen on 127.0.0.1:{port}: Address already in use" \
        in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_api_processes_that_die_starting_are_reported_not_raised(capsys):
    """Every API process gone before it said it serves (its ready pipe at EOF, their sentinels not yet seen):
    start-up fails with a message, not a traceback from the pipe."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from engine.server.processes.supervisor import _wait_ready
    ready_r, ready_w = mp.Pipe(duplex=False)
    (api_r, _api_w), (engine_r, _engine_w) = mp.Pipe(duplex=False), mp.Pipe(duplex=False)   # live processes'
    ready_w.close()                                                                     # sentinels: never ready
    api, engine = SimpleNamespace(sentinel=api_r.fileno()), SimpleNamespace(sentinel=engine_r.fileno())
    assert _wait_ready([api], ready_r, [engine], []) is False
    assert "API processes exited during start-up" in capsys.readouterr().err


def test_the_api_processes_follow_the_streams_and_the_cores():
    """One API process per 64 streams the engine may hold, at most 4 and a quarter of the cores; a count given is
    kept, and a bad one refused naming the option."""
    from engine.cli import parser
    from engine.server.serve import auto_api_servers, cmd_serve
    assert [auto_api_servers(seqs, 16) for seqs in (8, 64, 128, 256, 1024)] == [1, 1, 2, 4, 4]
    assert [auto_api_servers(256, cores) for cores in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    args = parser().parse_args(["serve", "--device", "cpu", "--api-server-count", "0"])
    with pytest.raises(ValueError, match="--api-server-count must be >= 1"):
        cmd_serve(args)
    assert parser().parse_args(["serve"]).api_server_count is None
