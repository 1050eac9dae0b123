"""GPU: tensor parallelism with the fast paths on (Triton kernels, CUDA graphs, the pipelined loop).

- On one GPU: a one-rank NCCL group puts its collectives (layer all-reduces, mask broadcasts) inside the
  captured graphs, which must give the engine's own tokens; TP = 2 over gloo (both ranks on the one GPU, eager
  steps) must give TP = 1's tokens on the sharded Triton path.
- On two GPUs or more: TP = 2 over NCCL, graphs on, pipelined, must give TP = 1's tokens (fp32).
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from conftest import CHAT_PROMPTS
from engine.runner import model_runner
from engine.llm_engine import LLMEngine
from engine.parallel.group import DistGroup
from engine.requests.sequence import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODEL = os.environ.get("SPECDEC_MODEL", "default")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
GUIDED = SamplingParams(max_tokens=48, temperature=0, json_schema=SCHEMA)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _prompts(eng):
    if eng.tokenizer is None:
        return [[1 + i, 2 + i, 3 + i] * (3 + i) for i in range(4)]
    return [eng.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]


def _run(tp: int, params, **cfg):
    eng = LLMEngine(model=MODEL, device="cuda", tensor_parallel_size=tp, max_num_seqs=8, max_model_len=1024,
                    num_kv_blocks=256, **cfg)
    try:
        out = [s.output_token_ids for s in eng.generate(_prompts(eng), params)]
        assert eng.blocks.num_free == eng.blocks.num_blocks
        return out, eng.runner.graphs is not None
    finally:
        eng.close()


@pytest.fixture
def nccl_group():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    return DistGroup(store, 0, 1, "nccl", 60)


def test_collectives_captured_in_a_graph(nccl_group):
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    logits = torch.randn(3, 16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):                 # warm up the communicator outside the capture
        nccl_group.all_reduce(x.clone())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = nccl_group.all_reduce(x * 2)
            z = nccl_group.broadcast(x + 1)
            g = nccl_group.gather_vocab(logits)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 6.0)) and torch.equal(z, torch.full_like(x, 4.0))
    assert torch.equal(g, logits)


@pytest.mark.parametrize("speculative", ["none", "eagle"])
def test_one_rank_nccl_group_inside_the_graphs(nccl_group, monkeypatch, speculative):
    """The same engine with its all-reduces and mask broadcasts going through NCCL inside every graph."""
    extra = dict(dtype="float32", speculative=speculative)
    if speculative == "eagle" and MODEL != "default":
        extra["spec_head"] = "random"
    plain, graphs = _run(1, GUIDED, **extra)
    real = model_runner.ModelRunner
    monkeypatch.setattr(model_runner, "ModelRunner", lambda *a, **kw: real(*a, **{**kw, "tp": nccl_group}))
    grouped, graphs2 = _run(1, GUIDED, **extra)
    assert graphs and graphs2 and grouped == plain


def test_tp2_over_gloo_on_one_gpu_equals_tp1():
    """Both ranks on the one GPU (NCCL refuses that): the sharded Triton path, eager, fp32, guided too."""
    cfg = dict(dtype="float32", enforce_eager=True, tp_backend="gloo")
    for params in (GREEDY, GUIDED):
        one, _ = _run(1, params, **cfg)
        two, _ = _run(2, params, **cfg)
        assert two == one


@two_gpus
@pytest.mark.parametrize("speculative", ["none", "eagle"])
def test_tp2_nccl_graphs_pipelined_equals_tp1(speculative):
    cfg = dict(dtype="float32", speculative=speculative, depth=2)
    if speculative == "eagle" and MODEL != "default":
        cfg["spec_head"] = "random"
    for params in (GREEDY, GUIDED):
        one, graphs1 = _run(1, params, **cfg)
        two, graphs2 = _run(2, params, **cfg)
        assert graphs1 and graphs2
        assert two == one
