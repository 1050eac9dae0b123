"""Sharding without processes: the cuts cover every unit once, and each rank's weights loaded from a
checkpoint (safetensors slices) or drawn as dummies are its part of the unsharded model's."""
import pytest
import torch

from engine.models.loader import ModelSource, resolve_model
from engine.models.weights import build_model
from engine.parallel.group import TPGroup
from engine.parallel.sharding import attention_heads, param_shards, split, vocab_rows


class Rank(TPGroup):
    """A rank's identity, for building its shard (loading runs no collectives)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world


@pytest.mark.parametrize("n,world", [(9, 2), (3, 2), (14336, 4), (5, 5), (7, 3)])
def test_splits_cover_every_unit_once(n, world):
    parts = [split(n, r, world) for r in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_heads_follow_their_kv_groups_and_vocab_pads_equally():
    assert [attention_heads(9, 3, r, 2) for r in range(2)] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert [vocab_rows(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        attention_heads(9, 3, 0, 4)


def _check_parts(source, world):
    whole = dict(build_model(source, torch.float32, torch.device("cpu"), 64).named_parameters())
    for rank in range(world):
        shards = param_shards(source.config, rank, world)
        for name, p in build_model(source, torch.float32, torch.device("cpu"), 64,
                                   Rank(rank, world)).named_parameters():
            if name in shards:
                expected = torch.empty_like(p)
                shards[name].take(whole[name], expected)
            else:
                expected = whole[name]
            assert torch.equal(p, expected), (rank, name)


def test_checkpoint_slices_are_each_ranks_part(tmp_path):
    """A Qwen2 checkpoint (QKV biases, untied LM head, a vocabulary that does not divide by 3)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert source.config["model_type"] == "qwen2"
    _check_parts(source, 3)
    _check_parts(source, 2)


def test_dummy_weights_are_the_same_model_for_any_rank_count():
    cfg = dict(resolve_model("dummy:tiny").config)
    _check_parts(ModelSource("dummy:tiny", cfg, None), 2)
    _check_parts(ModelSource("dummy:tiny-tied", dict(cfg, tie_word_embeddings=True, vocab_size=501), None), 2)
