"""Drafters for speculative decoding: the interface (base.py) and one file per method."""
from specdec.drafters.base import DraftContext, Drafter, Proposal
from specdec.drafters.ngram import NgramDrafter, ngram_propose

__all__ = ["DraftContext", "Drafter", "NgramDrafter", "Proposal", "ngram_propose"]
