"""The native step launch (engine/runner/native_launch.py, hostfunc/csrc/step_launch.cpp): its driver calls against
the fake libcuda on the CPU, its refusal where it cannot run, and on a GPU the tokens of the Python launch."""
import os
import types
import warnings

import pytest
import torch

from conftest import assert_no_leak
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from engine.runner import native_launch
from engine.runner.slots import DecodeSlot
from helpers import build_fake_libcuda, run_fake_driver_scenario

MODEL = os.environ.get("SPECDEC_MODEL", "default")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}


def test_the_driver_calls_in_the_python_launch_order_with_the_fake_driver(tmp_path):
    if build_fake_libcuda(tmp_path) is None:
        pytest.skip("no C compiler or hostfunc/testing/ source to build the fake libcuda")
    run = run_fake_driver_scenario(tmp_path, "hostfunc.testing.fake_step_launch_scenario")
    assert run.returncode == 0 and "fake step launch scenario ok" in run.stdout, run.stdout + run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a CUDA driver")
def test_without_a_driver_it_says_why_and_refuses():
    why = native_launch.unavailable()
    assert "libcuda" in why or "raw_cuda_graph_exec" in why
    with pytest.raises(RuntimeError, match="native_launch is on but cannot run here"):
        native_launch.NativeLaunch(runner=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback without a CUDA driver")
def test_on_by_default_it_warns_and_keeps_the_python_launch_where_it_cannot_run():
    assert EngineConfig().tuning.native_launch
    runner = types.SimpleNamespace(graphs=object())      # a runner with graph steps, on a machine with no driver
    with pytest.warns(UserWarning, match="native_launch cannot run here .*graph steps use the Python launch"):
        assert native_launch.for_runner(runner, enabled=True) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # off, or no graph steps to take: nothing to say
        assert native_launch.for_runner(runner, enabled=False) is None
        assert native_launch.for_runner(types.SimpleNamespace(graphs=None), enabled=True) is None


@pytest.mark.parametrize("spec_k", [0, 2])
def test_raw_copies_are_the_download_of_the_python_launch(spec_k):
    """The bytes of each download are those of download_sampled's copies: the first num_sample rows of the tokens
    (spec_out with speculation) and, where asked, of the logprobs; the upload is input_bytes of the padded rows."""
    slot = DecodeSlot(0, 16, 8, 4, torch.device("cpu"), spec_k=spec_k, logprobs=True)
    slot.num_seqs, slot.num_sample = 3, 3
    tokens = slot.spec_out_host if spec_k else slot.sampled_host
    for want in (False, True):
        slot.want_logprobs = want
        (dst, src, nbytes), downloads = slot.raw_copies(padded=4)
        assert (dst, src, nbytes) == (slot._dev_buf.data_ptr(), slot._host_buf.data_ptr(), slot.input_bytes(4))
        expect = [(tokens.data_ptr(), (slot.spec_out if spec_k else slot.sampled).data_ptr(),
                   tokens[:3].numel() * tokens.element_size())]
        if want:
            expect.append((slot.logprobs_host.data_ptr(), slot.logprobs.data_ptr(),
                           slot.logprobs_host[:3].numel() * slot.logprobs_host.element_size()))
        assert downloads == expect


def _run(native: bool, prompts, params):
    eng = LLMEngine(model=MODEL, device="cuda", max_num_seqs=8, max_model_len=1024, native_launch=native)
    # the schema compiled first: a guided request that waited on its compile would change the steps' composition
    eng.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0, json_schema=WEATHER))
    eng.runner.graphs.replays.clear()
    seqs = eng.generate(prompts, params)
    assert all(s.finish_reason != "error" for s in seqs), [s.error for s in seqs]
    assert_no_leak(eng)
    replays, timings = dict(eng.runner.graphs.replays), eng.timings
    eng.close()
    return [s.output_token_ids for s in seqs], replays, timings


@pytest.mark.gpu
def test_native_launch_gives_the_tokens_of_the_python_launch():
    """Greedy, seeded sampled, guided (its grammar branch in the graph) and penalized rows (their writes keep the
    Python launch: both paths in one run), pipelined: the same tokens, the same graph replays."""
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356] * (i + 1) for i in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0.0, json_schema=WEATHER),
              SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    ref, ref_replays, ref_timings = _run(False, prompts, params)
    got, replays, timings = _run(True, prompts, params)
    assert got == ref
    assert replays == ref_replays and replays["decode"] > 0 and replays["guided"] > 0
    assert 0 < timings.replay < timings.launch
    # the device times read natively (one driver call a step) are the same kind of figure as torch's reads
    assert timings.forward_gpu > 0 and timings.sample_gpu > 0
    assert 0.5 < timings.forward_gpu / ref_timings.forward_gpu < 2.0
