"""Speculative decoding: acceptance and speed per drafter, with guided decoding, and the draft head."""
