"""Guided decoding: grammars compiled off the loop thread, masks filled by host callbacks on the grammar
stream (docs/guided.md)."""
