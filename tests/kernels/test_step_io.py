"""engine.kernels.step_io (a plain step's input ids + embedding, a speculative step's embedding, and its emit, one
kernel each) against the torch code they replace (TokenPool.carried + the embedding lookup; the slot copy +
TokenPool.emit), bit for bit, and whole engines with Tuning.step_io_kernels on against off. Without CUDA the
kernels run in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leak, triton_module
from helpers import INTERPRETER_SETTINGS, greedy_drafts
from engine.memory.token_pool import TokenPool

io = triton_module("step_io")
DEV = "cpu" if io.interpreted() else "cuda"
ROWS, VOCAB = 6, 50


def _pool(g):
    pool = TokenPool(ROWS, 0, torch.device(DEV))
    pool.last_token.copy_(torch.randint(0, VOCAB, (ROWS + 1,), generator=g))
    return pool


def _step(g, n):
    """A slot's input tensors for n tokens, 3 entries longer than the step: host ids, carry sources (-1 the host's,
    0 the pool's) and pool rows, -1 (graph padding: the dummy row) among them."""
    m = n + 3
    return (torch.randint(0, VOCAB, (m,), generator=g), torch.randint(-1, 1, (m,), generator=g),
            torch.randint(-1, ROWS, (m,), generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hidden,carry", [(1, 64, True), (7, 96, True), (5, 2500, True), (4, 64, False),
                                            (0, 64, True)])
def test_inputs_equal_the_pools_carry_and_the_embedding(n, hidden, carry, dtype):
    g = torch.Generator().manual_seed(n * 31 + hidden)
    pool = _pool(g)
    ids_in, src, rows = (t.to(DEV) for t in _step(g, n))
    weight = torch.randn(VOCAB, hidden, generator=g).to(DEV, dtype)
    ids, x = io.inputs(ids_in, src, rows, pool.last_token, weight, n, carry)
    want = pool.carried(ids_in[:n], src[:n], rows[:n]) if carry else ids_in[:n]
    assert ids.dtype == torch.int64 and torch.equal(ids, want)
    assert x.dtype == dtype and torch.equal(x, F.embedding(want, weight))      # hidden 2500: three column chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hidden", [(1, 64), (7, 96), (5, 2500), (0, 64)])
def test_embed_equals_the_embedding(n, hidden, dtype):
    g = torch.Generator().manual_seed(n * 17 + hidden)
    ids = torch.randint(0, VOCAB, (n + 2,), generator=g).to(DEV)[1:n + 1]   # a view at an offset
    weight = torch.randn(VOCAB, hidden, generator=g).to(DEV, dtype)
    before = ids.clone()
    x = io.embed(ids, weight)
    assert x.dtype == dtype and torch.equal(x, F.embedding(ids, weight)) and torch.equal(ids, before)


@pytest.mark.parametrize("n", [1, 5, 1100])
def test_emit_equals_the_slot_copy_and_the_pools_emit(n):
    """Tokens into `sampled` and each row's last token, clamped to 0 (a failed row's -1); rows -1 write the dummy
    row, which nothing reads, so only the real rows (distinct, as a step's sequences are) are compared there."""
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(-1, VOCAB, (n,), generator=g).to(DEV)
    real = torch.randperm(ROWS, generator=g)[:min(n, ROWS)]
    rows = torch.full((n,), -1, dtype=torch.int64)
    rows[torch.randperm(n, generator=g)[:real.numel()]] = real
    rows = rows.to(DEV)
    ref, got = _pool(torch.Generator().manual_seed(1)), _pool(torch.Generator().manual_seed(1))
    sampled_ref = torch.full((n + 2,), 7, dtype=torch.int64, device=DEV)
    sampled = sampled_ref.clone()
    sampled_ref[:n] = tokens
    ref.emit(rows, tokens)
    io.emit(tokens, sampled, rows, got.last_token)
    assert torch.equal(sampled, sampled_ref)                                   # entries past n untouched
    assert torch.equal(got.last_token[:ROWS], ref.last_token[:ROWS])
    assert got.last_token[ROWS].item() >= 0


def test_refusals():
    weight = torch.zeros(VOCAB, 8, device=DEV)
    ids = torch.zeros(4, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="carry_src has 4 entries, the step uses 5"):
        io.inputs(torch.zeros(5, dtype=torch.int64, device=DEV), ids, ids, ids, weight, 5)
    with pytest.raises(TypeError, match="tok_row dtype"):
        io.inputs(ids, ids, ids.int(), ids, weight, 4)
    with pytest.raises(TypeError, match="weight dtype"):
        io.inputs(ids, ids, ids, ids, weight.long(), 4)
    with pytest.raises(TypeError, match="ids dtype"):
        io.embed(ids.int(), weight)
    with pytest.raises(ValueError, match="sampled has 2 entries, the step uses 4"):
        io.emit(ids, ids[:2], ids, ids)
    with pytest.raises(TypeError, match="tokens dtype"):
        io.emit(ids.float(), ids, ids, ids)


@pytest.mark.parametrize("depth", [1, 2])
def test_engine_outputs_equal_with_step_io_kernels(depth):
    """step_io_kernels on gives step_io_kernels off's greedy tokens, in eager steps and (CUDA) graphs, with
    prompts in chunks."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    prompts = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2], list(range(40, 71)), [11] * 5]
    out = {}
    for on in (False, True):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton", depth=depth,
                        max_num_seqs=4, max_model_len=256, max_num_batched_tokens=16, step_io_kernels=on)
        assert eng.runner.program.step_io is (io if on else None)
        params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in (9, 4, 12, 6)]
        out[on] = [s.output_token_ids for s in eng.generate(prompts, params)]
        assert_no_leak(eng)
    assert out[True] == out[False]


def test_speculative_engine_embeds_with_the_kernel(monkeypatch):
    """An EAGLE engine (an untrained head, Triton backend): step_io_kernels on embeds its spec steps' corrected inputs
    with `embed` and gives the drafts and greedy outputs of step_io_kernels off."""
    from engine.llm_engine import LLMEngine
    calls = []
    real = io.embed
    monkeypatch.setattr(io, "embed", lambda ids, weight: calls.append(ids.shape[0]) or real(ids, weight))
    prompts = [[5, 17, 99, 3, 250, 42, 7, 5, 17, 99], [300, 1, 2, 300, 1]]
    runs = {}
    for on in (False, True):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, max_num_seqs=4, max_model_len=64, enforce_eager=True,
                        speculative="eagle", spec_head="random", num_speculative_tokens=2, spec_min_acceptance=0.0,
                        step_io_kernels=on)
        runs[on] = greedy_drafts(eng, prompts, (6, 5))
        assert_no_leak(eng)
        assert runs[on][1] and bool(calls) == on
    assert runs[True] == runs[False]
