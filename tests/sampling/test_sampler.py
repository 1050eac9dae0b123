"""Sampling: seeds reproduce, top-k/top-p stay inside their sets, bitmasks are obeyed."""
import pytest
import torch

from engine.requests.sequence import SamplingParams
from engine.sampling.sampler import NO_TOKEN, apply_bitmask, filter_top_k_top_p, sample, uniform_noise, unit_interval


def _args(n, temp=1.0, k=0, p=1.0, seed=7, step=0):
    return (torch.full((n,), temp), torch.full((n,), k, dtype=torch.int64), torch.full((n,), p),
            torch.full((n,), seed, dtype=torch.int64), torch.full((n,), step, dtype=torch.int64))


def test_noise_is_uniform_and_deterministic():
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 50000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u, uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 50000))
    assert not torch.equal(u[0], u[1])


def test_noise_never_reaches_zero_or_one():
    u = unit_interval(torch.tensor([0, 1, 511, 512, 2**32 - 512, 2**32 - 1], dtype=torch.int64))
    assert (u > 0).all() and (u < 1).all() and torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()


def test_masked_tokens_never_sampled_over_many_draws():
    # A uniform of exactly 1 made 0 / 0 = NaN in the exponential race: a masked token won ~1 row in 300.
    n, vocab = 256, 50000
    allowed = torch.tensor([3, 77, 4000, 31111, 49999])
    mask = torch.zeros(n, (vocab + 31) // 32, dtype=torch.int32)
    for t in allowed.tolist():
        mask[:, t // 32] |= 1 << (t % 32)
    for step in range(8):
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(step)) * 4
        temp, k, p, _, steps = _args(n, temp=0.8, step=step)
        seeds = torch.arange(n, dtype=torch.int64) * 7919 + step
        toks = sample(logits, temp, k, p, seeds, steps, bitmask=mask)
        assert torch.isin(toks, allowed).all(), toks[~torch.isin(toks, allowed)]


def test_seed_reproducible_and_batch_independent():
    logits = torch.randn(4, 1000)
    a = sample(logits.clone(), *_args(4, seed=123))
    b = sample(logits.clone(), *_args(4, seed=123))
    assert torch.equal(a, b)
    solo = sample(logits[2:3].clone(), *_args(1, seed=123))
    assert solo.item() == a[2].item()
    draws = {sample(logits[:1].clone(), *_args(1, seed=s)).item() for s in range(40)}
    assert len(draws) > 1, "different seeds should give different draws on a flat distribution"


def test_sampling_follows_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(4000, 1)
    temp, k, p, _, steps = _args(4000)
    seeds = torch.arange(4000)
    counts = torch.bincount(sample(logits, temp, k, p, seeds, steps), minlength=3).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts


def test_top_k_never_leaves_the_set():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=gen)
    top5 = logits.topk(5).indices
    for seed in range(20):
        out = sample(logits.clone(), *_args(64, k=5, seed=seed))
        assert (top5 == out[:, None]).any(dim=1).all()


def test_top_p_never_leaves_the_nucleus():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 300, generator=gen) * 3
    probs = logits.softmax(-1)
    sorted_p, idx = probs.sort(descending=True)
    for seed in range(20):
        out = sample(logits.clone(), *_args(32, p=0.6, seed=seed))
        for r in range(32):
            rank = (idx[r] == out[r]).nonzero().item()
            assert sorted_p[r, :rank].sum() < 0.6          # mass strictly above it was below p


def test_top_k_top_p_filter_keeps_at_least_one():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    out = filter_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1e-6]))
    assert torch.isfinite(out).sum() == 1 and torch.isfinite(out[0, 0])


def test_top_p_one_keeps_the_tail_the_float_cumsum_saturates_on():
    """One dominant logit: float32's cumulative mass reaches 1 before the tail; p = 1 (and k = 0) keeps every token,
    so skipping the filter where no row filters changes no draw."""
    logits = torch.tensor([[30.0] + [0.0] * 63])
    probs = logits.softmax(-1)
    assert (probs.cumsum(-1) - probs)[0, -1] >= 1.0                     # the case the rule is for
    out = filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1.0]))
    assert torch.equal(out, logits)
    assert torch.isinf(filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.999]))[0, 1:]).all()


def test_sampling_without_filtering_rows_skips_the_filter_and_draws_the_same(monkeypatch):
    import engine.sampling.sampler as sampler
    torch.manual_seed(0)
    logits, temp = torch.randn(4, 500) * 3, torch.full((4,), 0.9)
    seeds, steps = torch.arange(4), torch.arange(4) + 10
    with monkeypatch.context() as m:                  # the filter forced, as on CUDA
        m.setattr(sampler, "may_filter", lambda *a: True)
        filtered = sample(logits.clone(), temp, torch.zeros(4, dtype=torch.long), torch.ones(4), seeds, steps)
    calls = []
    real = sampler.filter_top_k_top_p
    monkeypatch.setattr(sampler, "filter_top_k_top_p", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(sample(logits.clone(), temp, torch.zeros(4, dtype=torch.long), torch.ones(4), seeds, steps),
                       filtered) and calls == []
    sample(logits.clone(), temp, torch.tensor([0, 0, 5, 0]), torch.ones(4), seeds, steps)
    sample(logits.clone(), temp, torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 0.9, 1.0, 1.0]), seeds, steps)
    assert calls == [1, 1]


def test_greedy_rows_ignore_noise():
    logits = torch.randn(3, 100)
    temp = torch.tensor([0.0, 0.0, 0.0])
    out = sample(logits.clone(), temp, *_args(3)[1:])
    assert torch.equal(out, logits.argmax(-1))


def test_bitmask_blocks_tokens():
    vocab = 70
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 10.0                                     # preferred, but masked out below
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 1] = 1 << 5                                     # allow token 37 only
    apply_bitmask(logits, mask)
    assert torch.isfinite(logits).sum() == 1 and logits.argmax().item() == 37


@pytest.mark.parametrize("all_greedy", [True, False])
def test_a_row_whose_mask_allows_nothing_gets_no_token_and_spares_the_others(all_greedy):
    """Before, such a row was all -inf: argmax gave token 0 silently (and softmax NaN when sampling)."""
    vocab = 70
    logits = torch.randn(3, vocab)
    mask = torch.zeros(3, 3, dtype=torch.int32)
    mask[0, 1] = 1 << 5                                     # row 0: token 37 only
    mask[2] = -1                                            # row 2: everything; row 1: nothing
    temp = torch.tensor([0.0, 0.8, 0.8])
    out = sample(logits.clone(), temp, *_args(3)[1:], bitmask=mask, all_greedy=all_greedy)
    assert out[0].item() == 37 and out[1].item() == NO_TOKEN and 0 <= out[2].item() < vocab
    masked = logits.clone()
    assert apply_bitmask(masked, mask).tolist() == [True, False, True]
    assert torch.isfinite(masked[1]).all(), "an unsatisfiable row is left unmasked: no NaN downstream"


def test_bad_sampling_params():
    for kw in ({"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
               {"top_k": -1}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
