"""Logits to tokens inside the step: sampling (sampler.py), penalties, min_p and min_tokens (penalties.py), and the
logprobs of the chosen tokens (logprobs.py)."""
