"""OpenAI's request and response shapes, and their translation to and from the engine's (sampling, tools, logprobs)."""
