"""Programmatic dependent launch: which launches get it, and that kernels launched with it inside a CUDA graph
compute what the same kernels compute without it."""
import os
import subprocess
import sys

import pytest
import torch

from engine.kernels.common import pdl


def test_plain_launch_off_hopper_and_on_the_cpu():
    from engine.kernels.fused_ops import _rms_norm_kernel
    assert pdl(_rms_norm_kernel, torch.device("cpu"), 1) == {"USE_PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper or newer GPU")
def test_only_steps_of_a_few_rows_launch_dependently():
    from engine.kernels.common import PDL_MAX_ROWS
    from engine.kernels.fused_ops import _rms_norm_kernel
    dev = torch.device("cuda")
    assert pdl(_rms_norm_kernel, dev, PDL_MAX_ROWS)["USE_PDL"] is True
    assert pdl(_rms_norm_kernel, dev, PDL_MAX_ROWS + 1) == {"USE_PDL": False}


@pytest.mark.parametrize("value,on", [(None, True), ("0", False), ("1", True)])
def test_the_switch_is_on_unless_turned_off(value, on):
    code = "from engine.kernels.common import _PDL_ON; print(_PDL_ON)"
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_PDL"} | ({"SPECDEC_PDL": value} if value else {})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(on)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper or newer GPU")
def test_graphed_chain_with_dependent_launch_matches_plain_launches():
    """norm -> rope/KV store -> attention -> silu -> decode GEMV, each reading the last one's output, captured in a
    graph with
    PDL; replayed after the inputs change, it must equal the same chain run in a subprocess with SPECDEC_PDL=0."""
    code = r'''
import sys, torch
from engine.kernels.matmul import decode_gemv as G
from engine.kernels import fused_ops as F
from engine.kernels.attention import paged_attention as A
from engine.kernels.common import pdl
torch.manual_seed(0)
dev = torch.device("cuda")
T, H, KV, D, BS, NB = 4, 8, 2, 64, 16, 8
x = torch.randn(T, H * D, device=dev, dtype=torch.bfloat16)
w = torch.rand(H * D, device=dev, dtype=torch.bfloat16)
kc = torch.zeros(NB, BS, KV, D, device=dev, dtype=torch.bfloat16); vc = torch.zeros_like(kc)
cos = torch.rand(64, D, device=dev); sin = torch.rand(64, D, device=dev)
pos = torch.arange(T, device=dev); slots = torch.arange(T, device=dev)
bt = torch.arange(NB, device=dev, dtype=torch.int32)[None]; cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
lens = torch.tensor([T], device=dev, dtype=torch.int32)
w2 = torch.randn(96, H * D // 2, device=dev, dtype=torch.bfloat16)
def chain():
    h = F.rms_norm(x, w, 1e-5)
    q = h.view(T, H, D); k = h[:, :KV * D].reshape(T, KV, D); v = h[:, KV * D:2 * KV * D].reshape(T, KV, D)
    q = F.rope_store_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    o = A.paged_attention(q, kc, vc, cu, lens, bt, 0.125, T, num_splits=2)
    return G.decode_linear(F.silu_mul(o.reshape(T, H * D)), w2)
chain(); torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = chain()
x.copy_(torch.randn_like(x)); g.replay(); torch.cuda.synchronize()
print(pdl(F._rms_norm_kernel, dev, T)["USE_PDL"]); torch.save(out.cpu(), sys.argv[1])
'''
    import tempfile
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for flag in ("1", "0"):
            path = os.path.join(tmp, f"out{flag}.pt")
            env = dict(os.environ, SPECDEC_PDL=flag)
            run = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True)
            assert run.returncode == 0, run.stderr[-2000:]
            assert run.stdout.strip() == str(flag == "1")
            results[flag] = torch.load(path)
    assert torch.equal(results["1"], results["0"])
