"""Runs one step: fills a DecodeSlot from scheduled rows, launches forward + sampling, brings tokens back.

Streams: all forwards and sampling go on `compute_stream`; the sampled tokens come back on `copy_stream`
anchored to the `sampled_ready` event of that step. Nothing runs on the default stream.
"""
from __future__ import annotations

import contextlib

import torch

from engine.attention import AttentionMetadata, make_backend
from engine.config import EngineConfig
from engine.loader import ModelSource
from engine.sampler import sample
from engine.slots import DecodeSlot
from engine.weights import build_model


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.cuda = self.device.type == "cuda"
        self.max_model_len = max_model_len
        self.model = build_model(source, self.dtype, self.device, max_model_len)
        self.vocab = source.config["vocab_size"]
        self.backend = make_backend(config.backend_name())
        self.num_blocks = self._num_kv_blocks(source.config)
        self.kv_caches = self._allocate_kv(source.config)
        self.compute_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        max_blocks = -(-max_model_len // config.block_size)
        self.slots = [DecodeSlot(i, config.max_num_batched_tokens, config.max_num_seqs, max_blocks, self.device)
                      for i in range(2)]
        self.events = [self._new_events() for _ in self.slots]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes: list[int] = []
        if self.cuda and not config.enforce_eager and self.backend.name == "triton":
            self.capture_decode_graphs()

    # ---- setup -------------------------------------------------------------------------------
    def _kv_shape(self, cfg):
        attn = self.model.layers[0].self_attn
        return (self.config.block_size, attn.num_kv_heads, attn.head_dim), cfg["num_hidden_layers"]

    def _num_kv_blocks(self, cfg) -> int:
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        (bs, h, d), layers = self._kv_shape(cfg)
        bytes_per_block = 2 * layers * bs * h * d * torch.finfo(self.dtype).bits // 8
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * self.config.kv_cache_memory_fraction) // bytes_per_block)
        per_seq = -(-min(self.max_model_len, 4096) // bs)
        return per_seq * min(self.config.max_num_seqs, 8)

    def _allocate_kv(self, cfg):
        shape, layers = self._kv_shape(cfg)
        return [(torch.zeros((self.num_blocks, *shape), dtype=self.dtype, device=self.device),
                 torch.zeros((self.num_blocks, *shape), dtype=self.dtype, device=self.device))
                for _ in range(layers)]

    def _new_events(self):
        if not self.cuda:
            return None
        return {k: torch.cuda.Event(enable_timing=True) for k in ("start", "forward_done", "sampled_ready")} | {
            "copy_done": torch.cuda.Event()}

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, slot: DecodeSlot, rows, block_size: int) -> None:
        """Fill the slot's host buffers for these rows (CPU only)."""
        h = slot.np
        t = s = 0
        max_q = max_len = 0
        for i, row in enumerate(rows):
            seq, n = row.seq, row.num_tokens
            end = row.start + n
            h["input_ids"][t:t + n] = seq.tokens(row.start, end)
            h["positions"][t:t + n] = range(row.start, end)
            bt = seq.block_table
            h["slot_mapping"][t:t + n] = [bt[p // block_size] * block_size + p % block_size
                                          for p in range(row.start, end)]
            h["block_tables"][i, :len(bt)] = bt
            h["seq_lens"][i] = end
            t += n
            h["cu_seqlens_q"][i + 1] = t
            max_q, max_len = max(max_q, n), max(max_len, end)
            if row.sample:
                self._fill_sampling(h, s, t - 1, seq)
                s += 1
        h["cu_seqlens_q"][0] = 0
        slot.num_tokens, slot.num_seqs, slot.num_sample = t, len(rows), s
        slot.max_query_len, slot.max_seq_len, slot.rows = max_q, max_len, rows
        slot.graph_bs = self._graph_size(slot)
        if slot.graph_bs:
            self._pad_rows(slot, len(rows), slot.graph_bs)

    def _graph_size(self, slot: DecodeSlot) -> int:
        """Padded batch size of a captured graph for a pure decode step, 0 if it runs eagerly."""
        if slot.max_query_len != 1 or slot.num_sample != slot.num_seqs:
            return 0
        return next((bs for bs in self.graph_sizes if bs >= slot.num_seqs), 0)

    @staticmethod
    def _pad_rows(slot: DecodeSlot, start: int, end: int) -> None:
        """Padding rows: one query token over an empty sequence, writing no KV (slot -1)."""
        h = slot.np
        h["input_ids"][start:end] = 0
        h["positions"][start:end] = 0
        h["slot_mapping"][start:end] = -1
        h["seq_lens"][start:end] = 0
        h["logits_indices"][start:end] = range(start, end)
        h["cu_seqlens_q"][start + 1:end + 1] = range(start + 1, end + 1)

    @staticmethod
    def _fill_sampling(h, s, token_index, seq):
        p = seq.params
        h["logits_indices"][s] = token_index
        h["temperature"][s] = p.temperature
        h["top_k"][s] = p.top_k
        h["top_p"][s] = p.top_p
        h["seeds"][s] = seq.seed
        h["steps"][s] = len(seq.output_token_ids)

    def launch(self, slot: DecodeSlot, all_greedy: bool) -> None:
        """Enqueue upload, forward, sampling and the token copy; returns without waiting (on CUDA)."""
        ev = self.events[slot.index]
        stream_ctx = torch.cuda.stream(self.compute_stream) if self.cuda else contextlib.nullcontext()
        with stream_ctx, torch.inference_mode():
            if self.cuda:
                ev["start"].record()
            if slot.graph_bs:
                slot.upload(padded=slot.graph_bs)
                graph, logits = self.graphs[(slot.index, slot.graph_bs)]
                graph.replay()
                logits = logits[:slot.num_sample]
            else:
                slot.upload()
                hidden = self._forward(slot)
                if slot.num_sample:
                    logits = self.model.compute_logits(hidden[slot.dev["logits_indices"][:slot.num_sample]])
            if self.cuda:
                ev["forward_done"].record()
            if slot.num_sample:
                self._sample(slot, logits, all_greedy)
            if self.cuda:
                ev["sampled_ready"].record()
        if self.cuda:
            self.copy_stream.wait_event(ev["sampled_ready"])
            with torch.cuda.stream(self.copy_stream):
                slot.download_sampled()
                ev["copy_done"].record()
        else:
            slot.download_sampled()

    def _forward(self, slot: DecodeSlot, num_tokens=None, num_seqs=None, max_query_len=None, max_seq_len=None):
        d = slot.dev
        T, B = num_tokens or slot.num_tokens, num_seqs or slot.num_seqs
        meta = AttentionMetadata(slot_mapping=d["slot_mapping"][:T], cu_seqlens_q=d["cu_seqlens_q"][:B + 1],
                                 seq_lens=d["seq_lens"][:B], block_tables=d["block_tables"][:B],
                                 max_query_len=max_query_len or slot.max_query_len,
                                 max_seq_len=max_seq_len or slot.max_seq_len)
        return self.model(d["input_ids"][:T], d["positions"][:T], meta, self.kv_caches, self.backend)

    def capture_decode_graphs(self) -> None:
        """One graph per (slot, padded batch size), all in one memory pool (they never run concurrently)."""
        limit = self.config.max_num_seqs
        self.graph_sizes = sorted({bs for bs in [1, 2, 4, 8, *range(16, limit + 1, 8), limit] if bs <= limit})
        pool = None
        with torch.cuda.stream(self.compute_stream), torch.inference_mode():
            for slot in self.slots:
                self._pad_rows(slot, 0, limit)
                slot.np["cu_seqlens_q"][0] = 0
                slot.num_tokens = slot.num_seqs = limit
                slot.upload()
                for bs in reversed(self.graph_sizes):
                    self._decode_logits(slot, bs)                    # warm-up: Triton compiles here
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.compute_stream):
                        logits = self._decode_logits(slot, bs)
                    pool = graph.pool()
                    self.graphs[(slot.index, bs)] = (graph, logits)
        self.compute_stream.synchronize()

    def _decode_logits(self, slot: DecodeSlot, bs: int):
        hidden = self._forward(slot, bs, bs, max_query_len=1, max_seq_len=self.max_model_len)
        return self.model.compute_logits(hidden)

    def _sample(self, slot: DecodeSlot, logits, all_greedy: bool) -> None:
        d, n = slot.dev, slot.num_sample
        slot.sampled[:n] = sample(logits, d["temperature"][:n], d["top_k"][:n], d["top_p"][:n],
                                  d["seeds"][:n], d["steps"][:n], all_greedy=all_greedy)

    def wait(self, slot: DecodeSlot) -> list[int]:
        """Block until this slot's tokens are on the host (event sync releases the GIL)."""
        if self.cuda:
            self.events[slot.index]["copy_done"].synchronize()
        return slot.sampled_host[:slot.num_sample].tolist()

    def gpu_times_ms(self, slot: DecodeSlot) -> tuple[float, float]:
        """(forward, sampling) device time of the slot's last step; valid after wait()."""
        if not self.cuda:
            return 0.0, 0.0
        ev = self.events[slot.index]
        return ev["start"].elapsed_time(ev["forward_done"]), ev["forward_done"].elapsed_time(ev["sampled_ready"])
