"""Model code and loading: the Llama-family forward, weights, GGUF conversion, model sources."""
