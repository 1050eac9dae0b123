"""Speculative verification: greedy acceptance, and rejection sampling that keeps the target distribution.

The distribution tests are deterministic (hash noise, fixed generators); their bound is a chi-square test at
p = 0.001 on the tokens the target can emit (tokens it cannot must never appear), plus total variation
< 0.02, which always-accept, residual-free or off-by-one-position sampling break by far more."""
import pytest
import torch

from engine.sampling.sampler import filter_top_k_top_p
from engine.speculative.verify import PAD, greedy_accept, rejection_sample, target_probs

CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}   # 0.999 quantiles, by df


def _params(n, temp=1.0, k=0, p=1.0, step=0, seed0=0):
    return dict(temperature=torch.full((n,), temp), top_k=torch.full((n,), k, dtype=torch.int64),
                top_p=torch.full((n,), p), seeds=torch.arange(n, dtype=torch.int64) * 7919 + seed0,
                steps=torch.full((n,), step, dtype=torch.int64))


def _assert_distributed(tokens, p, what):
    """tokens [M] drawn independently from p [V]?"""
    m, v = tokens.numel(), p.numel()
    assert m >= 2000, f"{what}: only {m} samples"
    counts = torch.bincount(tokens, minlength=v).double()
    assert counts[p == 0].sum() == 0, f"{what}: emitted tokens the target cannot: {counts}"
    support = p > 0
    expected = p[support].double() * m
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    tv = 0.5 * (counts / m - p.double()).abs().sum().item()
    assert chi2 < CHI2_999[int(support.sum()) - 1] and tv < 0.02, f"{what}: chi2 {chi2:.1f} tv {tv:.4f} over {m}"


def _greedy_ref(drafts, logits, num_drafts):
    n, k = drafts.shape
    target = logits.argmax(-1)
    out_a, out_t = [], torch.full((n, k + 1), PAD)
    for r in range(n):
        a = 0
        while a < num_drafts[r] and drafts[r, a] == target[r, a]:
            a += 1
        out_a.append(a)
        out_t[r, :a + 1] = target[r, :a + 1]
    return torch.tensor(out_a), out_t


def _onehot_logits(ids, v):
    """[N, P] argmax ids -> [N, P, V] logits with that argmax."""
    return torch.nn.functional.one_hot(torch.as_tensor(ids), v).float() * 5


# ---- greedy_accept ---------------------------------------------------------------------------------------

def test_greedy_hand_built():
    logits = _onehot_logits([[3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1]], 8)
    drafts = torch.tensor([[3, 1, 4], [3, 2, 4], [5, 1, 4], [3, 1, 4], [3, 1, 4]])
    num_drafts = torch.tensor([3, 3, 3, 1, 0])
    a, t = greedy_accept(drafts, logits, num_drafts)
    assert a.tolist() == [3, 1, 0, 1, 0]
    assert t.tolist() == [[3, 1, 4, 1],          # all accepted: bonus from position 3
                          [3, 1, PAD, PAD],      # mismatch at 1: the target's token there
                          [3, PAD, PAD, PAD],
                          [3, 1, PAD, PAD],      # num_drafts 1 caps it: bonus from position 1
                          [3, PAD, PAD, PAD]]    # speculation off: plain argmax of position 0
    assert a.dtype == t.dtype == torch.int64


def test_greedy_matches_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 5):
        n, v = 200, 4                     # small vocab so long accepted runs happen
        logits = torch.randn(n, k + 1, v, generator=g)
        target = logits.argmax(-1)
        agree = torch.rand(n, k, generator=g) < 0.8
        drafts = torch.where(agree, target[:, :k], torch.randint(0, v, (n, k), generator=g))
        num_drafts = torch.randint(0, k + 1, (n,), generator=g)
        a, t = greedy_accept(drafts, logits, num_drafts)
        ra, rt = _greedy_ref(drafts, logits, num_drafts)
        assert torch.equal(a, ra) and torch.equal(t, rt)
        assert a.max() == k, "the random cases should include fully accepted rows"


# ---- rejection_sample: distribution -----------------------------------------------------------------------

P_LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -3.0],      # target at positions 0, 1, 2: all different
                         [-1.0, 0.0, 2.0, 0.3, 1.0, 0.0],
                         [0.0, 0.0, 0.0, 1.5, -2.0, 0.7]])
Q_PROBS = torch.tensor([[0.05, 0.05, 0.10, 0.40, 0.30, 0.10],   # drafter: far from the target
                        [0.30, 0.30, 0.05, 0.05, 0.10, 0.20],
                        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


def _stochastic_drafts(n, q, seed):
    """[n, K] drafts, each position drawn from q [K, V] with torch's own generator (not the verify hash)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(q.shape[0])], 1)


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_rejection_sample_keeps_target_distribution(num_drafts):
    n, k, v = 40000, 2, 6
    drafts = _stochastic_drafts(n, Q_PROBS[:k], seed=num_drafts)
    a, t = rejection_sample(drafts, Q_PROBS[:k].expand(n, k, v), P_LOGITS.expand(n, k + 1, v),
                            torch.full((n,), num_drafts), **_params(n, step=5))
    p = P_LOGITS.softmax(-1)
    assert 0.2 < (a > 0).float().mean() < 0.8, "both branches (accept, reject) should be exercised"
    _assert_distributed(t[:, 0], p[0], "first token")
    first_accepted = a >= 1
    _assert_distributed(t[first_accepted, 1], p[1], "second token given the first draft accepted")
    if num_drafts == 2:
        _assert_distributed(t[a == 2, 2], p[2], "bonus token after two accepted drafts")
    assert (t[:, num_drafts + 1:] == PAD).all()


def test_deterministic_drafter_keeps_target_distribution():
    n, v = 20000, 6
    p = P_LOGITS[:2].softmax(-1)
    for draft in (0, 3, 5):               # the target's favourite, a middling and its least likely token
        drafts = torch.tensor([[draft, 2]]).expand(n, 2)
        a, t = rejection_sample(drafts, None, P_LOGITS[:3].expand(n, 3, v), torch.full((n,), 2),
                                **_params(n, seed0=draft))
        _assert_distributed(t[:, 0], p[0], f"first token, draft {draft}")
        assert abs((a > 0).float().mean() - p[0, draft]) < 0.015, "accepts with probability p(draft)"
        if draft == 0:
            _assert_distributed(t[a >= 1, 1], p[1], "second token given the first accepted")


def test_top_k_top_p_target_and_disjoint_supports():
    # Target: top-k 4 keeps tokens 0-3, top-p 0.9 on their renormalized mass then drops token 3, at
    # temperature 0.7. The drafter puts mass on tokens the target forbids and none on token 0, which it keeps,
    # so both zero cases of p / q are hit.
    n, v = 40000, 8
    logits = torch.tensor([[3.0, 2.6, 2.2, 1.0, 0.9, 0.0, -1.0, -2.0]] * 2)
    q = torch.tensor([[0.0, 0.3, 0.1, 0.2, 0.2, 0.1, 0.1, 0.0]])
    top4 = (logits[0, :4] / 0.7).softmax(-1)
    assert top4[:3].sum() - top4[2] < 0.9 <= top4[:3].sum()          # mass before token 2 < 0.9, before 3 not
    expected = torch.zeros(v)
    expected[:3] = top4[:3] / top4[:3].sum()
    params = _params(n, temp=0.7, k=4, p=0.9)
    assert torch.allclose(target_probs(logits[None], params["temperature"][:1], params["top_k"][:1],
                                       params["top_p"][:1])[0, 0], expected, atol=1e-6)
    drafts = _stochastic_drafts(n, q, seed=3)
    a, t = rejection_sample(drafts, q.expand(n, 1, v), logits.expand(n, 2, v), torch.ones(n, dtype=torch.long),
                            **params)
    _assert_distributed(t[:, 0], expected, "first token under top-k / top-p")
    _assert_distributed(t[a == 1, 1], expected, "bonus under top-k / top-p")


def test_equal_draft_and_target_accepts_everything():
    n, k, v = 3000, 3, 6
    p = P_LOGITS.softmax(-1)
    drafts = _stochastic_drafts(n, p, seed=4)
    a, t = rejection_sample(drafts, p.expand(n, k, v), torch.cat([P_LOGITS, P_LOGITS[:1]]).expand(n, k + 1, v),
                            torch.full((n,), k), **_params(n))
    assert (a == k).all() and torch.equal(t[:, :k], drafts)
    assert ((t[:, k] >= 0) & (t[:, k] < v)).all()


# ---- rejection_sample: greedy rows, determinism, robustness -----------------------------------------------

def _random_case(n, k, v, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k + 1, v, generator=g) * 3
    q = torch.rand(n, k, v, generator=g).pow(3)
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(n, k)
    num_drafts = torch.randint(0, k + 1, (n,), generator=g)
    return drafts, q, logits, num_drafts


def test_temperature_zero_rows_are_greedy_accept():
    n, k, v = 64, 4, 16
    drafts, q, logits, num_drafts = _random_case(n, k, v, seed=1)
    drafts[::3] = logits[::3, :k].argmax(-1)          # some greedy rows accept runs
    params = _params(n)
    params["temperature"][::2] = 0.0
    ga, gt = greedy_accept(drafts, logits, num_drafts)
    for probs in (q, None):
        a, t = rejection_sample(drafts, probs, logits, num_drafts, **params)
        assert torch.equal(a[::2], ga[::2]) and torch.equal(t[::2], gt[::2])
        assert not torch.equal(t[1::2], gt[1::2]), "sampled rows should differ from greedy somewhere"


def test_row_outputs_do_not_depend_on_batch_or_padding():
    n, k, v = 32, 3, 16
    drafts, q, logits, num_drafts = _random_case(n, k, v, seed=2)
    params = _params(n, temp=0.9, k=8, p=0.95, step=11)
    params["steps"] += torch.arange(n)
    a, t = rejection_sample(drafts, q, logits, num_drafts, **params)
    for r in (0, 7, 31):
        sl = slice(r, r + 1)
        one = {name: x[sl] for name, x in params.items()}
        ra, rt = rejection_sample(drafts[sl], q[sl], logits[sl], num_drafts[sl], **one)
        assert ra.item() == a[r].item() and torch.equal(rt[0], t[r])
        # Padded to a larger K, garbage past num_drafts: same tokens, more PAD.
        pad = 2
        g = torch.Generator().manual_seed(r)
        d2 = torch.cat([drafts[sl], torch.randint(0, v, (1, pad), generator=g)], 1)
        d2[0, num_drafts[r]:] = torch.randint(0, v, (k + pad - num_drafts[r].item(),), generator=g)
        q2 = torch.cat([q[sl], torch.rand(1, pad, v, generator=g)], 1)
        l2 = torch.cat([logits[sl], torch.randn(1, pad, v, generator=g)], 1)
        l2[0, num_drafts[r] + 1:] = torch.randn(k + pad - num_drafts[r].item(), v, generator=g)
        pa, pt = rejection_sample(d2, q2, l2, num_drafts[sl], **one)
        assert pa.item() == a[r].item() and torch.equal(pt[0, :k + 1], t[r]) and (pt[0, k + 1:] == PAD).all()
    again = rejection_sample(drafts, q, logits, num_drafts, **params)
    assert torch.equal(again[0], a) and torch.equal(again[1], t)
    other = dict(params, seeds=params["seeds"] + 1)
    assert not torch.equal(rejection_sample(drafts, q, logits, num_drafts, **other)[1], t)


def test_no_nan_and_tokens_in_range_on_degenerate_inputs():
    n, k, v = 256, 3, 8
    drafts, q, logits, num_drafts = _random_case(n, k, v, seed=3)
    q[0:32] = 0.0
    q[0:32, :, 0] = 1.0                                   # q zero where p > 0
    drafts[0:32] = 0
    logits[32:64, :, 0] = float("-inf")                   # p zero where q > 0 (and the draft is that token)
    drafts[32:64] = 0
    params = _params(n, temp=0.8, k=3, p=0.9)
    q[64:96] = target_probs(logits[64:96, :k], *(params[x][64:96] for x in ("temperature", "top_k", "top_p")))
    g = torch.Generator().manual_seed(0)
    drafts[64:96] = torch.multinomial(q[64:96].reshape(-1, v), 1, generator=g).view(32, k)
    q[96:128, :, :] = 0.0                                 # q(x) = 0 for the drafted token itself
    logits[128:160] *= 1000                               # near one-hot target
    drafts[160:192, 0] = torch.arange(32) % 2 * (v + 3) - 1   # out-of-vocab drafts: -1 and v + 2
    params["temperature"][192:224] = 1e-5
    p = target_probs(logits, params["temperature"], params["top_k"], params["top_p"])
    for probs in (q, None):
        a, t = rejection_sample(drafts, probs, logits, num_drafts, **params)
        assert ((a >= 0) & (a <= num_drafts)).all()
        pos = torch.arange(k + 1)[None, :]
        live = pos <= a[:, None]
        assert ((t >= 0) & (t < v))[live].all() and (t[~live] == PAD).all()
        assert (p.gather(2, t.clamp(min=0)[..., None])[..., 0] > 0)[live].all(), "emitted a token with p = 0"
        assert (a[160:192] == 0).all(), "an out-of-vocab draft was accepted"
        assert probs is None or (a[64:96] == num_drafts[64:96]).all(), "p == q should accept every draft"


def test_argument_validation():
    n, k, v = 4, 2, 8
    d, q, lg, nd = torch.zeros(n, k, dtype=torch.long), torch.full((n, k, v), 1 / v), torch.zeros(n, k + 1, v), \
        torch.full((n,), k)
    params = _params(n)
    with pytest.raises(ValueError, match="K >= 1"):
        greedy_accept(torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 1, v), nd)
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept(d, torch.zeros(n, k, v), nd)
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_accept(d[0], lg, nd)
    with pytest.raises(ValueError, match="integer"):
        greedy_accept(d.float(), lg, nd)
    with pytest.raises(ValueError, match="num_drafts"):
        greedy_accept(d, lg, nd[:2])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(d, q[:, :, :4], lg, nd, **params)
    with pytest.raises(ValueError, match="top_p"):
        rejection_sample(d, q, lg, nd, **dict(params, top_p=torch.ones(n + 1)))
    with pytest.raises(ValueError, match="seeds"):
        rejection_sample(d, None, lg, nd, **dict(params, seeds=torch.zeros(n, 1, dtype=torch.long)))


def test_target_probs_is_the_samplers_distribution():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 10, generator=g)
    temp, top_k, top_p = torch.tensor([0.5, 1.0, 1.3]), torch.tensor([3, 0, 5]), torch.tensor([0.9, 1.0, 0.7])
    got = target_probs(logits, temp, top_k, top_p)
    for r in range(3):
        ref = filter_top_k_top_p(logits[r] / temp[r], top_k[r].repeat(2), top_p[r].repeat(2)).softmax(-1)
        assert torch.allclose(got[r], ref)


def _meta_or_cuda_case(device, n=5, k=3, v=16):
    drafts, q, logits, num_drafts = _random_case(n, k, v, seed=6)
    params = _params(n, temp=0.8, k=4, p=0.9)
    params["temperature"][0] = 0.0
    move = (lambda t: torch.empty_like(t, device="meta")) if device == "meta" else (lambda t: t.to(device))
    return (move(drafts), move(q), move(logits), move(num_drafts)), {name: move(x) for name, x in params.items()}


def test_no_data_dependent_host_ops_on_meta_tensors():
    # Meta tensors carry shapes but no data: .item(), .tolist(), .nonzero(), boolean-mask indexing and
    # `if tensor:` all raise on them, so fixed-shape outputs show the code never reads values.
    (drafts, q, logits, num_drafts), params = _meta_or_cuda_case("meta")
    for probs in (q, None):
        a, t = rejection_sample(drafts, probs, logits, num_drafts, **params)
        assert a.shape == (5,) and t.shape == (5, 4) and t.device.type == "meta"
    a, t = greedy_accept(drafts, logits, num_drafts)
    assert a.shape == (5,) and t.shape == (5, 4)
    with pytest.raises((RuntimeError, NotImplementedError)):
        a.sum().item()          # the probe works: data-dependent ops do fail on meta


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_sync_and_graph_capture_on_cuda():
    (drafts, q, logits, num_drafts), params = _meta_or_cuda_case("cuda")
    want = rejection_sample(drafts, q, logits, num_drafts, **params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = rejection_sample(drafts, q, logits, num_drafts, **params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
