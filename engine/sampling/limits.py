"""What one request may ask of the step's sampling buffers. The slots are sized by these (engine/runner/slots.py)
and requests are checked against them (engine/requests/); no torch here, so an API process checks a request
without loading it."""

MAX_LOGPROBS = 20           # top entries a request may ask for (OpenAI's bound)
MAX_STOPS = 8               # EOS ids + stop token ids that min_tokens masks, per request
