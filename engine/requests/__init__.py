"""A request's life on the host: its parameters and state (sequence.py), the checks that need the engine
(validation.py), the request-level API (frontend.py, request_handle.py), and what its step's tokens do to it:
commit, stops, detokenized output (commit.py, output.py, stop_strings.py)."""
