"""vLLM's prompt_logprobs: how likely the model finds each prompt token given the ones before it.

The step program computes logits only where a row samples, so a request that asks for them gets one forward of its
prompt of its own when it is added: the engine's weights, the torch reference attention (it runs on any device and
needs no graph) over pages of its own, in query chunks of CHUNK tokens (the reference attention holds a chunk's
scores against the whole prefix). On CUDA it runs on the compute stream, after the steps enqueued before it, and the
loop waits for it through an event. A rank's shard cannot do it alone, so tensor parallelism refuses the field.

An entry per prompt token but the first: (token id, its logprob, its rank: 1 + tokens more likely, ((token id,
logprob), ...) the `top` most likely, best first). The numbers are those of the raw logits (log_softmax), as
vLLM's default.
"""
from __future__ import annotations

import contextlib
import math

import torch

from engine.attention import AttentionMetadata
from engine.backend import TorchBackend
from engine.memory.kv_cache import kv_pages

CHUNK = 512


class PromptScorer:
    def __init__(self, runner, block_size: int):
        self.model, self.device, self.dtype = runner.model, runner.device, runner.dtype
        self.stream = runner.compute_stream
        self.block_size = block_size
        self.backend = TorchBackend()
        attn = self.model.layers[0].self_attn
        self.kv_shape = (block_size, attn.num_kv_heads, attn.head_dim)

    def score(self, ids: list[int], top: int) -> list[tuple]:
        n = len(ids)
        if n < 2:
            return []
        pages = kv_pages(len(self.model.layers), (math.ceil(n / self.block_size), *self.kv_shape), self.dtype,
                         self.device)
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with stream, torch.inference_mode():
            tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
            parts = [self._chunk(tokens, start, min(start + CHUNK, n), pages, top) for start in range(0, n, CHUNK)]
            host = [torch.cat(x).to("cpu", non_blocking=True) for x in zip(*parts)]
            done = torch.cuda.Event() if self.stream is not None else None
            if done is not None:
                done.record()
        if done is not None:
            done.synchronize()              # an event wait: the GIL is released meanwhile
        lp, rank, top_ids, top_lp = (x.tolist() for x in host)
        return [(ids[i + 1], lp[i], rank[i], tuple(zip(top_ids[i], top_lp[i]))) for i in range(n - 1)]

    def _chunk(self, tokens, start: int, end: int, pages, top: int):
        """The forward of tokens[start:end] (earlier ones already in `pages`); the scores of the tokens after each."""
        n, bs = end - start, self.block_size
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end, device=dev),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
                                 seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
                                 block_tables=torch.arange(math.ceil(end / bs), dtype=torch.int32, device=dev)[None],
                                 max_query_len=n, max_seq_len=end)
        positions = torch.arange(start, end, device=dev)
        hidden = self.model(tokens[start:end], positions, meta, pages, self.backend)
        rows = min(end, len(tokens) - 1) - start        # the last prompt token scores nothing
        logp = torch.log_softmax(self.model.compute_logits(hidden[:rows]), dim=-1)
        nxt = tokens[start + 1:start + 1 + rows]
        chosen = logp.gather(1, nxt[:, None])
        rank = (logp > chosen).sum(dim=1) + 1
        best = logp.topk(top, dim=-1) if top else (logp[:, :0], torch.empty(rows, 0, dtype=torch.long, device=dev))
        return chosen[:, 0], rank, best[1], best[0]
