"""Verification of drafted tokens against the target model: greedy acceptance and lossless speculative
(rejection) sampling, Leviathan et al. 2023 / Chen et al. 2023.

Shapes: N rows, K >= 1 draft positions, vocab V. A row drafts num_drafts[r] in [0, K] tokens (0: speculation
off for that row); the target scored K + 1 positions, position i being the distribution of the token after
the row's context plus drafts[:i]. Each row emits num_accepted + 1 tokens: its accepted drafts, then the
target's token at the first rejection (or the bonus token after the last draft). Positions after those hold
PAD. All of it is batched tensor code with no host sync, so it can live inside a CUDA graph.

Randomness (rejection_sample) is engine.sampling.sampler's counter hash of (seed, output index, token id) on two
streams of its own, picked by salting the seed: one uniform per position for accept / reject, and one
exponential per (position, token) for the race that samples the residual or bonus token.
Invariant: a row's outputs are a pure function of its own inputs, seed and step: they do not depend on the
other rows of the batch, on its place in it, or on K (a row padded to a larger K with the same num_drafts
gives the same tokens). Inputs past a row's num_drafts (drafts, draft probs, target positions > num_drafts)
are never read. Position i draws at output index steps + i, so the tokens up to the first rejection at
position i are the same whatever is drafted after position i.
Not invariant: the emitted tokens are not those engine.sampling.sampler.sample would draw for the same seed and
step (only their distribution is the same), and they change with the drafter's proposals, hence with K or
num_drafts whenever the row would have accepted past the shorter draft.
Drafters must not draw from the two salted streams here: the accept / residual draws have to be
independent of the drafts for the sampling to be lossless. engine.sampling.sampler.sample on the request's own
seed is a different stream.
"""
from __future__ import annotations

import torch

from engine.sampling.sampler import NO_TOKEN, filter_top_k_top_p, may_filter, uniform_noise

PAD = NO_TOKEN                  # -1, in tokens[:, num_accepted + 1:]
_ACCEPT_SALT = 0x5BD1E995       # seed ^ salt picks a hash stream apart from sample()'s and from each other
_RESIDUAL_SALT = 0x27D4EB2F


def _check(draft_tokens, target_logits, num_drafts, draft_probs=None, per_row=()):
    """Validate shapes (host metadata only, no sync). Returns N, K, V."""
    n, k = _check_drafts(draft_tokens)
    if target_logits.dim() != 3 or target_logits.shape[:2] != (n, k + 1):
        raise ValueError(f"target_logits must be [N, K + 1, V] = [{n}, {k + 1}, V], "
                         f"got shape {tuple(target_logits.shape)}")
    v = target_logits.shape[2]
    if v < 1:
        raise ValueError("target_logits has an empty vocab")
    if draft_probs is not None and tuple(draft_probs.shape) != (n, k, v):
        raise ValueError(f"draft_probs must be [N, K, V] = [{n}, {k}, {v}], got shape {tuple(draft_probs.shape)}")
    _check_rows(n, (("num_drafts", num_drafts),) + tuple(per_row))
    return n, k, v


def _check_drafts(draft_tokens) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [N, K], got shape {tuple(draft_tokens.shape)}")
    if not _is_int(draft_tokens):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    n, k = draft_tokens.shape
    if k < 1:
        raise ValueError(f"need K >= 1 draft positions, got K = {k}")
    return n, k


def _check_rows(n: int, per_row) -> None:
    for name, t in per_row:
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} must be [N] = [{n}], got shape {tuple(t.shape)}")


def _is_int(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype == torch.bool)


def _accepted(accept: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """accept [N, K] bool -> [N] int64: length of the leading run of True, capped at num_drafts."""
    pos = torch.arange(accept.shape[1], device=accept.device)
    accept = accept & (pos[None, :] < num_drafts[:, None])
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _emit(draft_tokens, num_accepted, final):
    """[N, K + 1]: draft_tokens[:, :a], then final[:, a] at position a, then PAD."""
    n, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    drafts = torch.cat([draft_tokens.long(), draft_tokens.new_full((n, 1), PAD, dtype=torch.long)], dim=1)
    a = num_accepted[:, None]
    return torch.where(pos < a, drafts, torch.where(pos == a, final, PAD))


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_drafts: torch.Tensor):
    """draft_tokens [N, K] int64, target_logits [N, K + 1, V], num_drafts [N] int64 in [0, K]
    -> (num_accepted [N] int64, tokens [N, K + 1] int64): greedy_accept_ids on the logits' argmax."""
    _check(draft_tokens, target_logits, num_drafts)
    return greedy_accept_ids(draft_tokens, target_logits.argmax(dim=-1), num_drafts)


def greedy_accept_ids(draft_tokens: torch.Tensor, target_ids: torch.Tensor, num_drafts: torch.Tensor):
    """draft_tokens [N, K] int64, target_ids [N, K + 1] int64 (the target's argmax at each position),
    num_drafts [N] int64 in [0, K] -> (num_accepted [N] int64, tokens [N, K + 1] int64).

    A draft is accepted while it equals the target's argmax; tokens[:, a] is the target's argmax at the first
    mismatch, or the bonus token after num_drafts accepted drafts. num_drafts 0 gives plain argmax of
    position 0."""
    n, k = _check_drafts(draft_tokens)
    if tuple(target_ids.shape) != (n, k + 1) or not _is_int(target_ids):
        raise ValueError(f"target_ids must be an integer [N, K + 1] = [{n}, {k + 1}], got {target_ids.dtype} "
                         f"of shape {tuple(target_ids.shape)}")
    _check_rows(n, (("num_drafts", num_drafts),))
    num_drafts = num_drafts.clamp(0, k)
    target = target_ids.long()
    num_accepted = _accepted(draft_tokens == target[:, :k], num_drafts)
    return num_accepted, _emit(draft_tokens, num_accepted, target)


def target_probs(target_logits, temperature, top_k, top_p):
    """target_logits [N, P, V] -> [N, P, V] float32: softmax(filter_top_k_top_p(logits / temperature)), the
    distribution engine.sampling.sampler.sample draws from (temperature clamped like there; meaningless for
    temperature 0 rows, which are greedy)."""
    n, p, v = target_logits.shape
    scaled = target_logits.float().reshape(n * p, v) / _per_position(temperature.clamp(min=1e-6), p)[:, None]
    if may_filter(top_k, top_p):
        scaled = filter_top_k_top_p(scaled, _per_position(top_k, p), _per_position(top_p, p))
    return scaled.softmax(dim=-1).view(n, p, v)


def _per_position(t: torch.Tensor, positions: int) -> torch.Tensor:
    """[N] -> [N * positions], each row's value repeated for its positions (row-major, as reshape)."""
    return t[:, None].expand(t.shape[0], positions).reshape(-1)


def _draws(seeds, steps, positions, vocab, salt):
    """[N, positions, vocab] uniforms in (0, 1) of (seed ^ salt, steps + position, token id)."""
    idx = steps[:, None] + torch.arange(positions, device=steps.device)[None, :]
    noise = uniform_noise(_per_position(seeds ^ salt, positions), idx.reshape(-1), vocab)
    return noise.view(seeds.shape[0], positions, vocab)


def rejection_sample(draft_tokens, draft_probs, target_logits, num_drafts, temperature, top_k, top_p, seeds,
                     steps):
    """Lossless speculative sampling: each row's emitted tokens are distributed exactly as sampling the
    target one token at a time with engine.sampling.sampler.sample's distribution.

    draft_tokens [N, K] int64; draft_probs [N, K, V] float, the distribution each draft was drawn from (after
    the drafter's own temperature / top-k / top-p), or None for a deterministic drafter (n-gram, greedy draft
    model: q one-hot at the draft); target_logits [N, K + 1, V]; num_drafts [N] int64 in [0, K];
    temperature [N] float (0: greedy_accept semantics for that row), top_k [N] int64 (<= 0: off),
    top_p [N] float; seeds [N] int64; steps [N] int64, the output index of the row's first new token.
    -> (num_accepted [N] int64, tokens [N, K + 1] int64), laid out as greedy_accept's.

    Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is
    drawn from normalize(max(0, p_i - q_i)) (from p_i if that is all zero, p == q up to rounding); after
    num_drafts accepted drafts the bonus token is drawn from p_num_drafts."""
    n, k, v = _check(draft_tokens, target_logits, num_drafts, draft_probs,
                     (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds),
                      ("steps", steps)))
    num_drafts = num_drafts.clamp(0, k)
    greedy_n, greedy_tokens = greedy_accept(draft_tokens, target_logits, num_drafts)

    p = target_probs(target_logits, temperature, top_k, top_p)              # [N, K + 1, V]
    x = draft_tokens.long()[:, :, None]
    in_vocab = ((x >= 0) & (x < v))[..., 0]         # PAD past num_drafts is fine: never read there
    x = x.clamp(0, v - 1)
    p_x = p[:, :k].gather(2, x)[..., 0]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        residual = p[:, :k].scatter(2, x, 0.0)                              # max(0, p - onehot(x))
        residual = torch.where(in_vocab[..., None], residual, p[:, :k])     # no q mass on a real token
    else:
        q = draft_probs.float()
        q_x = q.gather(2, x)[..., 0]
        residual = (p[:, :k] - q).clamp(min=0)
    # Accept iff u * q(x) < p(x), i.e. u < p / q without dividing: q(x) = 0 accepts unless p(x) = 0 too,
    # and a token with p(x) = 0 (outside top-k / top-p) is never accepted.
    u = _draws(seeds, steps, k, 1, _ACCEPT_SALT)[..., 0]
    num_accepted = _accepted((u * q_x < p_x) & in_vocab, num_drafts)

    # Position i < K samples its residual (used when rejected there), position K only ever the bonus; a
    # position equal to num_drafts is the bonus and samples p itself.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p[:, :k], residual)
    pos = torch.arange(k + 1, device=p.device)[None, :, None]
    dist = torch.where(pos < num_drafts[:, None, None], torch.cat([residual, p[:, k:]], dim=1), p)
    # Exponential race == Gumbel-max, as engine.sampling.sampler.sample; the hash uniforms lie strictly inside (0, 1),
    # so every exponential is finite and > 0. Zero-probability tokens score -1 so they can never win, not
    # even against a positive probability whose quotient underflows to 0.
    exp_noise = -torch.log(_draws(seeds, steps, k + 1, v, _RESIDUAL_SALT))
    final = torch.where(dist > 0, dist / exp_noise, -1.0).argmax(dim=-1)    # [N, K + 1]
    tokens = _emit(draft_tokens, num_accepted, final)

    sampled = temperature > 0
    return (torch.where(sampled, num_accepted, greedy_n),
            torch.where(sampled[:, None], tokens, greedy_tokens))
