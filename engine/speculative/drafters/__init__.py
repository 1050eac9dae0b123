"""Drafters for speculative decoding: the interface (base.py) and one file per method."""
from engine.speculative.drafters.base import DraftContext, Drafter, FeatureContext, Proposal
from engine.speculative.drafters.ngram import NgramDrafter, ngram_propose

__all__ = ["DraftContext", "Drafter", "FeatureContext", "NgramDrafter", "Proposal", "make_drafter",
           "ngram_propose", "default_head_dir", "drafter_caches"]


def drafter_caches(config, source, draft=None) -> list:
    """The paged KV caches the drafter `config` names keeps beside the target's (engine/memory/kv_cache.py), known
    before anything is loaded so the page budget counts them: a head's one layer, a draft model's layers."""
    from engine.memory.kv_cache import PagedCache
    if config.speculative == "eagle":
        from engine.speculative.eagle_head import HeadConfig
        from engine.speculative.eagle_paged import head_config
        where = head_dir(config, source)
        cfg = HeadConfig.for_target(source.config) if where == "random" else head_config(where)
        return [PagedCache("eagle head", 1, cfg.num_kv_heads, cfg.head_dim)]
    if config.speculative == "draft_model":
        return [PagedCache.of_config("draft model", draft.config)]
    return []


def make_drafter(config, source=None, model=None, backend=None, num_blocks: int = 0, max_model_len: int = 0,
                 draft=None) -> Drafter:
    """The drafter an EngineConfig names (config.speculative). A head or a draft model also needs the target
    (its ModelSource and loaded model), the attention backend and the KV page count it shares; a draft model
    its ModelSource (`draft`, from draft_model.draft_source)."""
    if config.speculative == "ngram":
        return NgramDrafter(config.num_speculative_tokens, config.ngram_min_n, config.ngram_max_n,
                            config.use_spec_kernels())
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if config.speculative == "eagle":
        from engine.speculative.drafters.eagle import EagleDrafter
        from engine.speculative.eagle_head import new_head
        from engine.speculative.eagle_paged import PagedHead, check_head, load_head
        from engine.speculative.tree import config_tree
        where = head_dir(config, source)
        head = new_head(source.config, dtype, device).requires_grad_(False) if where == "random" \
            else load_head(where, dtype, device)
        check_head(head, source.config)
        k = config.num_speculative_tokens
        paged = PagedHead(head, model, backend, num_blocks, config.block_size, max_model_len + k)
        vocab = draft_vocab_file(config.tuning.spec_draft_vocab, where)
        if vocab:
            restrict_vocab(paged, vocab, config.tuning.spec_draft_vocab_size, config.tuning.spec_prompt_vocab)
        return EagleDrafter(k, paged, config.block_size, max_model_len, config.use_spec_kernels(),
                            config.tuning.draft_gather, config_tree(config))
    if config.speculative == "draft_model":
        from engine.models.weights import build_model
        from engine.speculative.drafters.draft_model import DraftModelDrafter
        return DraftModelDrafter(config.num_speculative_tokens, build_model(draft, dtype, device, max_model_len + 1),
                                 backend, num_blocks, config.block_size, max_model_len, config.use_spec_kernels())
    raise ValueError(f"no drafter for speculative={config.speculative!r}")


def draft_vocab_file(spec_draft_vocab: str, head: str) -> str:
    """The ranking drafts come from: Tuning.spec_draft_vocab's file, or ("") the head directory's
    token_ranks.json where it has one; "" for the whole vocabulary ("none", a random head, a head without one)."""
    from pathlib import Path
    if spec_draft_vocab == "none":
        return ""
    if spec_draft_vocab:
        return spec_draft_vocab
    ranks = Path(head) / "token_ranks.json"
    return str(ranks) if head != "random" and ranks.is_file() else ""


def restrict_vocab(paged, path: str, size: int, spare: int) -> None:
    """The head drafts from the ranking's first `size` ids (0: all), and `spare` rows more that
    recent prompts' tokens take where the ranking leaves some out."""
    from engine.speculative.prompt_vocab import spare_ids
    ranked = load_draft_vocab(path)
    base = first_ids(ranked, size, path)
    vocab = paged.target.vocab
    paged.restrict(base, spare_ids(ranked, len(base), min(spare, vocab - len(base)), vocab))


def load_draft_vocab(path: str, size: int = 0) -> list[int]:
    """The first `size` (0: all) token ids of a JSON list (or {"token_ids": [...]}, as specdec.eagle.token_ranks
    writes it)."""
    import json
    with open(path) as f:
        data = json.load(f)
    ids = data["token_ids"] if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"draft vocabulary {path}: expected a list of token ids")
    return first_ids(ids, size, path)


def first_ids(ids: list[int], size: int, path: str) -> list[int]:
    """The first `size` (0: all) ids of the ranking at `path`."""
    if size > len(ids):
        raise ValueError(f"draft vocabulary {path} has {len(ids)} ids; spec_draft_vocab_size asks for {size}")
    return ids[:size] if size else ids


def head_dir(config, source) -> str:
    """The head an eagle engine drafts with: `spec_head` ("random": an untrained one), else the shipped one."""
    return config.spec_head or default_head_dir(source)


def default_head_dir(source) -> str:
    """The shipped head trained for this model (specdec/heads/*/head.json names its target)."""
    import json
    from engine.speculative.eagle_paged import HEADS
    def stem(name: str) -> str:            # "SmolLM2-135M-Instruct.Q4_1" (a converted GGUF) names the same model
        return name.split(".")[0].lower()
    for meta in sorted(HEADS.glob("*/head.json")):
        if stem(json.loads(meta.read_text()).get("target", "")) == stem(source.name):
            return str(meta.parent)
    raise ValueError(f"no trained draft head ships for model {source.name!r}: pass spec_head=PATH (a directory "
                     f"from `python -m specdec.train_head`) or spec_head='random' (an untrained head)")
