"""The serving bench's server start: a server is up once /health answers 200, whatever its body (vLLM's is
empty, ours is JSON)."""
import http.server
import subprocess
import sys
import threading

import pytest

from bench.serving.serve_servers import wait_healthy


class _EmptyHealth(http.server.BaseHTTPRequestHandler):
    def do_GET(self):                               # noqa: N802 - the http.server API
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server_and_proc(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EmptyHealth)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # answers SIGINT as a server does, also where the tests inherit it ignored (started as a background job)
    code = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", proc, tmp_path / "server.log"
    finally:
        proc.kill()
        proc.wait()
        httpd.shutdown()


def test_an_empty_200_health_counts_as_up(server_and_proc):
    url, proc, log = server_and_proc
    log.write_text("")
    wait_healthy(proc, url, log, timeout=10.0)
    assert proc.poll() is None                      # not stopped: it was healthy


def test_a_server_that_never_answers_200_is_stopped_and_named(server_and_proc):
    url, proc, log = server_and_proc
    log.write_text("listening nowhere\n")
    with pytest.raises(RuntimeError, match="not healthy"):
        wait_healthy(proc, url + "/nothing-here", log, timeout=1.5)
    assert proc.poll() is not None
