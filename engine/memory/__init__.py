"""Device memory handed out per sequence: KV pages with prefix caching (block_manager.py) out of one page budget
(kv_cache.py), and the rows of per-sequence device state (token_pool.py, row_pool.py)."""
