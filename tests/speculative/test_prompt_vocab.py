"""Tuning.spec_prompt_vocab: the draft vocabulary's spare rows, lent to the tokens of recent prompts that the
ranking leaves out (engine/speculative/prompt_vocab.py, PagedHead.write_vocab)."""
import json

import pytest
import torch

from conftest import assert_no_leak

RANKED = list(range(100, 164))          # the dummy model's ranked ids: 64 of its 512
PROMPT = [5, 17, 99, 3, 250, 42, 7, 5, 17, 99, 120, 130]


def test_prompts_take_the_rows_used_least_recently():
    from engine.speculative.prompt_vocab import PromptVocab, spare_ids
    assert spare_ids([4, 3, 9, 8], 2, 2, 10) == [9, 8]
    assert spare_ids([4, 3], 2, 3, 10) == [0, 1, 2]                # past the ranking: the lowest ids it lacks
    vocab = PromptVocab([10, 11], [20, 21, 22], 32)                 # spare rows 2, 3, 4
    writes = {}
    vocab.admit([10, 5, 5, 20, 40], writes)                         # 20 held: now the most recent; 40 out of range
    assert writes == {3: 5} and vocab.ids() == [20, 5, 22]
    vocab.admit([6], writes)                                        # the oldest is 22 (row 4)
    assert writes == {3: 5, 4: 6} and vocab.ids() == [20, 5, 6]
    writes = {}
    vocab.admit([1, 2, 3, 4, 5], writes)                            # more new ids than rows: the first three
    assert sorted(writes.values()) == [1, 2, 3] and sorted(vocab.ids()) == [1, 2, 3]
    assert vocab.capacity == 3


def _engine(spare: int, path, **kw):
    from engine.llm_engine import LLMEngine
    return LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=4,
                     max_model_len=64, enforce_eager=True, speculative="eagle", spec_head="random",
                     num_speculative_tokens=3, spec_min_acceptance=0.0, spec_draft_vocab=str(path),
                     spec_draft_vocab_size=64, spec_prompt_vocab=spare, **kw)


def _consistent(head) -> None:
    """Every row holds one id and carries that id's LM-head row; no id twice."""
    ids = head.draft_ids
    assert ids.unique().numel() == ids.numel()
    assert torch.equal(head.draft_weight, head.target.head_weight[ids])


def test_an_admitted_prompt_is_drafted_from_and_outputs_do_not_change(tmp_path):
    from engine.requests.sequence import SamplingParams
    (tmp_path / "ranks.json").write_text(json.dumps(RANKED + list(range(200, 300))))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for spare in (0, 8):
        eng = _engine(spare, tmp_path / "ranks.json")
        head = eng.runner.program.drafter.head
        assert head.draft_ids.tolist() == RANKED + list(range(200, 200 + spare))
        outs[spare] = [s.output_token_ids for s in eng.generate([PROMPT, PROMPT[:4]], params)]
        _consistent(head)
        assert_no_leak(eng)
        eng.close()
    assert outs[8] == outs[0]
    # the prompts' seven ids outside the ranked 64 took the spare rows used least recently: 200-206
    novel = sorted(set(PROMPT) - set(RANKED))
    assert sorted(head.draft_ids[64:].tolist()) == sorted(novel + [207])
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    want = head.draft_ids[head.logits(hidden)[:, head.draft_ids].argmax(-1)]
    assert torch.equal(head.greedy(hidden), want)


def test_rows_stay_consistent_through_evictions(tmp_path):
    from engine.requests.sequence import SamplingParams
    (tmp_path / "ranks.json").write_text(json.dumps(RANKED))
    eng = _engine(4, tmp_path / "ranks.json")
    head = eng.runner.program.drafter.head
    assert head.draft_ids[64:].tolist() == [0, 1, 2, 3]            # past the ranking: the lowest ids it lacks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[400 + 3 * i, 401 + 3 * i, 402 + 3 * i] for i in range(6)]
    eng.generate(prompts, params)
    _consistent(head)
    assert set(head.draft_ids[64:].tolist()) <= {t for p in prompts for t in p}
    assert_no_leak(eng)


@pytest.mark.slow
def test_guided_requests_lend_their_guides_ids_and_draft_from_the_rows():
    """Without draft masks a guided step's drafts come from the draft rows too (the grammar then walks them). A
    guided request's guide text lends its ids outside the ranking spare rows, though its prompt does not hold
    them (a schema given as response_format), and its drafts are the rows' ids (the default model and its
    shipped head)."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from helpers import record_drafts
    eng = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=2, max_model_len=256,
                    speculative="eagle", num_speculative_tokens=2)
    head = eng.runner.program.drafter.head
    schema = {"type": "object", "properties": {"zygomorphicPetiole": {"type": "integer"}},
              "required": ["zygomorphicPetiole"]}
    prompt = eng.apply_chat_template([{"role": "user", "content": "A leaf, as JSON."}])
    guide_ids = eng.tokenizer.encode(json.dumps(schema), add_special_tokens=False)
    novel = set(guide_ids) - set(head.draft_ids[:16384].tolist()) - set(prompt)
    assert novel and not novel <= set(head.draft_ids.tolist())
    proposals = record_drafts(eng.runner.program.drafter)
    [seq] = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, json_schema=schema))
    assert novel <= set(head.draft_ids.tolist())
    drafted = {t for p in proposals for t in p.draft_tokens.flatten().tolist()}
    assert drafted and drafted <= set(head.draft_ids.tolist())
    _consistent(head)
    eng.close()


@pytest.mark.gpu
def test_gpu_graphs_lend_rows_between_replays():
    """CUDA graphs, float32, debug_sync: the spare rows change between graph replays (on the compute stream, no
    host sync while a step is enqueued), every row keeps its id's LM-head row, and greedy outputs equal the
    engine's without speculation (the default model and its shipped head)."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    cfg = dict(device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=4)
    plain = LLMEngine(**cfg)
    prompts = [plain.apply_chat_template([{"role": "user", "content": text}]) for text in (
        'Fill {"zygomorphicPetiole": int, "xanthophyllQuota": str} as JSON.', "Name three quasars.",
        'Return {"glaucousBract": bool} as JSON.', "What is a petiole?", 'Write {"ombrophilousId": 7}.')]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [s.output_token_ids for s in plain.generate(prompts, params)]
    plain.close()
    eng = LLMEngine(**cfg, speculative="eagle", num_speculative_tokens=3, spec_prompt_vocab=8, debug_sync=True)
    head = eng.runner.program.drafter.head
    before = head.draft_ids.tolist()
    assert [s.output_token_ids for s in eng.generate(prompts, params)] == want
    assert head.draft_ids.tolist() != before and eng.runner.graphs.replays["spec"] > 0
    _consistent(head)
    assert_no_leak(eng)
    eng.close()


def test_refusals():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="spec_prompt_vocab must be >= 0"):
        EngineConfig.of(spec_prompt_vocab=-1)
