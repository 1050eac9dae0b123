"""Offline tree-draft acceptance (specdec/acceptance/trees.py, tree_study.py): ranks, trees, the engine's walk,
and the offline chain against the engine's own EAGLE acceptance on the real model and head."""
import argparse
from collections import Counter

import pytest
import torch

from specdec.acceptance import trees


def test_label_ranks_count_what_argmax_picks_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5],      # tie at the top: id 1 is argmax, id 2 rank 1
                           [2.0, 1.0, 0.0, -1.0],
                           [0.0, 0.0, 0.0, 0.0]])
    assert trees.label_ranks(logits, torch.tensor([1, 3, 0])).tolist() == [0, 3, 0]
    assert trees.label_ranks(logits, torch.tensor([2, 0, 3])).tolist() == [1, 0, 3]
    assert trees.label_ranks(logits, torch.tensor([trees.NO_LABEL, 1, 2])).tolist() == [trees.NO_LABEL, 1, 2]
    wide = torch.arange(40.0).flip(0)[None, :]
    assert trees.label_ranks(wide, torch.tensor([39])).tolist() == [trees.MAX_RANK]
    rank0 = trees.label_ranks(logits, logits.argmax(-1))
    assert rank0.tolist() == [0, 0, 0]


def test_best_tree_takes_the_most_frequent_prefix_closed_paths():
    ranks = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0], [2, -1, -1]])
    counts = trees.prefix_counts(ranks)
    assert counts[(0,)] == 4 and counts[(0, 0)] == 3 and counts[(0, 0, 0)] == 2 and counts[(2,)] == 1
    for n in range(1, len(counts) + 1):
        tree = trees.best_tree(counts, n)
        assert len(tree) == n
        assert all(p[:-1] in tree for p in tree if len(p) > 1), tree      # prefix-closed
    assert trees.best_tree(counts, 3) == frozenset({(0,), (0, 0), (0, 0, 0)})
    assert trees.best_tree(counts, 4) == frozenset({(0,), (0, 0), (0, 0, 0), (1,)})
    assert trees.best_tree(counts, 10, depth=1) == frozenset({(0,), (1,), (2,)})
    assert trees.best_tree(Counter(), 3) == frozenset()


def test_walk_drafts_from_where_the_last_step_ended():
    # row j drafts from position j; the walk ends at the first row with no token after it
    ranks = torch.tensor([[0, 0, 5], [9, 9, 9], [9, 9, 9], [1, 0, 0], [0, 0, -1], [0, -1, -1], [-1, -1, -1]])
    chain = trees.chain(3)
    assert trees.accepted([0, 0, 5], chain) == 2 and trees.accepted([1, 0, 0], chain) == 0
    # row 0 accepts 2 (3 tokens) -> row 3 accepts 0 (1 token) -> row 4 drafts tokens 5 and 6, but token 6
    # ends the response: it counts as the target's own (2 tokens, 1 accepted)
    assert trees.walk(ranks, chain) == (3 + 1 + 2, 3)
    wider = chain | {(1,), (1, 0)}
    assert trees.walk(ranks, wider) == (3 + 3, 2)              # row 3 accepts (1, 0): 3 tokens -> row 6 ends
    assert trees.walk(ranks, frozenset()) == (6, 6)            # no drafts: one token a step
    assert trees.acceptance([ranks, ranks], chain) == pytest.approx(2.0)
    # max_tokens 7: a step drafts no further than token 5; without drafts, row 5 has no room for one and
    # decodes token 6 without verifying
    assert trees.walk(ranks, chain, max_tokens=7) == (3 + 1 + 2, 3)
    assert trees.walk(ranks, frozenset(), max_tokens=7) == (5, 5)
    eos = torch.tensor([[0, 0, 5], [9, 9, 9], [0, 0, -1], [1, -1, -1], [-1, -1, -1]])   # 5 tokens, then EOS
    assert trees.walk(eos, chain, max_tokens=7) == (3 + 1, 2)


def test_offline_chain_matches_the_engines_eagle_acceptance(chat_prompts):
    """The teacher-forced ranks walked with a chain of K reproduce the engine's own greedy EAGLE steps, one
    request at a time (responses ending by EOS and by max_tokens)."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from specdec.acceptance import tree_study
    k, prompts, max_tokens = 3, chat_prompts[:3], 40
    eng = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=1,   # the ranks are
                    speculative="eagle", num_speculative_tokens=k, spec_min_acceptance=0.0,   # over every id
                    spec_draft_vocab="none")
    try:
        seqs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        eng.close()
    pairs = [(p, list(s.output_token_ids)) for p, s in zip(prompts, seqs)]
    args = argparse.Namespace(model=None, head=None, batch=3, depth=k)
    ranks = dict(tree_study.head_ranks(args, torch.device("cpu"), {"chat": pairs}))["chat"]
    for s, r in zip(seqs, ranks):
        assert r.shape == (len(s.output_token_ids), k)
        tokens, steps = trees.walk(r, trees.chain(k), max_tokens)
        assert (steps, tokens - steps) == (s.spec.steps, s.spec.accepted), (s.spec, tokens, steps)
    assert {s.finish_reason for s in seqs} == {"stop", "length"}


def test_tree_study_runs_end_to_end_and_resumes_from_its_cache(tmp_path):
    import json

    from specdec.acceptance import tree_study
    cache, out = tmp_path / "cache", tmp_path / "trees.json"
    common = ["--datasets", "chat", "--prompts", "2", "--max-tokens", "8", "--device", "cpu", "--cache", str(cache)]
    rows = tree_study.main(common + ["--depth", "3", "--nodes", "2", "4", "--out", str(out)])
    assert {(r["method"], r["nodes"]) for r in rows} == {("chain", 1), ("chain", 2), ("chain", 3), ("tree", 2),
                                                         ("tree", 4)}
    assert all(1.0 <= r["acceptance"] <= 1 + r["depth"] for r in rows)
    saved = json.loads(out.read_text())
    assert saved["meta"]["responses"] == {"chat": 2} and set(saved["trees"]) == {"2", "4"}
    assert out.with_suffix(".md").exists()
    kept = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert set(kept) == {"chat.responses.json", "chat.ranks.pt"}
    again = tree_study.main(common + ["--depth", "2", "--nodes", "3", "--out", str(out)])   # from the cache only
    assert {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} == kept
    assert [r["acceptance"] for r in again if r["method"] == "chain"] == \
        [r["acceptance"] for r in rows if r["method"] == "chain"][:2]
    with pytest.raises(SystemExit):
        tree_study.main(common + ["--nodes", "0"])
