"""engine.kernels.sampling.topk (a draft tree's candidates, two kernels) against a stable sort of the logits: larger
first, the lower column first among equal values, NaN above every number. Without CUDA the kernels run in the Triton
CPU interpreter (tests/conftest.py)."""
import pytest
import torch

from conftest import triton_module

tk = triton_module("sampling.topk")
DEV = "cpu" if tk.interpreted() else "cuda"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(params=["wide", "narrow"])
def blocks(request, monkeypatch):
    """"narrow": 16 logits a kernel-1 program, so rows span many programs with ragged tails."""
    if request.param == "narrow":
        monkeypatch.setattr(tk, "BLOCK_V", 16)


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def reference(x, n):
    """The order top_rows gives: a stable sort of -x (NaN as +inf)."""
    x = x.float()
    x = torch.where(x.isnan(), torch.inf, x)
    return (-x).sort(dim=-1, stable=True).indices[:, :n]


@DTYPES
@pytest.mark.parametrize("m,v,n", [(1, 7, 7), (4, 300, 5), (3, 1031, 16), (2, 2100, 32), (5, 257, 1)])
def test_equals_a_stable_sort_and_torch_topk(dtype, m, v, n, blocks):
    x = randn(m, v + 3, seed=m + v, dtype=dtype)[:, 1:1 + v]        # rows strided past V, unit stride in V
    got = tk.top_rows(x, n)
    assert got.dtype == torch.int64 and got.shape == (m, n)
    assert torch.equal(got, reference(x, n))
    if dtype == torch.float32:                  # distinct values: torch.topk's answer too
        assert torch.equal(got, x.float().topk(n, dim=-1).indices)


def test_ties_nan_and_minus_infinity(blocks):
    """Equal values in one program and across programs give the lower column first; a NaN ranks first; a row of
    -inf still gives its n first columns."""
    x = torch.full((3, 40), -1.0, device=DEV)
    x[0, [5, 17, 33]] = 2.0
    x[0, [2, 30]] = 3.0
    x[1, 9] = float("nan")
    x[1, 20] = 5.0
    x[2] = float("-inf")
    got = tk.top_rows(x, 6)
    assert got[0].tolist() == [2, 30, 5, 17, 33, 0]
    assert got[1].tolist()[:2] == [9, 20] and torch.equal(got, reference(x, 6))
    assert got[2].tolist() == list(range(6))


def test_ids_map_columns_to_tokens(blocks):
    x = randn(4, 500, seed=3)
    ids = torch.randperm(50_000, device=DEV)[:500]
    assert torch.equal(tk.top_rows(x, 8, ids), ids[reference(x, 8)])


def test_bad_calls_are_refused():
    x = randn(2, 50, seed=0)
    with pytest.raises(ValueError, match="n must be"):
        tk.top_rows(x, 0)
    with pytest.raises(ValueError, match="n must be"):
        tk.top_rows(x, 51)
    with pytest.raises(ValueError, match="ids"):
        tk.top_rows(x, 3, torch.arange(49, device=DEV))
    assert tk.supports(x.device, 50, 3) and not tk.supports(x.device, 50, tk.MAX_N + 1)
    assert not tk.supports(x.device, 2, 3) and not tk.supports(x.device, tk.MAX_PARTIALS * tk.BLOCK_V, 2)


_TREE_PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [8, 1, 64, 64, 2]]
_TREE_OUTPUTS: dict = {}


@pytest.mark.parametrize("vocab", ["none", "ranked"])
def test_a_tree_engine_drafts_its_candidates_through_the_kernels(vocab, monkeypatch, tmp_path):
    """An EAGLE tree engine on the routed backend (a random head on a two-layer model of SmolLM2's vocabulary),
    drafting from the whole vocabulary or a ranked draft vocabulary: every depth's candidates come from top_rows
    (one call a depth a drafting step), and greedy output equals the plain engine's on the same backend."""
    import json

    from conftest import assert_no_leak
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    calls, real = [], tk.top_rows
    monkeypatch.setattr(tk, "top_rows", lambda x, n, ids=None: calls.append((n, ids is not None)) or real(x, n, ids))
    ranks = tmp_path / "ranks.json"
    ranks.write_text(json.dumps(list(range(0, 49152, 7))))
    draft = dict(spec_draft_vocab="none") if vocab == "none" else dict(spec_draft_vocab=str(ranks),
                                                                      spec_draft_vocab_size=2048)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", {}), ("tree", dict(speculative="eagle", spec_head="random", num_speculative_tokens=2,
                                                    spec_tree=5, spec_min_acceptance=0.0, **draft))):
        if name in _TREE_OUTPUTS:       # the plain engine's outputs, the same for both draft vocabularies
            outs[name] = _TREE_OUTPUTS[name]
            continue
        eng = LLMEngine(model="dummy:smollm2-tiny", device=DEV, dtype="float32", attention_backend="triton",
                        max_num_seqs=2, max_model_len=128, **spec)
        outs[name] = [o.output_token_ids for o in eng.generate(_TREE_PROMPTS, params)]
        assert_no_leak(eng)
    _TREE_OUTPUTS["plain"] = outs["plain"]
    assert outs["tree"] == outs["plain"]
    assert calls and {ids for _, ids in calls} == {vocab == "ranked"} and {n for n, _ in calls} <= {1, 2, 3, 4}
