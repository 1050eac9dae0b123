"""Speculative decoding: drafters, verification, acceptance statistics, the step that runs them
(docs/speculative.md)."""
