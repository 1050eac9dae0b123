"""The engine: requests in, tokens out, through scheduler -> model runner -> commit.

`depth=1` is the blocking loop: plan, launch, wait, commit, one step at a time. Per-step timings are
kept as counters (`self.timings`) that benchmarks read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.loader import load_tokenizer, resolve_model
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status
from engine.slots import DecodeSlot
from engine.timings import StepTimings


@dataclass
class RequestOutput:
    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


@dataclass
class InflightStep:
    index: int          # step number (alternates the slots, indexes the timing events)
    slot: DecodeSlot    # holds the step's rows until its commit (a slot is prepared again only after it)


@contextlib.contextmanager
def _sync_debug_mode(mode: str):
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig(**overrides)
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (each decode row takes a token)")
        self.config = config
        self.source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.source)
        ctx = int(self.source.config.get("max_position_embeddings", 8192))
        self.max_model_len = min(config.max_model_len or ctx, ctx)
        self.runner = ModelRunner(config, self.source, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_ids = self._eos_ids()
        self.timings = StepTimings()
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._seqs: dict[int, Sequence] = {}
        self._inflight: deque[InflightStep] = deque()
        self._step_index = 0
        self._last_committed: int | None = None
        self._last_commit_time = time.perf_counter()

    def _eos_ids(self) -> frozenset[int]:
        eos = self.source.config.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.source.name} has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.source.name} has no chat template")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seq = Sequence(self._next_id, ids, params, seed=seed, arrival=time.perf_counter(),
                       max_len=min(len(ids) + params.max_tokens, self.max_model_len))
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                             f"and at least one must be left to generate")
        bad = [t for t in ids if not 0 <= t < self.runner.vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.runner.vocab}): {bad[:5]}")
        worst = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(worst, 0) > self.blocks.num_blocks:
            raise ValueError(f"request needs up to {worst} tokens of KV, more than the whole cache holds "
                             f"({self.blocks.num_blocks * self.blocks.block_size})")

    def abort(self, seq_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is not None and not seq.finalized:
            self.scheduler.finish(seq, "abort")

    def take(self, seq_id: int) -> Sequence:
        """Hand over a finished request's Sequence and forget it."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.finalized:
            raise KeyError(f"no finished request {seq_id}")
        return self._seqs.pop(seq_id)

    def set_depth(self, depth: int) -> None:
        """Switch between the blocking (1) and pipelined (2) loop; in-flight steps drain first."""
        while self._inflight:
            self.step()
        self.config = dataclasses.replace(self.config, depth=depth)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then commit the oldest in-flight one once `depth` steps are in flight.

        depth=1: plan -> launch -> wait -> commit (blocking). depth=2: the forward of step t+1 is on the
        device while step t is committed; its inputs that depend on step t's tokens are carried over on the
        device. With nothing new to launch, the in-flight steps drain."""
        t0 = time.perf_counter()
        launched = self._plan_and_launch()
        outputs = []
        while self._inflight and (len(self._inflight) >= self.config.depth or not launched):
            outputs += self._wait_and_commit(self._inflight.popleft())
        self.timings.wall += time.perf_counter() - t0
        return outputs

    def _plan_and_launch(self) -> bool:
        t0 = time.perf_counter()
        rows = self.scheduler.schedule()
        if not rows:
            return False
        slot = self.runner.slots[self._step_index % 2]
        self.runner.prepare(slot, rows)
        for row in rows:
            seq = row.seq
            seq.inflight_refs += 1
            seq.num_computed_tokens = row.start + row.num_tokens
            if row.sample:
                seq.num_pending += 1
                seq.pending_src = row.sample_idx
        all_greedy = all(r.seq.params.temperature == 0 for r in rows if r.sample)
        t1 = time.perf_counter()
        with self._sync_guard():
            self.runner.launch(slot, self._step_index, all_greedy)
        self._inflight.append(InflightStep(self._step_index, slot))
        self._step_index += 1
        self.timings.add(plan=t1 - t0, launch=time.perf_counter() - t1)
        return True

    def _sync_guard(self):
        """debug_sync: any device->host synchronisation while enqueuing a step raises (CUDA only)."""
        if not (self.config.debug_sync and self.runner.cuda):
            return contextlib.nullcontext()
        return _sync_debug_mode("error")

    def _wait_and_commit(self, step: InflightStep) -> list[RequestOutput]:
        t0 = time.perf_counter()
        tokens = self.runner.wait(step.slot)
        t1 = time.perf_counter()
        outputs = self._commit(step.slot.rows, tokens)
        fwd, smp, idle = self.runner.gpu_times_ms(step.index, self._last_committed)
        self._last_committed = step.index
        t2 = time.perf_counter()
        self.timings.add_step(wait=t1 - t0, commit=t2 - t1, forward_gpu=fwd / 1e3, sample_gpu=smp / 1e3,
                              gpu_idle=idle / 1e3, tokens=len(tokens), rows=len(step.slot.rows),
                              extra=dict(period=t2 - self._last_commit_time, decode=step.slot.max_query_len == 1))
        self._last_commit_time = t2
        return outputs

    def _commit(self, rows, tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        now = time.perf_counter()
        for row in rows:
            seq = row.seq
            seq.inflight_refs -= 1
            if row.sample:
                seq.num_pending -= 1
            if seq.finalized:                     # zombie: rode along, commits nothing
                self.timings.zombie_rows += 1
                self.scheduler.release_if_idle(seq)
                continue
            if not row.sample:
                continue
            token = tokens[row.sample_idx]
            seq.output_token_ids.append(token)
            seq.first_token_time = seq.first_token_time or now
            reason = self._stop_reason(seq, token)
            if reason:
                self._finish(seq, reason, now)
            outputs.append(RequestOutput(seq.seq_id, [token], seq.finalized, seq.finish_reason,
                                         seq.text, seq.output_token_ids))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if p.stop and self._hit_stop_string(seq):
            return "stop"
        if seq.num_tokens >= seq.max_len:      # max_tokens, or the context is full
            return "length"
        return None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_token_ids)
        hits = [text.find(s) for s in seq.params.stop if s in text]
        if hits:
            seq.text = text[:min(hits)]
        return bool(hits)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if not seq.text and self.tokenizer is not None:
            ids = seq.output_token_ids
            if reason == "stop" and ids and (ids[-1] in self.eos_ids or ids[-1] in seq.params.stop_token_ids):
                ids = ids[:-1]
            seq.text = self.tokenizer.decode(ids)
        seq.finish_time = now
        self.scheduler.finish(seq, reason)

    # ---- convenience -----------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Run prompts (strings or token id lists) to completion; returns the finished Sequences in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        while self.has_unfinished():
            self.step()
        return [self.take(i) for i in ids]

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield (new_token_ids, text_delta) for one request as tokens arrive."""
        seq_id = self.add_request(prompt, params)
        seq, shown = self._seqs[seq_id], ""
        while not seq.finalized:
            outs = [o for o in self.step() if o.seq_id == seq_id]
            if not outs:
                continue
            text = seq.text if seq.finalized else self.tokenizer.decode(seq.output_token_ids)
            if not seq.finalized and text.endswith("\ufffd"):
                continue                          # wait for the rest of a multi-byte character
            yield outs[0].new_token_ids, text[len(shown):]
            shown = text
        self._seqs.pop(seq_id, None)
        while self._inflight and not self.scheduler.has_work():   # its zombie step, if any
            self.step()
