"""The EAGLE-3-style head and its training on a tiny random Llama (CPU): causality of the unrolled forward,
loss going down, resuming from a checkpoint, export."""
import json

import pytest
import torch

from engine.spec.eagle_head import EagleHead, HeadConfig, new_head, unrolled_logits
from specdec.eagle.data import chat_texts, load_sequences, prompt_items
from specdec.eagle.train import Target, evaluate, make_batch, train

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).eval()


@pytest.fixture(scope="module")
def tiny_data(tiny_target):
    """The tiny target's own greedy continuations of random prompts: (ids, prompt length)."""
    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(40):
        prompt = torch.randint(3, TINY["vocab_size"], (1, 6), generator=g)
        out = tiny_target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=24, eos_token_id=[], pad_token_id=0)
        seqs.append((out[0].tolist(), 6))
    return seqs


def test_head_config_and_size_for_the_default_model_shape():
    cfg = HeadConfig.for_target(dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                                     num_key_value_heads=3, intermediate_size=1536))
    assert cfg.feature_layers == (1, 14, 26) and cfg.head_dim == 64
    params = sum(p.numel() for p in EagleHead(cfg).parameters())
    assert params * 2 <= 10 ** 7, f"{params} params do not fit 10 MB in bfloat16"


def test_unrolled_steps_see_only_what_drafting_sees(tiny_target):
    target = Target(tiny_target, (0, 1, 3))
    head = new_head(TINY, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    feats = target.features(ids, torch.ones_like(ids))

    def logits(tokens, features):
        return unrolled_logits(head, features, target.embed, tokens, target.final_norm, target.lm_head, 3)

    base = logits(ids, feats)
    changed = ids.clone()
    changed[0, 9] = (ids[0, 9] + 1) % TINY["vocab_size"]
    feats2 = feats.clone()
    feats2[0, 9:] += 1.0
    after = logits(changed, feats2)
    for i in range(3):
        # step i at position t reads features <= t and tokens <= t + 1 + i
        t_last = 9 - 2 - i
        assert torch.allclose(base[i][0, :t_last + 1], after[i][0, :t_last + 1], atol=1e-5), i
        assert not torch.allclose(base[i][0, 9 - 1 - i], after[i][0, 9 - 1 - i], atol=1e-5), i


def test_training_lowers_the_loss_resumes_and_scores(tiny_target, tiny_data, tmp_path):
    target = Target(tiny_target, (0, 1, 3))
    head = new_head(TINY, torch.float32, torch.device("cpu"))
    before = evaluate(head, target, tiny_data[:8], depth=3)
    first = train(head, target, tiny_data[8:], tiny_data[:8], out_dir=str(tmp_path), steps=30, batch=8, lr=3e-3,
                  depth=3, ckpt_every=10, time_limit_s=0.0, log=lambda m: None)
    assert not first["done"] and first["step"] == 1, "a zero time limit stops after one step, checkpointed"
    head2 = new_head(TINY, torch.float32, torch.device("cpu"))
    done = train(head2, target, tiny_data[8:], tiny_data[:8], out_dir=str(tmp_path), steps=120, batch=8,
                 lr=3e-3, depth=3, ckpt_every=50, log=lambda m: None)
    losses = done["losses"]
    assert done["done"] and len(losses) == 120
    assert sum(losses[-10:]) / 10 < 0.92 * sum(losses[:10]) / 10, (losses[:10], losses[-10:])
    assert 1.0 <= before < done["held_out_acceptance"] <= 4.0


def test_batches_mask_prompts_and_padding():
    ids, attn, resp = make_batch([([5, 6, 7, 8], 2), ([9, 10, 11], 1)], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert resp.tolist() == [[False, False, True, True], [False, True, True, False]]
    assert attn.sum().item() == 7


def test_prompt_items_mix_chat_and_schemas(tmp_path):
    (tmp_path / "raw" / "Glaiveai2K").mkdir(parents=True)
    (tmp_path / "raw" / "Glaiveai2K" / "a.json").write_text(json.dumps({"type": "object"}))
    items = prompt_items(str(tmp_path), num_chat=3)
    assert [("text" in i) for i in items] == [True, False, True, True]
    assert len(set(chat_texts(500))) == 500
    from specdec.eagle.data import TASKS, TOPICS
    unique = len(TASKS) * len(TOPICS)
    many = prompt_items(str(tmp_path), num_chat=unique + 2, schema_variants=3)
    assert [i["template"] for i in many if "schema" in i] == [0, 1, 2], "each schema asked in 3 phrasings"
    chat = [i for i in many if "text" in i]
    assert all("temperature" not in i for i in chat[:unique]) and [i["temperature"] for i in chat[unique:]] == [0.8] * 2
    assert chat[unique]["seed"] != chat[unique + 1]["seed"], "a repeated prompt is sampled with its own seed"
    data = tmp_path / "data"
    data.mkdir()
    (data / "chunk_00000.jsonl").write_text(json.dumps({"prompt": [1, 2], "output": [3, 4, 5]}) + "\n")
    assert load_sequences(str(data), max_len=5) == [([1, 2, 3, 4, 5], 2)]
    assert load_sequences(str(data), max_len=4) == [], "too short to score a draft"
