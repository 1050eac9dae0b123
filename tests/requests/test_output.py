"""engine/requests/output.py: incremental detokenization, stops and streamed text, on the CPU with real tokenizers."""
import random

import pytest

from engine.requests import output as output_mod
from engine.requests.output import IncrementalDetokenizer, OutputProcessor, RequestOutput
from engine.requests.sequence import SamplingParams, Sequence

try:
    from engine.models.loader import load_tokenizer, resolve_model
except ImportError:                                  # before the move to engine/models
    from engine.loader import load_tokenizer, resolve_model

MULTIBYTE = "héllo 世界 🎉 naïve café — 日本語のテキスト 👩‍👩‍👧 Ωμέγα, привет! ½ ∑ done."
# Sampled from SmolLM2-135M-Instruct (torch.manual_seed(0), temperature 1, three rows, 64 new tokens, each kept up
# to its EOS) for the chat prompt "Write one sentence in Chinese, one in Russian and one with emoji."; recorded
# here so the test needs no model run (that takes minutes on a loaded CPU).
MODEL_OUTPUTS = [
    [504, 768, 2232, 8545, 281, 511, 4575, 736, 325, 511, 338, 3275, 314, 4048, 30, 2],
    [155, 235, 16885, 24674, 6511, 30940, 8355, 7872, 17868, 16885, 28, 38106, 6511, 13760, 40610, 6643,
     27714, 36554, 40186, 7872, 44795, 34536, 16885, 198, 173, 242, 219, 173, 242, 227, 173, 242, 233, 4636,
     242, 232, 4636, 242, 234, 173, 242, 235, 1116, 33, 30, 4097, 198, 34, 30, 6103, 198, 173, 242, 219, 173,
     242, 227, 173, 242, 235, 4636, 242, 114, 173],
    [155, 119, 16464, 7872, 37123, 13760, 14714, 28, 23947, 6511, 46879, 31338, 6511, 13760, 38704, 30940,
     27714, 156, 228, 16885, 19263, 13760, 9175, 24006, 41337, 6511, 9382, 9382, 6511, 28, 31338, 6511, 13760,
     6485, 9382, 16885, 23947, 18408, 21339, 31730, 8831, 16885, 8355, 18408, 28, 28050, 6643, 41337, 22140,
     32122, 37625, 7872, 12681, 6485, 9382, 40600, 33175, 8355, 40600, 22140, 24006, 6485, 23947, 8831],
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("default"))


def detok_text(tokenizer, ids, **kw) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tokenizer, **kw)
    parts = [d.add(t) for t in ids]
    parts.append(d.flush())
    return parts, "".join(parts)


def random_ids(rng, pool, n):
    return [rng.choice(pool) for _ in range(n)]


# ---- IncrementalDetokenizer --------------------------------------------------------------------------
def test_detok_equals_decode_on_model_outputs(tok):
    assert tok.decode(MODEL_OUTPUTS[1]).endswith("\ufffd")      # stopped inside a character: flush() holds it
    for ids in MODEL_OUTPUTS:
        for skip in (False, True):
            assert detok_text(tok, ids, skip_special_tokens=skip)[1] == tok.decode(ids, skip_special_tokens=skip)


def test_detok_multibyte_chars_arrive_whole(tok):
    ids = tok.encode(MULTIBYTE)
    parts, text = detok_text(tok, ids)
    assert text == tok.decode(ids) == MULTIBYTE
    assert "" in parts[:-1], "no token split a character: the test text lost its point"
    assert not any("\ufffd" in p for p in parts), "a partial character was released"


@pytest.mark.parametrize("skip", [False, True])
def test_detok_equals_decode_on_random_tokens(tok, skip):
    rng = random.Random(1234)
    byte_tokens = [i for t, i in tok.get_vocab().items() if len(t) == 1]     # one byte each (GPT-2 byte map)
    pools = [list(range(len(tok))), byte_tokens, byte_tokens + list(range(200))]
    for trial in range(150):
        ids = random_ids(rng, pools[trial % 3], rng.randrange(1, 160))
        assert detok_text(tok, ids, skip_special_tokens=skip)[1] == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.fixture(scope="module")
def sp_tok():
    """A Llama-style SentencePiece tokenizer (▁ for spaces, byte fallback, leading space stripped)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    corpus = ["The capital of France is Paris.", "Hello world, this is a small corpus.", "Café naïve résumé",
              "日本語のテキスト", "Speculative decoding makes inference faster.", "  two  spaces\nand\ttabs"]
    tk.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=420, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def test_detok_sentencepiece_style(sp_tok):
    ids = sp_tok.encode("Hello world, the café in 東京 🎉 is naïve.  Two  spaces", add_special_tokens=False)
    assert sp_tok.convert_ids_to_tokens(ids[0]).startswith("▁") and "<0xF0>" in sp_tok.convert_ids_to_tokens(ids)
    assert detok_text(sp_tok, ids)[1] == sp_tok.decode(ids)
    # with the prompt as context the first token keeps its leading space, as in the prompt + output decode
    prompt = sp_tok.encode("The capital of France", add_special_tokens=False)
    out = sp_tok.encode("is Paris.", add_special_tokens=False)
    with_prompt = detok_text(sp_tok, out, prompt_ids=prompt)[1]
    assert with_prompt == " is Paris." == sp_tok.decode(prompt + out)[len(sp_tok.decode(prompt)):]
    rng = random.Random(7)
    words = [i for t, i in sp_tok.get_vocab().items() if not t.startswith("<0x")]   # byte fallback validates
    for _ in range(150):                            # byte runs as a group, so random bytes cannot stream
        ids = random_ids(rng, words, rng.randrange(1, 80))
        for skip in (False, True):
            assert detok_text(sp_tok, ids, skip_special_tokens=skip)[1] == sp_tok.decode(ids, skip_special_tokens=skip)


class CountingTokenizer:
    """Wraps tokenizer.decode to record how many tokens each call decodes."""
    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []
        self.all_special_ids, self.added_tokens_decoder = tokenizer.all_special_ids, tokenizer.added_tokens_decoder

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def test_detok_decodes_a_constant_number_of_tokens_per_add(tok):
    ids = (tok.encode(MULTIBYTE + " The capital of France is Paris. ") * 200)[:4000]
    counting = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting)
    per_add = []
    for t in ids:
        before = len(counting.sizes)
        d.add(t)
        per_add.append(sum(counting.sizes[before:]))
    assert len(ids) == 4000 and max(per_add) <= 8 and max(per_add[-500:]) <= max(per_add[:500])


# ---- OutputProcessor ---------------------------------------------------------------------------------
def new_seq(params, seq_id=0, prompt=(1, 2, 3)):
    return Sequence(seq_id, list(prompt), params, seed=0)


def run(proc, seq, tokens, k=1, **start):
    """Commit `tokens` k at a time until the request ends; returns its outputs. start: OutputProcessor.start's."""
    proc.start(seq, **start)
    outs = []
    for i in range(0, len(tokens), k):
        before = len(seq.output_token_ids)
        reason = proc.commit(seq, tokens[i:i + k])
        outs.append(proc.output(seq, len(seq.output_token_ids) - before, reason is not None, reason))
        if reason:
            break
    return outs


def check_stream(outs, stops=()):
    """Released text only ever grows towards the final text (nothing cut is ever released)."""
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    shown = ""
    for o in outs:
        shown += o.new_text
        assert final.text.startswith(shown) and not any(s in shown for s in stops)
    assert shown == final.text
    assert final.token_ids == tuple(t for o in outs for t in o.new_token_ids)


STOP_CASES = [  # text generated, stop strings, expected final text
    ("The capital of Germany is Berlin. The capital of France is Paris.", ("capital of France",),
     "The capital of Germany is Berlin. The "),
    ("The capital of France is Paris.", ("pit",), "The ca"),                  # inside one token
    ("The capital of France is Paris.", ("tal of Fr", "zzz"), "The capi"),    # across three tokens
    ("Say 世界 and 🎉 then stop", ("🎉",), "Say 世界 and "),                  # a stop of byte tokens
    ("no stop string here at all", ("stop here", "xyz"), "no stop string here at all"),
]


@pytest.mark.parametrize("text,stops,expected", STOP_CASES)
def test_stream_releases_final_text_and_never_a_stop_string(tok, text, stops, expected):
    ids = tok.encode(text)
    params = SamplingParams(max_tokens=len(ids), stop=stops)
    outs = run(OutputProcessor(tok, frozenset({tok.eos_token_id})), new_seq(params), ids)
    check_stream(outs, stops)
    assert outs[-1].text == expected
    assert outs[-1].finish_reason == ("length" if expected == text else "stop")


def test_stream_holds_a_stop_prefix_until_it_fails(tok):
    text = "The capital of Germany is Berlin."
    ids = tok.encode(text)
    params = SamplingParams(max_tokens=len(ids), stop=("capital of France",))
    outs = run(OutputProcessor(tok, frozenset()), new_seq(params), ids)
    shown = [""]
    for o in outs:
        shown.append(shown[-1] + o.new_text)
    n_of = len(tok.encode("The capital of"))
    assert shown[n_of] == "The " and shown[n_of + 1] == "The capital of Germany"
    assert outs[-1].text == text and outs[-1].finish_reason == "length"


def end_cases(tok):
    ids = tok.encode("One two three four five six seven eight nine ten.")
    eos = tok.eos_token_id
    return [  # tokens, params, expected token count, reason
        (ids[:4] + [eos] + ids[4:], SamplingParams(max_tokens=40), 5, "stop"),
        (ids[:6] + [ids[2]] + ids[6:], SamplingParams(max_tokens=40, stop_token_ids=(ids[2],)), 3, "stop"),
        (ids, SamplingParams(max_tokens=7), 7, "length"),
        (ids, SamplingParams(max_tokens=40, stop=(" fi",)), 5, "stop"),
        (ids[:4] + [eos] + ids[4:], SamplingParams(max_tokens=40, ignore_eos=True, stop=("six",)), 7, "stop"),
    ]


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("k", [2, 3, 5])
def test_multi_token_commit_stops_where_single_commits_do(tok, case, k):
    tokens, params, count, reason = end_cases(tok)[case]
    proc = OutputProcessor(tok, frozenset({tok.eos_token_id}))
    one = run(proc, new_seq(params), tokens)
    many = run(proc, new_seq(params), tokens, k)
    check_stream(many, params.stop)
    assert len(one[-1].token_ids) == count and one[-1].finish_reason == reason
    assert (many[-1].token_ids, many[-1].text, many[-1].finish_reason) == \
        (one[-1].token_ids, one[-1].text, one[-1].finish_reason)
    assert one[-1].text == tok.decode(one[-1].token_ids[:-1] if reason == "stop" and not params.stop
                                      else one[-1].token_ids)[:len(one[-1].text)]


def test_outputs_are_copies(tok):
    proc = OutputProcessor(tok, frozenset({tok.eos_token_id}))
    seq = new_seq(SamplingParams(max_tokens=3))
    proc.start(seq)
    proc.commit(seq, tok.encode(" Hello"))
    first = proc.output(seq, 1)
    reason = proc.commit(seq, tok.encode(" big world"))
    final = proc.output(seq, 2, True, reason)
    seq.output_token_ids.append(99)
    seq.output_token_ids[0] = 7
    assert isinstance(first.new_token_ids, tuple) and isinstance(final.token_ids, tuple)
    assert first.new_token_ids == tuple(tok.encode(" Hello"))
    assert final.token_ids == tuple(tok.encode(" Hello big world")) and final.text == " Hello big world"
    with pytest.raises(AttributeError):
        first.new_text = "x"


def test_without_tokenizer_only_token_stops_apply():
    proc = OutputProcessor(None, frozenset({2}))
    outs = run(proc, new_seq(SamplingParams(max_tokens=10, stop=("a",))), [5, 6, 2, 7])
    assert outs[-1] == RequestOutput(0, (2,), "", True, "stop", None, (5, 6, 2), "")
    assert run(proc, new_seq(SamplingParams(max_tokens=2)), [5, 6, 7])[-1].finish_reason == "length"


def test_abort_releases_held_text_and_rejects_more_commits(tok):
    proc = OutputProcessor(tok, frozenset())
    seq = new_seq(SamplingParams(max_tokens=50, stop=("capital of France",)))
    proc.start(seq)
    proc.commit(seq, tok.encode("The capital of"))
    assert proc.output(seq, 3).new_text == "The "
    final = proc.fail(seq, "abort")
    assert (final.new_text, final.text, final.finish_reason, final.new_token_ids) == \
        ("capital of", "The capital of", "abort", ())
    with pytest.raises(RuntimeError):
        proc.commit(seq, [5])
    with pytest.raises(ValueError):
        proc.fail(new_seq(SamplingParams()), "length")


@pytest.mark.parametrize("tail,max_tokens", [([2], 64), ([], 6), ([], 15)])   # EOS, length, length at the end
def test_lazy_requests_decode_once_and_end_with_the_streamed_text(tok, tail, max_tokens):
    """stream=False (nobody reads text before the end, no stop strings): the same final output as a streamed
    request, with no per-token decode: one decode at the end, and the whole text released then."""
    ids = MODEL_OUTPUTS[0][:-1][:20] + tail
    proc = OutputProcessor(tok, frozenset({2}))
    streamed = run(proc, new_seq(SamplingParams(max_tokens=max_tokens)), ids)
    lazy_seq = new_seq(SamplingParams(max_tokens=max_tokens))
    proc.start(lazy_seq, stream=False)
    calls, slow = [], []
    decoder = output_mod._decoder
    output_mod._decoder = lambda *a: lambda ids: calls.append(1) or decoder(*a)(ids)
    decode = tok.decode
    tok.decode = lambda *a, **k: slow.append(1) or decode(*a, **k)
    try:
        lazy = []
        for t in ids:
            reason = proc.commit(lazy_seq, [t])
            lazy.append(proc.output(lazy_seq, 1, reason is not None, reason))
            assert reason is not None or not calls, "a lazy request decoded before its end"
            if reason:
                break
    finally:
        output_mod._decoder = decoder
        del tok.decode
    assert len(calls) == 1 and all(o.new_text == "" for o in lazy[:-1])
    # its one decode is the Rust one where that gives tokenizer.decode's text (this tokenizer's: no space cleanup)
    assert decoder(tok, False).func == tok.backend_tokenizer.decode and not slow
    assert (lazy[-1].finish_reason, lazy[-1].text, lazy[-1].token_ids) == \
        (streamed[-1].finish_reason, streamed[-1].text, streamed[-1].token_ids)
    assert lazy[-1].new_text == lazy[-1].text == "".join(o.new_text for o in streamed)


@pytest.mark.parametrize("tail,max_tokens", [([2], 64), ([], 6)])   # EOS, length
def test_token_ids_only_requests_release_no_text_and_the_same_tokens(tok, tail, max_tokens):
    """detokenize=False (the server's engine process: the API process decodes): every output carries its new
    tokens and no text, the last one the whole ids, as a streamed request's, and its finish reason."""
    ids = MODEL_OUTPUTS[0][:-1][:20] + tail
    proc = OutputProcessor(tok, frozenset({2}))
    streamed = run(proc, new_seq(SamplingParams(max_tokens=max_tokens)), ids)
    outs = run(proc, new_seq(SamplingParams(max_tokens=max_tokens)), ids, detokenize=False)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in streamed]
    assert all(o.new_text == "" and not o.finished for o in outs[:-1])
    assert (outs[-1].finished, outs[-1].finish_reason, outs[-1].token_ids, outs[-1].text) == \
        (True, streamed[-1].finish_reason, streamed[-1].token_ids, "")
