"""What the grammar callbacks do to the matchers: accept a row's committed tokens, fill its token masks, and
walk a row's drafts (fill a mask at each position, then roll the walk back).

Callback thread only. Failures stay with their request: a token the grammar rejects or an exception while
accepting or filling sets that request's `error` and leaves its mask rows all-allowed (-1).
`GuidedRequest.accepted` counts the output tokens consumed (tokens after the matcher terminated included:
they are never accepted again either).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import xgrammar as xgr

ALL = -1        # a mask word allowing its 32 tokens


class GuidedRow(NamedTuple):
    row: int                    # sampling row of the step (its masks start at row * width)
    request: object             # GuidedRequest
    feed_start: int             # output index of feed[0] (at most request.accepted when the callback runs)
    feed: tuple                 # output tokens the host knows, from feed_start on (a list from build_snapshot)
    pending_src: int            # row of the previous step's emitted tokens to accept after them (-1: none)
    pending_step: int           # the step that emitted them


def failed(exc: Exception) -> str:
    return f"guided decoding failed: {type(exc).__name__}: {exc}"


def live(g) -> bool:
    """The request's matcher still takes tokens (a failing check fails the request)."""
    try:
        return g.error is None and not g.matcher.is_terminated()
    except Exception as exc:            # noqa: BLE001 - this request alone fails
        g.error = failed(exc)
        return False


def advance(g, tokens) -> None:
    """Feed `tokens` to the request's matcher one by one, counting them; sets g.error on a failure."""
    try:
        for tok in tokens:
            tok = int(tok)
            if tok < 0:
                g.error = "no token was allowed here (the request's token mask was empty)"
                return
            g.accepted += 1
            if g.matcher.is_terminated():
                continue                                # ended with its stop token: nothing more to accept
            if not g.matcher.accept_token(tok):
                g.error = f"the grammar rejected token {tok}"
                return
    except Exception as exc:            # noqa: BLE001 - this request alone fails
        g.error = failed(exc)


def emitted(prev_row: np.ndarray) -> list[int]:
    """A row of a step's output tokens: the first always (NO_TOKEN included), then until the first PAD."""
    out = [int(prev_row[0])]
    for tok in prev_row[1:]:
        if tok < 0:
            break
        out.append(int(tok))
    return out


def accept_rows(batch: xgr.BatchGrammarMatcher, rows, prev: np.ndarray, step: int | None = None) -> None:
    """Each row's host-known tokens it has not accepted yet (rare: one by one), then the tokens the previous
    step emitted for it (prev[pending_src]), unless a draft callback of that step accepted them already. A
    row of one device token (every row without speculation) is accepted in one batched call for all rows:
    the callback holds the GIL for one C++ call, not one per row. `step`: accept `prev` as that step's
    tokens whatever the rows say (the draft callbacks of the step that emitted them)."""
    requests, tokens = [], []
    for r in rows:
        g = r.request
        if g.error is not None:
            continue
        skip = g.accepted - r.feed_start
        if skip < len(r.feed):
            advance(g, r.feed[max(skip, 0):])
        src, when = (r.row, step) if step is not None else (r.pending_src, r.pending_step)
        if g.error is not None or src < 0 or g.through_step >= when:
            continue
        g.through_step = when
        toks = emitted(prev[src])
        if len(toks) == 1 and toks[0] >= 0 and _own(g.matcher) and live(g):
            requests.append(g)                  # (a wrapper matcher takes its own accept_token)
            tokens.append(toks[0])
        else:
            advance(g, toks)
    if requests:
        _accept_batch(batch, requests, tokens)


def _accept_batch(batch, requests, tokens) -> None:
    try:
        accepted = batch.batch_accept_token([g.matcher for g in requests], tokens)
    except Exception:                   # noqa: BLE001 - find the row(s) that fail, one by one
        for g, tok in zip(requests, tokens):
            advance(g, (tok,))
        return
    for g, tok, ok in zip(requests, tokens, accepted):
        g.accepted += 1
        if not ok and not g.matcher.is_terminated():    # a terminated matcher ignores what follows its end
            g.error = f"the grammar rejected token {tok}"


def _own(matcher) -> bool:
    """xgrammar's own matcher (batched calls take only these; a wrapper, such as llguidance's, runs its own)."""
    return type(matcher) is xgr.GrammarMatcher


def accept_each(batch: xgr.BatchGrammarMatcher, matchers: list, tokens: list) -> list[bool]:
    """Each matcher accepts its token: xgrammar's in one batched call, others one by one. Raises what they do."""
    ok = [False] * len(matchers)
    own = [i for i, m in enumerate(matchers) if _own(m)]
    if own:
        for i, good in zip(own, batch.batch_accept_token([matchers[i] for i in own], [tokens[i] for i in own])):
            ok[i] = good
    for i, m in enumerate(matchers):
        if not _own(m):
            ok[i] = m.accept_token(tokens[i])
    return ok


def rollback_each(batch: xgr.BatchGrammarMatcher, back: list) -> None:
    """(matcher, tokens) pairs: each matcher rolls back that many tokens (xgrammar's in one batched call)."""
    own = [(m, n) for m, n in back if _own(m)]
    if own:
        batch.batch_rollback([m for m, _ in own], [n for _, n in own])
    for m, n in back:
        if not _own(m):
            m.rollback(n)


def fill(batch: xgr.BatchGrammarMatcher, bitmask, requests, mask_rows) -> None:
    """Fill each request's mask row: xgrammar's in one batched call, others (or all, to find the one(s) that
    fail) row by row."""
    pairs = list(zip(requests, mask_rows))
    own = [(g, i) for g, i in pairs if _own(g.matcher)]
    if own:
        try:
            batch.batch_fill_next_token_bitmask([g.matcher for g, _ in own], bitmask, [i for _, i in own])
            pairs = [(g, i) for g, i in pairs if not _own(g.matcher)]
        except Exception:               # noqa: BLE001
            pass
    words = bitmask.numpy()
    for g, i in pairs:
        try:
            g.matcher.fill_next_token_bitmask(bitmask, i)
        except Exception as exc:        # noqa: BLE001 - this request alone fails
            g.error = failed(exc)
            words[i] = ALL


def walk_drafts(batch, bitmask, rows, width: int, drafts: np.ndarray, counts: np.ndarray, caps: np.ndarray) -> None:
    """Masks of every position of each live row (row r's position j at mask row r.row * width + j): position 0
    from the matcher's state, position j + 1 after it accepted drafts[r.row, :j + 1]. The walk stops at a
    draft the grammar rejects, at the row's draft count, or once the matcher terminates; caps[r.row] = the
    drafts it accepted (the verifier takes no more), mask rows past it allow everything. Then every matcher
    is rolled back to where it started (batched by position: one C++ call per position for all rows)."""
    words = bitmask.numpy()
    active = [r for r in rows if live(r.request)]
    for r in rows:
        caps[r.row] = 0
        words[r.row * width:(r.row + 1) * width] = ALL
    fill(batch, bitmask, [r.request for r in active], [r.row * width for r in active])
    walked = {id(r): 0 for r in active}
    for j in range(width - 1):
        active = [r for r in active if counts[r.row] > j and r.request.error is None]
        if not active:
            break
        try:
            ok = accept_each(batch, [r.request.matcher for r in active], [int(drafts[r.row, j]) for r in active])
        except Exception:               # noqa: BLE001 - a bad draft id: stop walking these rows here
            ok = [False] * len(active)
        going = []
        for r, good in zip(active, ok):
            if good:
                walked[id(r)] += 1
                caps[r.row] = j + 1
                if not r.request.matcher.is_terminated():
                    going.append(r)
        fill(batch, bitmask, [r.request for r in going], [r.row * width + j + 1 for r in going])
        active = going
    back = [(r.request.matcher, walked[id(r)]) for r in rows if walked.get(id(r))]
    if back:
        rollback_each(batch, back)


def walk_tree(batch, bitmask, rows, width: int, drafts: np.ndarray, counts: np.ndarray, caps: np.ndarray,
              tree) -> None:
    """walk_drafts for a step verifying a draft tree (engine/speculative/tree.py DraftTree), row by row as the
    grammar node's walk_tree: the chain's masks as walk_drafts fills them, then each leaf's at its input, after
    the chain's first depth - 1 drafts and the leaf, where the grammar accepts the leaf. caps[r.row] = the deepest
    depth a draft may be accepted at: one past the chain drafts the grammar accepted (a leaf beside the rejected
    one), unless the matcher terminated there; at most the row's draft count. A leaf equal to its chain sibling is
    skipped (the target never accepts it)."""
    words = bitmask.numpy()
    for r in rows:
        caps[r.row] = 0
        words[r.row * width:(r.row + 1) * width] = ALL
    order = sorted(range(len(tree.leaves)), key=lambda i: -tree.leaves[i][0])      # deepest first
    for r in rows:
        caps[r.row] = _walk_tree_row(batch, bitmask, r, width, drafts[r.row], int(counts[r.row]), tree, order)


def _walk_tree_row(batch, bitmask, r, width: int, drafts, count: int, tree, order) -> int:
    g = r.request
    fill(batch, bitmask, [g] if live(g) else [], [r.row * width])
    if g.error is not None or g.matcher.is_terminated():
        return 0
    walked, ended = 0, False
    for j in range(min(tree.depth, count)):
        if g.error is not None or not _try_draft(g.matcher, drafts[j]):
            break
        walked += 1
        ended = g.matcher.is_terminated()
        if not ended:
            fill(batch, bitmask, [g], [r.row * width + j + 1])
        if ended or g.error is not None:
            break
    reach = min(count, walked + (not ended))
    held = walked
    for i in order:
        depth = tree.leaves[i][0]
        if depth > reach or g.error is not None or drafts[tree.depth + i] == drafts[depth - 1]:
            continue
        g.matcher.rollback(held - (depth - 1))
        held = depth - 1
        if not _try_draft(g.matcher, drafts[tree.depth + i]):
            continue
        if not g.matcher.is_terminated():
            fill(batch, bitmask, [g], [r.row * width + tree.depth + 1 + i])
        g.matcher.rollback(1)
    if held:
        g.matcher.rollback(held)
    return reach


def _try_draft(matcher, token) -> bool:
    """Accept one draft token: False where the grammar rejects it or the id is bad (the walk stops there)."""
    try:
        return bool(matcher.accept_token(int(token)))
    except Exception:                   # noqa: BLE001
        return False
