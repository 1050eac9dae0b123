"""Logits to tokens inside the step: sampling (sampler.py), penalties, min_p and min_tokens (penalties.py), the
logprobs of the chosen tokens (logprobs.py), and what a request may ask of them (limits.py)."""
