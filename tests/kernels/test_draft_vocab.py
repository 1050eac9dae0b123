"""Tuning.spec_draft_vocab: the EAGLE head drafts from a ranked subset of the vocabulary (PagedHead.restrict),
and specdec.eagle.token_ranks ranks the target's response tokens for it. Without CUDA the Triton backend runs in
the CPU interpreter (tests/conftest.py)."""
import json

import pytest
import torch

from conftest import assert_no_leak, triton_module
from helpers import record_drafts

dr = triton_module("matmul.draft_gemv")
DEV = "cpu" if dr.interpreted() else "cuda"
PROMPT = [5, 17, 99, 3, 250, 42, 7, 5, 17, 99]


def _engine(backend: str, vocab_file=None, size: int = 0, spare: int = 0, **kw):
    from engine.llm_engine import LLMEngine
    extra = dict(spec_draft_vocab=str(vocab_file), spec_draft_vocab_size=size, spec_prompt_vocab=spare) \
        if vocab_file else {}
    return LLMEngine(model="dummy:tiny", device=DEV if backend == "triton" else "cpu", dtype="float32",
                     attention_backend=backend, max_num_seqs=4, max_model_len=64, enforce_eager=True,
                     speculative="eagle", spec_head="random", num_speculative_tokens=3, spec_min_acceptance=0.0,
                     **extra, **kw)


def _subset(n: int = 96, seed: int = 0) -> list[int]:
    return torch.randperm(512, generator=torch.Generator().manual_seed(seed))[:n].tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_is_the_argmax_over_the_subset(backend, tmp_path):
    """The head's greedy draft with a draft vocabulary is its logits' argmax over those columns (the torch path,
    or draft_gemv's kernels on the gathered rows), as a token id."""
    ids = _subset()
    (tmp_path / "v.json").write_text(json.dumps(ids))
    head = _engine(backend, tmp_path / "v.json").runner.program.drafter.head
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(head.draft_weight.device)
    want = torch.tensor(ids, device=hidden.device)[head.logits(hidden)[:, ids].argmax(-1)]
    assert torch.equal(head.greedy(hidden), want)


def test_drafts_stay_in_the_subset_and_outputs_do_not_change(tmp_path):
    """Unguided drafts come from the first spec_draft_vocab_size ids only; greedy outputs are the engine's
    without a draft vocabulary (verification is lossless), and the pages are all returned."""
    from engine.requests.sequence import SamplingParams
    ranked = _subset(512)
    (tmp_path / "ranks.json").write_text(json.dumps({"token_ids": ranked}))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs, drafted = {}, {}
    for size in (0, 64):
        eng = _engine("triton", tmp_path / "ranks.json" if size else None, size)
        seen = record_drafts(eng.runner.program.drafter)
        outs[size] = eng.generate([PROMPT], params)[0].output_token_ids
        drafted[size] = {t for p in seen for t in p.draft_tokens.flatten().tolist()}
        assert_no_leak(eng)
    assert outs[64] == outs[0] and drafted[64] and drafted[64] <= set(ranked[:64])
    assert not drafted[0] <= set(ranked[:64])          # the random head drafts outside them without the subset


def test_refusals(tmp_path):
    from engine.config import EngineConfig
    from engine.speculative.drafters import load_draft_vocab
    head = _engine("torch").runner.program.drafter.head
    for bad in ([], [1, 1], [-1], [512], [[1, 2]]):
        with pytest.raises(ValueError, match="draft vocabulary"):
            head.restrict(bad) if bad != [[1, 2]] else head.restrict(torch.tensor(bad))
    (tmp_path / "v.json").write_text(json.dumps([3, 2, 1]))
    assert load_draft_vocab(str(tmp_path / "v.json"), 2) == [3, 2]
    with pytest.raises(ValueError, match="has 3 ids"):
        load_draft_vocab(str(tmp_path / "v.json"), 4)
    (tmp_path / "w.json").write_text(json.dumps(["a"]))
    with pytest.raises(ValueError, match="list of token ids"):
        load_draft_vocab(str(tmp_path / "w.json"))
    with pytest.raises(ValueError, match="spec_draft_vocab_size"):
        EngineConfig.of(spec_draft_vocab="v.json", spec_draft_vocab_size=-1)


def test_token_ranks_counts_responses_and_scores_held_out_coverage(tmp_path, capsys):
    from specdec.eagle import token_ranks
    rows = [{"kind": "chat", "prompt": [1, 2], "output": [7, 7, 7, 5, 5, 9]},
            {"kind": "schema", "prompt": [3], "output": [5, 7, 8]},
            {"kind": "chat_followup", "prompt": [4], "output": [7, 5, 11]}]
    (tmp_path / "chunk_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = token_ranks.main(["--data-dir", str(tmp_path), "--out", str(tmp_path / "r.json"), "--vocab", "12",
                            "--holdout-every", "2", "--sizes", "1", "2", "12"])
    # counted: row 1's response (its prompt left out), ties by id, then the unseen ids; held out: rows 0 and 2
    assert out["token_ids"] == [5, 7, 8, 0, 1, 2, 3, 4, 6, 9, 10, 11]
    assert out["counts"][:4] == [1, 1, 1, 0] and out["tokens"] == 3 and out["held_out_responses"] == 2
    held = [7, 7, 7, 5, 5, 9, 7, 5, 11]
    assert out["coverage"]["all"]["1"] == pytest.approx(held.count(5) / 9)
    assert out["coverage"]["all"]["2"] == pytest.approx(7 / 9) and out["coverage"]["all"]["12"] == 1.0
    assert set(out["coverage"]) == {"all", "chat"}
    assert json.loads((tmp_path / "r.json").read_text())["token_ids"] == out["token_ids"]
    assert "held-out coverage" in capsys.readouterr().out
    kept = token_ranks.main(["--data-dir", str(tmp_path), "--out", str(tmp_path / "k.json"), "--vocab", "12",
                             "--holdout-every", "2", "--sizes", "1", "2", "12", "--keep", "3"])
    assert kept["token_ids"] == [5, 7, 8] and kept["counts"] == [1, 1, 1] and kept["coverage"] == out["coverage"]


def test_the_heads_ranking_is_the_default(tmp_path):
    """spec_draft_vocab "": the head directory's token_ranks.json where it has one; "none": every id."""
    from engine.speculative.drafters import draft_vocab_file
    (tmp_path / "token_ranks.json").write_text(json.dumps([3, 2, 1]))
    assert draft_vocab_file("", str(tmp_path)) == str(tmp_path / "token_ranks.json")
    assert draft_vocab_file("mine.json", str(tmp_path)) == "mine.json"
    assert draft_vocab_file("none", str(tmp_path)) == ""
    assert draft_vocab_file("", str(tmp_path / "elsewhere")) == draft_vocab_file("", "random") == ""


@pytest.mark.slow
def test_the_shipped_head_drafts_from_its_ranking():
    """The default model's engine loads the shipped head's ranking (16 K ids by default, and the next 256 in the
    spare rows to start with; distinct and in the vocabulary, or restrict refuses it); "none" keeps the whole
    vocabulary."""
    from engine.llm_engine import LLMEngine
    from engine.speculative.drafters import default_head_dir, draft_vocab_file, load_draft_vocab
    heads = {}
    for vocab in ("", "none"):
        eng = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=1,
                        speculative="eagle", num_speculative_tokens=2, spec_draft_vocab=vocab)
        heads[vocab] = eng.runner.program.drafter.head
        eng.close()
    ranked = load_draft_vocab(draft_vocab_file("", default_head_dir(eng.source)))
    spare = heads[""].prompt_vocab.capacity
    assert spare == 256 and heads[""].draft_ids.tolist() == ranked[:16384 + spare]
    assert heads[""].draft_weight.shape[0] == 16384 + spare
    assert heads["none"].draft_ids is None and heads["none"].prompt_vocab is None
