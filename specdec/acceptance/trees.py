"""Tree drafts measured offline: what greedy verification would accept with a static tree of N draft nodes.

Under greedy verification only the branch that follows the target's own tokens matters: a tree accepts along
the path whose tokens are the target's next tokens, as deep as the tree holds that path. Along it the head's
inputs are the target's tokens, which is exactly what EAGLE-3's training-time test feeds it (`unrolled_logits`).
So one teacher-forced pass gives, at every position t and depth i, the rank r_i of the target's token t + 2 + i
among the head's logits (rank 0 = the head's argmax, ties to the lower id as argmax breaks them). A static
tree is a prefix-closed set of rank paths, as Medusa's and EAGLE's trees are written: (0,) the head's first
choice at depth 0, (1, 0) its second choice there followed by the first choice after it. At t it accepts the
longest leading path (r_0, ..., r_{L-1}) it holds. A chain of K drafts is the tree {(0,), (0, 0), ...}.

The engine's acceptance length is tokens per verifying step, each step drafting from where the last one
ended; `walk` replays that over a response. The best tree of N nodes for a sample of rank paths holds the N
most frequent path prefixes: a path's count is at most its parent's, so they are prefix-closed, and the
expected tokens per step is 1 + the sum of the tree's node frequencies (the construction of Sequoia and of
Medusa's tree search).
"""
from __future__ import annotations

from collections import Counter

import torch

MAX_RANK = 16          # ranks from here on count as "not drafted": no useful tree branches that wide
NO_LABEL = -1          # the token lies past the sequence: nothing to accept


def label_ranks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Rank of each label among its row of logits [N, V] (labels [N], NO_LABEL where there is none): the
    number of ids that argmax would pick first. >= MAX_RANK becomes MAX_RANK; no label stays NO_LABEL."""
    ok = labels >= 0
    lab = labels.clamp(min=0)
    target = logits.gather(1, lab[:, None])
    ids = torch.arange(logits.shape[1], device=logits.device)[None, :]
    rank = (logits > target).sum(1) + ((logits == target) & (ids < lab[:, None])).sum(1)
    return torch.where(ok, rank.clamp(max=MAX_RANK), NO_LABEL)


def chain(k: int) -> frozenset:
    """K linear drafts as a tree."""
    return frozenset((0,) * d for d in range(1, k + 1))


def prefix_counts(ranks: torch.Tensor) -> Counter:
    """How many positions of ranks [T, D] hold each rank path (every drafted leading prefix)."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        path = []
        for r in row:
            if r < 0 or r >= MAX_RANK:
                break
            path.append(r)
            counts[tuple(path)] += 1
    return counts


def best_tree(counts: Counter, nodes: int, depth: int | None = None) -> frozenset:
    """The `nodes` most frequent paths (at most `depth` deep): ties go to the shallower, then the lower ranks,
    so a node never comes before its parent."""
    paths = [p for p in counts if depth is None or len(p) <= depth]
    paths.sort(key=lambda p: (-counts[p], len(p), p))
    return frozenset(paths[:nodes])


def accepted(row: list[int], tree: frozenset) -> int:
    """Drafts accepted at one position: the longest leading rank path of row that the tree holds."""
    path: tuple = ()
    for r in row:
        if r < 0 or path + (r,) not in tree:
            break
        path += (r,)
    return len(path)


def walk(ranks: torch.Tensor, tree: frozenset, max_tokens: int | None = None) -> tuple[int, int]:
    """(tokens emitted, verifying steps) of one response decoded with the tree, as the engine decodes one
    request alone. ranks [T, D]: row j drafts from response token j - 1 (row 0: from the prompt's last token,
    in the prefill step, which emits token 0). A step from row j accepts a drafts and emits a + 1 tokens; the
    next step drafts from row j + a + 1. The response's last token counts as the target's own, not an accepted
    draft (an accepted EOS ends the step there). Like the engine, a step drafts no further than one token
    before max_tokens; a step left no room decodes without drafts and is not a verifying step."""
    rows = ranks.tolist()
    j = tokens = steps = 0
    while j < len(rows) and rows[j][0] != NO_LABEL:
        room = len(rows) if max_tokens is None else max_tokens - 2 - j
        if room <= 0:
            j += 1
            continue
        a = min(accepted(rows[j], tree), room, len(rows) - 2 - j)
        tokens, steps, j = tokens + a + 1, steps + 1, j + a + 1
    return tokens, steps


def totals(responses: list[torch.Tensor], tree: frozenset, max_tokens: int | None = None) -> tuple[int, int]:
    """(tokens emitted, verifying steps) summed over responses (each a ranks [T, D] tensor)."""
    tokens = steps = 0
    for ranks in responses:
        t, s = walk(ranks, tree, max_tokens)
        tokens, steps = tokens + t, steps + s
    return tokens, steps


def acceptance(responses: list[torch.Tensor], tree: frozenset, max_tokens: int | None = None) -> float:
    """Tokens per verifying step over responses, as the engine counts it."""
    tokens, steps = totals(responses, tree, max_tokens)
    return tokens / steps if steps else 0.0


def tree_depth(tree: frozenset) -> int:
    return max((len(p) for p in tree), default=0)
