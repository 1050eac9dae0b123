"""specdec as a Ray Serve application (engine/server/ray_serve.py): two replicas of `specdec serve` on the CPU behind
Ray Serve's proxy answer the real openai client whole and streamed, and pass a 400 through unchanged. Skipped where
Ray Serve is not installed (`pip install "ray[serve]"`: ~500 MB, not in `make test`)."""
import os

import httpx
import pytest

from serving import CPU_ARGS, ROOT, api_client

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def ray_url():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed")
    import ray
    from ray import serve

    from bench.serving.serve_servers import free_port
    from engine.server.ray_serve import build_app
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **{k: v for k, v in os.environ.items()
                                                                  if k == "SPECDEC_MODEL"}}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = " ".join([*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512"])
        serve.run(build_app({"replicas": 2, "gpus": 0, "cpus": 0.5, "args": args}), route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_whole_streamed_and_bad_requests(ray_url):
    from ray import serve
    replicas = serve.status().applications["default"].deployments["SpecdecReplica"].replica_states
    assert replicas.get("RUNNING") == 2, replicas
    client = api_client(ray_url)
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    chunks = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    bad = httpx.post(f"{ray_url}/v1/chat/completions", json=dict(model=model, messages=ASK, max_tokens=-1), timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text


def test_a_bad_application_option_is_refused_naming_it():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed")
    from engine.server.ray_serve import build_app
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        build_app({"replicas": 0})
