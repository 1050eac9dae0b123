"""Each architecture family the loader takes, from a tiny random transformers checkpoint: Llama 3.2 (llama3 RoPE,
tied embeddings), Qwen2 (QKV bias, tied), Qwen3 (QK norm, head_dim wider than hidden / heads) and Mistral. In
float32 with the torch reference backend the engine's greedy tokens equal transformers' generate and its prefill
logits transformers' forward. And every dummy shape's config builds the model transformers builds from it,
counted on the meta device (no weights)."""
import json

import pytest
import torch

from conftest import assert_no_leak, hf_greedy, prefill_logits
from engine.models.loader import DUMMY_SHAPES, check_config, resolve_model, weight_files
from engine.requests.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 101, 33, 8, 250, 64, 9, 12], [200, 3], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 7]]
_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
# config class, model class, fields beyond _SMALL: each family with the features its real checkpoints carry
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1,
                                                      rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
}


def tiny_checkpoint(family: str, directory) -> "transformers.PreTrainedModel":
    """Saves a random float32 model of `family` to `directory` (safetensors) and returns it. Weights are drawn
    wider than transformers' initialiser, norms and biases away from 1 and 0, so that every tensor moves the
    logits and greedy picks are clear."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**(_SMALL | extra))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    return model


def tiny_engine(directory, **overrides):
    """The engine on a tiny checkpoint; a dummy spec as the tokenizer's source gives none (prompts are ids)."""
    from engine.llm_engine import LLMEngine
    cfg = dict(model=str(directory), tokenizer="dummy:tiny", device="cpu", dtype="float32",
               attention_backend="torch", max_num_seqs=4, max_model_len=128)
    return LLMEngine(**(cfg | overrides))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = tiny_checkpoint(request.param, directory)
    return request.param, hf, tiny_engine(directory)


def test_loaded_config_keeps_the_family(family):
    name, hf, engine = family
    assert engine.source.config["model_type"] == name
    model = engine.runner.model
    attn = model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (name == "qwen2")
    assert attn.qk_norm == (name == "qwen3")
    assert model.tied == (name in ("llama", "qwen2"))


def test_batched_greedy_tokens_match_transformers(family):
    _, hf, engine = family
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert [s.output_token_ids for s in engine.generate(PROMPTS, GREEDY)] == expected
    assert_no_leak(engine)


def test_prefill_logits_match_transformers(family):
    """Every position's logits, not only the argmax."""
    _, hf, engine = family
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    logits = prefill_logits(engine, prompt, last=len(prompt))
    rel = (logits - ref).norm() / ref.norm()
    assert rel < 1e-5, rel
    assert ref.std() > 1.0, "logits this flat would make the greedy comparison a coin toss"


def _meta_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("shape", list(DUMMY_SHAPES))
def test_dummy_shape_builds_what_transformers_builds(shape):
    """The shape's config, read by transformers' class of its model_type, has the same parameters as the engine's
    model; both on the meta device, so the 8B shapes cost nothing."""
    from engine.models.llama import LlamaForCausalLM
    cfg = resolve_model(f"dummy:{shape}").config
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert heads % kv_heads == 0 and head_dim % 2 == 0
    assert head_dim * heads == cfg["hidden_size"] or cfg["model_type"] == "qwen3"
    with torch.device("meta"):
        ours = LlamaForCausalLM(cfg)
        config_cls = FAMILIES["llama" if cfg["model_type"] == "llama" else cfg["model_type"]][0]
        theirs = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**cfg))
    assert _meta_count(ours) == _meta_count(theirs)
    attn = ours.layers[0].self_attn
    assert attn.q_size == heads * head_dim and attn.kv_size == kv_heads * head_dim
    assert (attn.qkv_proj.bias is not None) == (cfg["model_type"] == "qwen2")
    assert attn.qk_norm == (cfg["model_type"] == "qwen3")


# the model cards' parameter counts (billions, tied embeddings once): a wrong dimension moves them past 1%
PUBLISHED = {"llama-1b": 1.24, "llama-3b": 3.21, "llama-8b": 8.03, "qwen2.5-0.5b": 0.494, "qwen2.5-1.5b": 1.54,
             "qwen2.5-7b": 7.61, "qwen3-1.7b": 1.72, "qwen3-8b": 8.19, "mistral-7b": 7.25, "smollm2-135m": 0.135}


@pytest.mark.parametrize("shape", list(PUBLISHED))
def test_dummy_shape_has_the_published_size(shape):
    from engine.models.llama import LlamaForCausalLM
    with torch.device("meta"):
        count = _meta_count(LlamaForCausalLM(resolve_model(f"dummy:{shape}").config))
    assert count / 1e9 == pytest.approx(PUBLISHED[shape], rel=0.01)


def test_sliding_window_narrower_than_the_context_caps_it(capsys):
    base = dict(_SMALL, model_type="mistral", max_position_embeddings=4096)
    assert check_config(dict(base, sliding_window=None), "m")["max_position_embeddings"] == 4096
    assert check_config(dict(base, sliding_window=8192), "m")["max_position_embeddings"] == 4096
    assert check_config(dict(base, sliding_window=1024), "m")["max_position_embeddings"] == 1024
    assert "sliding_window 1024" in capsys.readouterr().err
    qwen = dict(base, model_type="qwen2", sliding_window=1024, max_window_layers=2)
    assert check_config(dict(qwen, use_sliding_window=False), "q")["max_position_embeddings"] == 4096
    assert check_config(dict(qwen, use_sliding_window=True), "q")["max_position_embeddings"] == 4096
    assert check_config(dict(qwen, use_sliding_window=True, max_window_layers=1), "q")["max_position_embeddings"] \
        == 1024
    assert check_config(dict(qwen, layer_types=["full_attention", "sliding_attention"]),
                        "q")["max_position_embeddings"] == 1024


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "gelu", "hidden_act 'gelu'"), ("mlp_bias", True, "mlp_bias"),
    ("attention_bias", True, "attention_bias"), ("num_key_value_heads", 3, "num_key_value_heads 3"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn'"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope type 'linear'"),
    ("model_type", "gemma", "model_type 'gemma'")])
def test_what_the_forward_cannot_compute_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_config(dict(_SMALL, model_type="llama") | {field: value}, "ckpt")


def test_index_names_the_weight_files(tmp_path):
    """A Mistral repository holds consolidated.safetensors beside the indexed files: only the index's are read."""
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert len(weight_files(tmp_path)) == 3
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                            "c": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.rsplit("/", 1)[1] for p in weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                                     "model-00002-of-00002.safetensors"]
