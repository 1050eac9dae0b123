"""engine.kernels.sampling.argmax.masked_argmax (a greedy guided step's tokens from its logits, grammar mask and
forced tokens) against what the step did before it: the sampler's greedy answer on the float32 logits with the
bitmask, then the forced tokens. And which steps take it. Without CUDA the kernels run in the Triton CPU
interpreter (tests/conftest.py)."""
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_no_leak
from engine.runner.step import StepProgram, StepVariant, forced as force
from engine.sampling.sampler import NO_TOKEN, sample

from test_argmax import DEV, DTYPES, am, blocks  # noqa: F401 - blocks: the narrow-block fixture, shared

# SmolLM2's tokenizer: the staged model where there is one (the GPU machine has no index to fetch it from)
DEFAULT_TOKENIZER = os.environ.get("SPECDEC_MODEL") or "default"


def reference(x, mask, forced_ids):
    zeros = torch.zeros(x.shape[0], device=x.device)
    ones = torch.ones(x.shape[0], device=x.device)
    steps = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    tokens = sample(x.float().clone(), zeros, steps, ones, steps, steps, bitmask=mask, all_greedy=True)
    return force(tokens, forced_ids)


def random_case(m, v, seed, dtype, density):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=g).to(dtype)
    words = -(-v // 32) + 1                                      # a spare word: bits past V must not count
    bits = torch.rand(m, words * 32, generator=g) < density
    mask = (bits.view(m, words, 32).long() << torch.arange(32)).sum(-1)
    mask = torch.where(mask >= 2 ** 31, mask - 2 ** 32, mask).to(torch.int32)
    forced_ids = torch.full((m,), -1, dtype=torch.int64)
    return x.to(DEV), mask.to(DEV), forced_ids.to(DEV)


@DTYPES
@pytest.mark.parametrize("m,v,density", [(1, 7, 0.5), (4, 300, 0.02), (3, 531, 0.3), (6, 157, 0.9)])
def test_equals_the_samplers_masked_greedy(dtype, m, v, density, blocks):
    x, mask, forced_ids = random_case(m, v, m * v, dtype, density)
    forced_ids[::3] = torch.arange(0, m, 3, device=DEV)       # every third row forced
    got = am.masked_argmax(x, mask, forced_ids)
    assert got.dtype == torch.int64 and got.shape == (m,)
    assert torch.equal(got, reference(x, mask, forced_ids))
    unforced = torch.full_like(forced_ids, -1)
    assert torch.equal(am.masked_argmax(x, mask), reference(x, mask, unforced))     # forced None: none


def test_empty_masks_forced_tokens_and_ties(blocks):
    """A row allowing nothing gets NO_TOKEN (unless forced); a forced token wins over everything, even a
    disallowed one; the first of tied allowed maxima wins; a larger disallowed logit never does; bits past V
    are ignored."""
    v = 70
    x, mask, forced_ids = random_case(6, v, 3, torch.float32, 0.0)
    x[0, [5, 40]] = 9.0                  # row 0: 5 and 40 tie at the top, both allowed
    mask[0, 0], mask[0, 1] = 1 << 5, 1 << (40 - 32)
    x[1, 3] = 50.0                       # row 1: the largest logit is disallowed; 60 is the only allowed
    mask[1, 60 // 32] = 1 << (60 % 32)
    mask[2, 2] = 1 << (v - 64)           # row 2: column v (one past the vocabulary) only: nothing allowed
    forced_ids[3] = 11                   # row 3: nothing allowed, forced
    forced_ids[4] = 2                    # row 4: everything allowed, forced to a column that is not the argmax
    mask[4] = -1
    mask[5, 1] = 1 << 2                  # row 5: a NaN at an allowed column beats every number
    x[5, 34] = float("nan")
    got = am.masked_argmax(x, mask, forced_ids)
    assert got.tolist() == [5, 60, NO_TOKEN, 11, 2, 34]
    assert torch.equal(got, reference(x, mask, forced_ids))


def test_bad_inputs():
    x = torch.zeros(2, 40, device=DEV)
    mask = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    forced_ids = torch.full((2,), -1, dtype=torch.int64, device=DEV)
    assert am.masked_argmax(x[:0], mask[:0], forced_ids[:0]).shape == (0,)
    with pytest.raises(ValueError, match="at least 2 words"):
        am.masked_argmax(x, mask[:, :1], forced_ids)
    with pytest.raises(ValueError, match="must be a contiguous"):
        am.masked_argmax(x, mask, forced_ids[:1])
    with pytest.raises(TypeError, match="bitmask dtype"):
        am.masked_argmax(x, mask.long(), forced_ids)
    with pytest.raises(TypeError, match="forced dtype"):
        am.masked_argmax(x, mask, forced_ids.int())
    with pytest.raises(ValueError, match="unit stride"):
        am.masked_argmax(x, torch.zeros(4, 2, dtype=torch.int32, device=DEV).t(), forced_ids)


@pytest.mark.parametrize("variant,world,reference_table,taken", [
    ((True, True, False), 1, False, True), ((False, True, False), 1, False, False),
    ((True, False, False), 1, False, False), ((True, True, True), 1, False, False),
    ((True, True, False), 2, False, False), ((True, True, False), 1, True, False)],
    ids=["guided-greedy", "unguided", "sampled", "extras", "tp2", "reference"])
def test_only_greedy_guided_steps_on_one_rank_take_it(variant, world, reference_table, taken):
    """The reference route table (and a backend without the kernels, the torch one) keeps the sampler's path."""
    program = SimpleNamespace(model=SimpleNamespace(tp=SimpleNamespace(world=world)),
                              backend=SimpleNamespace(masks_greedy=lambda hidden: not reference_table))
    assert StepProgram.masked_greedy(program, torch.zeros(2, 8), StepVariant(*variant)) is taken
    program.backend = SimpleNamespace()
    assert StepProgram.masked_greedy(program, torch.zeros(2, 8), StepVariant(*variant)) is False


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("spec", [{}, dict(speculative="ngram", num_speculative_tokens=3),
                                  dict(speculative="eagle", spec_head="random", num_speculative_tokens=2, spec_tree=5,
                                       spec_min_acceptance=0.0)], ids=["plain", "ngram", "eagle-tree"])
def test_engine_guided_outputs_equal_the_samplers(spec, monkeypatch):
    """A two-layer model of SmolLM2's vocabulary, guided greedy (closing at a budget of 24 tokens forces some
    tokens): the routed backend's steps take masked_argmax and give the torch backend's tokens, which sample from
    float32 logits. Matmuls on cuBLAS on both sides, so only the sampling differs. With n-gram drafts the
    verification's positions take it too (the random model repeats itself, so drafts are accepted), and so do a draft
    tree's inputs under a random head (its verification of guided rows through the kernel's NO_TOKEN and masks)."""
    from engine.kernels.routes import pins
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    calls, real = [], am.masked_argmax
    monkeypatch.setattr(am, "masked_argmax", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    if am.interpreted():        # 3 kernel-1 programs a row, not 48: the interpreter's cost is per program
        monkeypatch.setattr(am, "BLOCK_V", 16384)
    params = [SamplingParams(max_tokens=24, temperature=0.0, json_schema=SCHEMA),
              SamplingParams(max_tokens=32, temperature=0.0, json_schema={"type": "array", "items": SCHEMA})]
    outputs = {}
    for backend in ("torch", "triton"):
        routes = dict(kernel_routes=pins(dict(kernel="cublas"))) if backend == "triton" else {}
        eng = LLMEngine(model="dummy:smollm2-tiny", tokenizer=DEFAULT_TOKENIZER, device=DEV, dtype="float32",
                        attention_backend=backend, max_num_seqs=4, max_model_len=256, **routes, **spec)
        prompts = [eng.apply_chat_template([{"role": "user", "content": c}])
                   for c in ("Describe a cat as JSON.", "List two people as JSON.")]
        outs = eng.generate(prompts, params)
        outputs[backend] = [(o.output_token_ids, o.finish_reason) for o in outs]
        if spec:
            assert spec.get("spec_tree") or sum(o.spec.accepted for o in outs if o.spec is not None) > 0
            assert backend == "torch" or max(calls) >= 4   # two requests: only a verification has 4 rows or more
        assert_no_leak(eng)
        assert (len(calls) > 0) == (backend == "triton")
    assert outputs["triton"] == outputs["torch"]
    assert all(reason == "stop" for _, reason in outputs["torch"])
