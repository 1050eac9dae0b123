"""`specdec serve` in a subprocess on a free port, for the server tests (a real uvicorn, reached over TCP)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
# a compile may outlast the default budget on a busy 2-core machine (the tests of that budget give their own)
CPU_ARGS = ("--device", "cpu", "--dtype", "float32", "--attention-backend", "torch", "--grammar-compile-timeout", "60")



def api_client(url: str, timeout: float = 120, asynchronous: bool = False):
    """The real openai client (sync or async) on a test server's /v1, without retries: a test sees every error."""
    import openai
    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path, model: str, line: str = ""):
        self.url, self.proc, self.log, self.model, self.line = url, proc, log, model, line

    def pids(self) -> tuple[int | None, list[int]]:
        """(engine process, API processes) from the "listening" line; (None, []) with --single-process."""
        if "engine pid" not in self.line:
            return None, []
        engine = int(self.line.split("engine pid ")[1].split(",")[0])
        return engine, [int(p) for p in self.line.split("API pids ")[1].rstrip(")\n").split()]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus-client: {name{labels}: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs, no KV page is held and no grammar compiles (fails the test if that never
        happens)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["specdec_running_requests"] == 0 and m["specdec_kv_blocks_used"] == 0 \
                    and m["specdec_server_requests_in_progress"] == 0 and m["specdec_grammar_compiles_unfinished"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: running {m['specdec_running_requests']}, "
                                     f"KV pages used {m['specdec_kv_blocks_used']}, "
                                     f"grammar compiles {m['specdec_grammar_compiles_unfinished']}")
            time.sleep(0.1)


def _read_ready(proc: subprocess.Popen, found: dict) -> None:
    for line in proc.stdout:
        if line.startswith("specdec serve: listening on "):
            found["url"], found["line"] = line.split()[4], line
            return


@contextmanager
def serve(*args: str, timeout: float = 300.0):
    log = Path(tempfile.mkstemp(prefix="specdec-serve-", suffix=".log")[1])
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", *args], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    found: dict = {}
    reader = threading.Thread(target=_read_ready, args=(proc, found), daemon=True)
    reader.start()
    reader.join(timeout)
    try:
        if "url" not in found:
            raise RuntimeError(f"specdec serve did not start (exit code {proc.poll()}):\n{log.read_text()[-3000:]}")
        model = httpx.get(f"{found['url']}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Server(found["url"], proc, log, model, found["line"])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)


def descendants(root: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of every process under `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        try:
            out.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes()))
        except OSError:
            continue
        todo += children.get(pid, ())
    return out
