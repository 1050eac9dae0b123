"""The EAGLE-3-style head and its training on a tiny random Llama (CPU): causality of the unrolled forward,
loss going down, resuming from a checkpoint, export."""
import json

import pytest
import torch

from engine.speculative.eagle_head import EagleHead, HeadConfig, new_head, unrolled_logits
from specdec.eagle.data import (KINDS, first_turn, generate, load_records, load_sequences, prompt_items, split,
                                tool_items)
from specdec.eagle.prompts import FAMILIES, STYLES, chat_prompts
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


def _schema_root(tmp_path):
    """A data root with two Glaive function schemas and one Github_easy schema."""
    for sub, name in (("Glaiveai2K", "get_weather_1a2b"), ("Glaiveai2K", "book_table_3c4d"), ("Github_easy", "repo_9")):
        (tmp_path / "raw" / sub).mkdir(parents=True, exist_ok=True)
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        (tmp_path / "raw" / sub / f"{name}.json").write_text(json.dumps(schema))
    return str(tmp_path)


def test_chat_prompts_are_distinct_varied_and_never_the_benchmark_questions():
    from specdec.datasets import QUESTIONS
    texts = chat_prompts(60_000)
    assert len(texts) == len(set(texts)) == 60_000
    assert not set(QUESTIONS) & set(chat_prompts(10 ** 6)), "the benchmarks' chat questions are held out"
    first = chat_prompts(len(FAMILIES) + 2)
    assert len(first) == len(FAMILIES) + 2 and len(set(first)) == len(first)
    assert any(t.startswith("Solve for x") or "?" in t for t in first)
    assert chat_prompts(5, seed=1) != chat_prompts(5, seed=0)
    assert sum(t.endswith(STYLES[3]) for t in texts) > 1000, "styles vary the asked-for form"


def test_prompt_items_spread_kinds_followups_tools_and_sampled_repeats(tmp_path):
    root = _schema_root(tmp_path)
    n = 200_000
    unique = len(chat_prompts(n))                 # fewer: the families hold about 72 K
    items = prompt_items(root, num_chat=n, schema_variants=3, followup_every=4, num_tools=4, free_schema_variants=2)
    chat = [i for i in items if "text" in i and "tools" not in i]
    schemas = [i for i in items if "schema" in i and not i.get("free")]
    free = [i for i in items if "schema" in i and i.get("free")]
    tools = [i for i in items if "tools" in i]
    assert unique < n and len(chat) == n and len(schemas) == 9 and len(tools) == 4
    assert sorted(i["template"] for i in schemas) == [0, 0, 0, 1, 1, 1, 2, 2, 2], "each schema asked in 3 phrasings"
    assert sorted(i["template"] for i in free) == [0, 0, 0, 1, 1, 1], "and in 2 more without its grammar"
    assert all("temperature" not in i for i in chat[:unique]) and {i["temperature"] for i in chat[unique:]} == {0.8}
    assert chat[unique]["text"] == chat[0]["text"], "past the distinct prompts, they repeat"
    assert chat[unique]["seed"] != chat[unique + 1]["seed"], "a repeated prompt is sampled with its own seed"
    assert [("followup" in c) for c in chat[:8]] == [False, False, False, True] * 2
    assert {t["call"] for t in tools} == {"get_weather", "book_table"}, "tools are Glaive's functions, less the hash"
    assert all([x["function"]["name"] for x in t["tools"]] == [t["call"]] for t in tools), \
        "by default a conversation lists its tool alone (three did not fit the training cut)"
    found = [s for s in items if "schema" in s and s["dir"] == "raw/Glaiveai2K"]
    for t in tool_items(found, 6, others=1):
        names = [x["function"]["name"] for x in t["tools"]]
        assert t["call"] in names and len(names) == len(set(names)) <= 2
    # spread: the few schemas and tools are not bunched at one end
    where = [i for i, item in enumerate(items) if "tools" in item]
    assert where[0] < len(items) // 4 and where[-1] > 3 * len(items) // 4


def test_records_split_holds_out_every_50th_and_the_chat_ones(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"kind": "schema" if i % 3 else "chat", "prompt": [1, 2], "output": [3, 4, 5, i]} for i in range(200)]
    lines.append({"prompt": [1], "output": [2]})                  # too short to score a draft
    (data / "chunk_00000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = load_records(str(data), max_len=6)
    assert len(records) == 200 and records[0] == ([1, 2, 3, 4, 5, 0], 2, "chat")
    assert load_sequences(str(data), max_len=4) == [], "cut to 4 tokens, no response token is scored"
    train_seqs, held = split(records)
    assert len(train_seqs) == 196 and len(held["all"]) == 4
    assert held["chat"] == [r[:2] for i, r in enumerate(records) if i % 50 == 0 and r[2] == "chat"]
    assert not {tuple(s[0]) for s in held["all"]} & {tuple(s[0]) for s in train_seqs}


def test_select_computes_the_same_logits_only_where_asked(tiny_target):
    target = Target(tiny_target, (0, 1, 3))
    head = new_head(TINY, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    feats = target.features(ids, torch.ones_like(ids))
    select = torch.zeros(2, 10, dtype=torch.bool)
    select[0, 2:7] = select[1, 5:] = True
    full = unrolled_logits(head, feats, target.embed, ids, target.final_norm, target.lm_head, 3)
    part = unrolled_logits(head, feats, target.embed, ids, target.final_norm, target.lm_head, 3, select=select)
    for f, p in zip(full, part):
        assert p.shape == (10, TINY["vocab_size"]) and torch.allclose(f[select], p, atol=1e-6)


def test_generate_writes_both_turns_and_constrains_tool_calls(engine, tmp_path):
    """The real default model: a follow-up's prompt holds the first answer; a tool call names its function
    and parses; the tool's answer is asked after the made-up result."""
    items = prompt_items(_schema_root(tmp_path), num_chat=2, followup_every=1, num_tools=1, free_schema_variants=1)
    guided = next(i for i in items if "schema" in i and not i.get("free"))
    free = next(i for i in items if "schema" in i and i.get("free") and i["name"] == guided["name"])
    items = [i for i in items if "tools" in i] + [i for i in items if "followup" in i][:1] + [guided, free]
    assert first_turn(engine, free, 40)[1].json_schema is None, "a free schema prompt is asked without its grammar"
    assert first_turn(engine, free, 40)[0] == first_turn(engine, guided, 40)[0], "the same words (phrasing 0)"
    generate(engine, items, str(tmp_path / "data"), chunk=8, max_tokens=40, log=lambda m: None)
    rows = [json.loads(x) for x in (tmp_path / "data" / "chunk_00000.jsonl").read_text().splitlines()]
    by_kind = {r["kind"]: r for r in rows}
    assert sorted(by_kind) == ["chat", "chat_turn2", "schema", "schema_free", "tool", "tool_turn2"]
    assert set(by_kind) == KINDS, "--skip-kinds checks its arguments against KINDS"
    assert "city" in json.loads(engine.tokenizer.decode(by_kind["schema"]["output"], skip_special_tokens=True))
    call = engine.tokenizer.decode(by_kind["tool"]["output"], skip_special_tokens=True)
    body = call.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    assert json.loads(body)["name"] == items[0]["call"]
    turn2 = engine.tokenizer.decode(by_kind["chat_turn2"]["prompt"])
    first = engine.tokenizer.decode(by_kind["chat"]["output"], skip_special_tokens=True).strip()
    assert first[:40] in turn2 and items[1]["followup"] in turn2
    assert items[0]["result"] in engine.tokenizer.decode(by_kind["tool_turn2"]["prompt"])


def test_generate_shards_take_every_nth_chunk(engine, tmp_path):
    """Two processes with --shard 0/2 and 1/2 on one data dir write disjoint chunks that together make all."""
    items = [{"text": f"Say the number {i}."} for i in range(5)]
    out = tmp_path / "data"
    generate(engine, items, str(out), chunk=2, max_tokens=2, log=lambda m: None, shard=(1, 2))
    assert sorted(p.name for p in out.iterdir()) == ["chunk_00001.jsonl"]
    generate(engine, items, str(out), chunk=2, max_tokens=2, log=lambda m: None, shard=(0, 2))
    assert sorted(p.name for p in out.iterdir()) == [f"chunk_{c:05d}.jsonl" for c in range(3)]
    assert sum(len(p.read_text().splitlines()) for p in out.iterdir()) == 5


def test_train_head_trains_resumes_and_exports_on_a_shared_data_dir(engine, tmp_path):
    """python -m specdec.train_head's train and export stages on the default model (CPU, two steps), reading
    responses from a --data-dir outside --out, as runs of a data-size study do."""
    from specdec.train_head import main
    data = tmp_path / "shared"
    data.mkdir()
    g = torch.Generator().manual_seed(4)
    rows = [{"kind": ("chat", "schema", "chat_turn2")[i % 3],
             "prompt": torch.randint(10, 4000, (8,), generator=g).tolist(),
             "output": torch.randint(10, 4000, (12,), generator=g).tolist()} for i in range(120)]
    (data / "chunk_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["--out", str(out), "--data-dir", str(data), "--device", "cpu", "--steps", "2", "--batch", "2",
            "--max-len", "64", "--max-sequences", "40"]
    with pytest.raises(SystemExit, match="unknown kind.*chat_turn3"):
        main(args + ["--stage", "train", "--skip-kinds", "chat_turn3"])
    main(args + ["--stage", "train", "--bucket", "4", "--decay", "steps", "--skip-kinds", "chat_turn2"])
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] == 2 and summary["done"] and summary["sequences"] == 40
    assert summary["bucket"] == 4 and summary["decay"] == "steps"
    assert sum(summary["kinds"].values()) == 40 and set(summary["kinds"]) == {"chat", "schema"}
    main(args + ["--stage", "export"])
    acc = json.loads((out / "acceptance.json").read_text())
    assert set(acc) == {"all", "chat", "summary"} and all(1.0 <= v <= 6.0 for v in acc["chat"].values())
    assert ((out / "head.safetensors").stat().st_size > 1e6
            and "left out of training: chat_turn2" in (out / "card.md").read_text())
    assert not (out / "data").exists(), "the responses stay where --data-dir is"
    # --init goes on from an exported head: at learning rate 0 the next export is the same head
    again = tmp_path / "again"
    more = ["--out", str(again), "--init", str(out), "--lr", "0"] + args[2:]
    main(more + ["--stage", "train"])
    main(more + ["--stage", "export"])
    from safetensors.torch import load_file
    first, second = load_file(str(out / "head.safetensors")), load_file(str(again / "head.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert str(out) in (again / "card.md").read_text()


def test_batches_by_length_and_the_learning_rate_schedule():
    import random

    from specdec.eagle.train import learning_rate, pick_batch
    g = random.Random(5)
    seqs = [([1] * g.randrange(20, 500), 10) for _ in range(400)]

    def padding(bucket):
        total = 0
        for step in range(200):
            b = pick_batch(random.Random(step), seqs, 8, bucket)
            assert len(b) == 8 and pick_batch(random.Random(step), seqs, 8, bucket) == b, "the same draw on resume"
            total += sum(max(len(s[0]) for s in b) - len(s[0]) for s in b)
        return total

    assert padding(8) < 0.3 * padding(1), "sorted neighbours pad far less than random batches"
    with pytest.raises(ValueError, match="bucket"):
        pick_batch(random.Random(0), seqs, 8, 0)
    assert learning_rate(1.0, 0, 100, 0.0, None) == pytest.approx(1 / 50), "warm-up"
    assert learning_rate(1.0, 50, 100, 0.0, None) == pytest.approx(0.55)
    # a resumed call: half the steps done, the call's clock at its limit
    assert learning_rate(1.0, 50, 100, 60.0, 60.0, "time") == pytest.approx(0.1)
    assert learning_rate(1.0, 50, 100, 60.0, 60.0, "steps") == pytest.approx(0.55), "one schedule across calls"


def test_a_small_targets_head_reads_its_layers_in_order_and_twice():
    """A target of 2 layers gives the head layers (1, 0, 0): the engine's features are those layers' outputs in
    that order, one of them twice, as the head was trained on them (HF's hidden_states[i + 1])."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    eng = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=2,
                    speculative="eagle", num_speculative_tokens=2, spec_head="random", spec_min_acceptance=0.0)
    plain = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=2)
    try:
        layers = HeadConfig.for_target(eng.source.config).feature_layers
        assert len(set(layers)) < 3 and list(layers) != sorted(layers), layers
        prompts = [[5, 9, 14, 3, 7], [11, 2, 8]]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        spec = [s.output_token_ids for s in eng.generate(prompts, params)]
        assert spec == [s.output_token_ids for s in plain.generate(prompts, params)]
        model, runner = eng.runner.model, eng.runner
        ids = torch.tensor(prompts[0])
        out = {}
        for layer in sorted(set(layers)):
            out[layer] = _features(runner, model, ids, (layer,))
        assert torch.equal(_features(runner, model, ids, layers), torch.cat([out[i] for i in layers], dim=-1))
    finally:
        eng.close()
        plain.close()


def _features(runner, model, ids, layers):
    """The model's aux features of one prompt, one-shot prefill into scratch KV pages."""
    from engine.attention import AttentionMetadata
    n = ids.shape[0]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32), max_query_len=n, max_seq_len=n)
    kv = [tuple(torch.zeros_like(t) for t in pair) for pair in runner.kv_caches]
    return model(ids, torch.arange(n), meta, kv, runner.backend, layers)[1]
