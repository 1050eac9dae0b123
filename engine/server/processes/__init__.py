"""How the server runs: a supervisor, the engine process, API processes and their frames; or the engine on a thread."""
