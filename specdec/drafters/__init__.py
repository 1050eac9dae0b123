"""Drafters for speculative decoding: the interface (base.py) and one file per method."""
from specdec.drafters.base import DraftContext, Drafter, Proposal
from specdec.drafters.ngram import NgramDrafter, ngram_propose

__all__ = ["DraftContext", "Drafter", "NgramDrafter", "Proposal", "make_drafter", "ngram_propose"]


def make_drafter(config) -> Drafter:
    """The drafter an EngineConfig names (config.speculative)."""
    if config.speculative == "ngram":
        return NgramDrafter(config.num_speculative_tokens, config.ngram_min_n, config.ngram_max_n)
    raise ValueError(f"no drafter for speculative={config.speculative!r}")
