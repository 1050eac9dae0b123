"""Fixtures and marks every test folder shares (helpers.py holds the plain functions, serving.py the server's).

The folders mirror the packages: tests/<name>/ tests engine/<name>/, tests/ itself engine's top-level modules
(llm_engine.py, scheduler.py, cli.py, ...). Three folders are named apart from their packages, since a test folder
named like a top-level package would stand in for it on the import path: tests/native/ tests hostfunc/,
tests/benchmarks/ bench/, and tests/speculative/ also specdec/ (head training, acceptance studies)."""
import gc
import importlib
import os
from pathlib import Path

import torch

# Triton kernels run on the CPU through its interpreter; the flag must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_calls  # noqa: E402
    interpreter_calls.install()

# Under pytest-xdist (`make test` runs a worker a core) each worker takes its share of the cores: torch's default
# of one thread a core per worker oversubscribes the machine and every CPU forward slows down. The processes a
# test starts (CLI runs, bench drivers and their sides, servers) inherit the share through OMP_NUM_THREADS: with
# torch's default there, every forward of theirs slowed down beside the other busy worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Give me a JSON object describing a cat with name and age fields.",
    "hi",
]


def triton_module(name: str):
    """engine.kernels.<name> (or the bench module `name` names whole, "bench.kernels.gemv"), with its kernels built
    for the Triton interpreter when there is no CUDA.

    TRITON_INTERPRET (set above when there is no GPU) is read when @triton.jit decorates: for our kernels
    when their module is first imported. If something imported it earlier without the flag, it is reloaded,
    after engine.kernels.common whose reductions the kernels call. Skips the calling test module if the
    interpreter cannot be enabled (TRITON_INTERPRET=0 set, or triton.knobs.runtime.interpret forced off)."""
    pytest.importorskip("triton")
    module = importlib.import_module(name if name.startswith("bench.") else f"engine.kernels.{name}")
    if not torch.cuda.is_available() and not module.interpreted():
        importlib.reload(importlib.import_module("engine.kernels.common"))
        module = importlib.reload(module)
    if not torch.cuda.is_available() and not module.interpreted():
        pytest.skip("no CUDA and the Triton interpreter could not be enabled", allow_module_level=True)
    return module


TESTS = Path(__file__).parent
KERNELS = TESTS / "kernels"


# Files that hold an xdist worker (`--dist loadfile`) for 100 s or more of a CPU run, longest first: dispatched
# before the rest, so that none starts last while the other workers have run out of files.
FIRST = ["speculative/test_spec_engine.py", "speculative/test_spec_guided.py", "memory/test_prefix_cache.py",
         "server/test_server_process.py", "kernels/test_verify_attention.py", "speculative/test_tree_guided.py",
         "workers/test_tp.py", "guided/test_closing.py", "models/test_hf_equality.py", "server/test_server.py",
         "speculative/test_tree_engine.py", "server/test_server_hostile.py", "test_cli.py",
         "speculative/test_spec_stack.py", "test_pipeline.py"]


def _dispatch_order(item) -> int:
    rel = item.path.relative_to(TESTS).as_posix() if TESTS in item.path.parents else ""
    return FIRST.index(rel) if rel in FIRST else len(FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_dispatch_order)     # stable: a file's tests keep their order
    for item in items:      # tests/kernels/: the kernels against torch, on CUDA where there is one (make gpu-test)
        if KERNELS in item.path.parents:
            item.add_marker(pytest.mark.kernels)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """GPU engines size their KV cache from the free memory, and tests leave engines in reference cycles
    (patched bound methods, helper classes): collect them before the next test, or the suite runs out of
    memory."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def engine():
    """The default model in float32 with the torch reference attention, on the CPU."""
    from engine.llm_engine import LLMEngine
    return LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8)


@pytest.fixture(scope="session")
def chat_prompts(engine):
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def workload(engine, chat_prompts):
    """helpers.pipeline_workload on the chat prompts and three more, its stop word and token taken from the
    free outputs."""
    import helpers
    from engine.requests.sequence import SamplingParams
    prompts = chat_prompts + [engine.apply_chat_template([{"role": "user", "content": p}])
                              for p in helpers.EXTRA_PROMPTS]
    free = engine.generate([prompts[2]], SamplingParams(max_tokens=24, temperature=0))[0]
    stop_word = free.text.split()[2]
    probe = engine.generate([prompts[3]], SamplingParams(max_tokens=16, temperature=0))[0]
    return helpers.pipeline_workload(prompts, stop_word, probe.output_token_ids[5])


@pytest.fixture(scope="module")
def guided_workload(engine):
    import helpers
    return helpers.guided_workload(engine)


@pytest.fixture(scope="module")
def client(server):
    """An openai client of the test module's own `server` fixture (tests/server/)."""
    from serving import api_client
    return api_client(server.url)


@pytest.fixture(scope="session")
def hf_model(engine):
    """Hugging Face transformers' Llama on the very weights the engine loaded."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(engine.source.path), dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_ids, new_tokens):
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def assert_no_leak(engine):
    assert engine.blocks.num_free == engine.blocks.num_blocks, "KV pages leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for pool in engine.scheduler.row_pools:
        assert len(pool) == pool.num_rows, f"{pool.field} rows leaked"


def prefill_logits(engine, ids, last: int = 0):
    """Logits of the last position after a one-shot prefill of `ids` (float32, on the host); with `last` = n, those
    of the last n positions [n, V] (position i's logits score token i + 1: one prefill of prompt + outputs[:-1]
    scores every output token)."""
    from engine.scheduler import ScheduledRow
    from engine.requests.sequence import SamplingParams, Sequence
    seq = Sequence(10**6, list(ids), SamplingParams(max_tokens=1), seed=0,
                   block_table=engine.blocks.allocate(engine.blocks.blocks_needed(len(ids), 0)))
    runner, slot = engine.runner, engine.runner.slots[0]
    try:
        runner.prepare(slot, [ScheduledRow(seq, 0, len(ids), True)])
        slot.upload()
        with torch.inference_mode():
            hidden = runner.program.forward(slot, slot.dev["input_ids"][:len(ids)], 1, len(ids), len(ids))
            logits = runner.model.compute_logits(hidden[-max(last, 1):]).float().cpu()
            return logits if last else logits[0]
    finally:
        engine.blocks.free(seq.block_table)
