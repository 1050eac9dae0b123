"""Speculative decoding: drafters, verification, acceptance statistics (later issues)."""
