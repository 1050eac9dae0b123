"""A request's life on the host: its parameters and state (sequence.py), the checks that need the engine
(validation.py), the request-level API (frontend.py, request_handle.py), and its output: stops, detokenized text
(output.py, stop_strings.py)."""
