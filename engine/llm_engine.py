"""The engine: requests in, outputs out, through scheduler -> model runner -> commit
(engine/commit.py) -> output processor.

`depth=1` is the blocking loop: plan, launch, wait, commit, one step at a time; `depth=2` launches step t+1
before committing step t (docs/pipeline.md). Per-step timings are kept as counters (`self.timings`).

A bad request never stalls the others: its parameters are validated when it is added, and an exception
while a step is planned, launched or committed ends only the request it belongs to (every request of the
step when it cannot be told apart) with finish_reason "error" and a message; its pages are freed and the
loop goes on. Finished requests are forgotten unless added with `retain=True` (then `take()` hands them over).
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

from engine.commit import Commits, describe
from engine.config import EngineConfig
from engine.guided.snapshot import Snapshot, build_snapshot, guided_columns
from engine.guided.tracker import GuidedTracker
from engine.memory.block_manager import BlockManager
from engine.memory.row_pool import RowPool
from engine.models.loader import load_tokenizer, resolve_model
from engine.parallel.group import TensorParallelError
from engine.requests import _hostpath
from engine.requests.frontend import EngineFrontend
from engine.requests.output import OutputProcessor, RequestOutput
from engine.requests.request_handle import RequestHandle
from engine.requests.sequence import SamplingParams, Sequence
from engine.requests.validation import check_request, prompt_ids
from engine.runner.model_runner import ModelRunner
from engine.runner.rows import RowError
from engine.runner.slots import DecodeSlot
from engine.scheduler import Scheduler
from engine.speculative.drafters.draft_model import draft_source
from engine.speculative.plan import SpecPolicy, short_rows
from engine.speculative.budget import engine_levels
from engine.timings import StepTimings
from engine.workers.cluster import start_ranks

__all__ = ["LLMEngine", "RequestOutput", "RequestHandle", "TensorParallelError"]


@dataclass
class InflightStep:
    index: int          # step number (alternates the slots, indexes the timing events)
    slot: DecodeSlot    # holds the step's rows until its commit (a slot is prepared again only after it)
    snapshot: Snapshot | None   # its guided rows, as its grammar callback saw them
    launched: float     # perf_counter when it was enqueued


class LLMEngine(EngineFrontend):
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig.of(**overrides)
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (each decode row takes a token)")
        self.config = config
        self.source = resolve_model(config.model)
        self.tokenizer_source = resolve_model(config.tokenizer) if config.tokenizer else self.source
        self.tokenizer = load_tokenizer(self.tokenizer_source)
        ctx = int(self.source.config.get("max_position_embeddings", 8192))
        self.max_model_len = min(config.max_model_len or ctx, ctx)
        encode = (lambda text: self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer else None
        # resolved once (resolving the default model hashes its GGUF), for every rank
        draft = draft_source(config, self.source) if config.speculative == "draft_model" else None
        if config.tensor_parallel_size == 1:            # one GPU: no workers
            self.runner = ModelRunner(config, self.source, self.max_model_len, encode, draft=draft)
            self.cluster = None
        else:
            self.runner, self.cluster = start_ranks(config, self.source, draft, self.max_model_len, encode)
        if self.tokenizer is not None and len(self.tokenizer) > self.runner.vocab:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens, more than the model's "
                             f"{self.runner.vocab}")
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, caching=config.prefix_caching)
        self.kv_events = None
        if config.kv_events_endpoint:
            from engine.memory.kv_events import KVEventPublisher
            self.kv_events = KVEventPublisher(config.kv_events_endpoint, config.block_size,
                                              "GPU" if self.runner.cuda else "CPU")
            self.blocks.events = []
        self.spec_k = config.spec_k
        spec = SpecPolicy(self.spec_k, self.runner.spec_rows, self.max_model_len, config.spec_min_acceptance,
                          lookahead=self.runner.draft_lookahead, levels=engine_levels(config),
                          depth=config.tuning.spec_tree and config.num_speculative_tokens,
                          short_rows=short_rows(self.runner.program)) if self.spec_k else None
        if spec is not None:
            spec.budget.set_costs(getattr(self.runner, "step_costs", {}))
        pools = [RowPool(self.runner.pool.num_rows)] + ([RowPool(
            config.penalty_rows, "pen_row", lambda seq: seq.params.penalty_row)] if config.penalty_rows else [])
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, spec, pools)
        # a penalty row's cached span is written by rank 0's runner only: under TP such rows compute it all
        self.scheduler.prefix.cache_penalized = self.cluster is None
        self.eos_ids = self._eos_ids()
        self.runner.eos_ids = self.eos_ids
        self.output = OutputProcessor(self.tokenizer, self.eos_ids)
        self.guided = GuidedTracker(self.tokenizer, self.runner.vocab, self.eos_ids, config, self.runner.cuda,
                                    self.runner.spec_k > 0 and self.runner.program.drafter.lends_vocab)
        if self.runner.draft_masks is not None and self.runner.draft_masks.forced:
            self.runner.draft_masks.set_vocab(self.guided.vocab)    # forced drafts in the native draft nodes
        self.timings = StepTimings()
        self._counted_query = self._counted_hits = 0     # the prefix-cache counters timings already holds
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._seqs: dict[int, Sequence] = {}          # live requests (not finished)
        self._finished: dict[int, Sequence] = {}      # finished requests added with retain=True
        self._listeners: dict[int, deque] = {}        # request id -> its handle's output queue
        self._outbox: list[RequestOutput] = []        # outputs made between steps (aborts), sent by the next
        self.commits = Commits(self.scheduler, self.output, self.timings, self.spec_k, self._seqs, self._finished)
        self._inflight: deque[InflightStep] = deque()
        self._step_index = 0
        self._last_committed: int | None = None
        self._last_commit_time = self._tokens_landed = time.perf_counter()
        self._restart = False                           # the loop drained: period counts from the next launch
        self._prompt_scorer = None                      # built for the first request asking for prompt_logprobs
        if self.runner.cuda and config.guided and config.tuning.switch_interval > 0:
            sys.setswitchinterval(config.tuning.switch_interval)     # process-wide

    def _tp_watch(self):
        return self.cluster.watch() if self.cluster is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Free what outlives a dropped engine: captured grammar callbacks, the compile threads, the
        tensor-parallel workers."""
        try:
            self.runner.close()
            self.guided.close()
            if self.kv_events is not None:
                self.kv_events.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()

    def prefix_cache_stats(self) -> dict:
        b = self.blocks
        return dict(prefix_query_tokens=b.query_tokens, prefix_hit_tokens=b.hit_tokens,
                    prefix_cached_pages=b.num_cached, prefix_evictions=b.evictions)

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (pages held by live requests stay with them); returns how many."""
        dropped = self.blocks.reset_cache()
        self._publish_kv_events()
        return dropped

    def _publish_kv_events(self) -> None:
        """Hand what changed in the cached pages since the last call to the KV event publisher (if any)."""
        if self.blocks.events:
            self.kv_events.publish(self.blocks.events)
            self.blocks.events = []

    def _eos_ids(self) -> frozenset[int]:
        eos = self.source.config.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    retain: bool = False, stream: bool = False, detokenize: bool = True) -> int:
        """Queue a request; returns its id. Raises ValueError naming the problem for bad input.
        stream=True: each output carries the text it adds (incremental detokenization); otherwise a request
        without stop strings decodes its text once, at the end (its final output carries all of it).
        detokenize=False: token ids only, no text at all (a caller that detokenizes itself; no stop strings)."""
        params = SamplingParams() if params is None else params
        ids = prompt_ids(prompt, self.encode)
        check_request(ids, params, self.runner.vocab, self.max_model_len, self.blocks,
                      has_tokenizer=self.tokenizer is not None, spec_k=self.spec_k, logprobs=self.config.logprobs,
                      penalties=self.config.penalty_rows > 0, eos_ids=self.eos_ids,
                      tensor_parallel=self.cluster is not None)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seq = Sequence(self._next_id, ids, params, seed=seed, arrival=time.perf_counter(), retain=retain,
                       max_len=min(len(ids) + params.max_tokens, self.max_model_len))
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = self._scorer().score(ids, params.prompt_logprobs)
        if params.guide is not None:
            self.guided.start(seq)
        self._next_id += 1
        self.output.start(seq, stream=stream, detokenize=detokenize)
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def _scorer(self):
        if self._prompt_scorer is None:
            from engine.sampling.prompt_logprobs import PromptScorer
            self._prompt_scorer = PromptScorer(self.runner, self.config.block_size)
        return self._prompt_scorer

    def abort(self, request_id: int) -> bool:
        """End a live request now (finish_reason "abort"); its final output comes with the next step.
        Pages go back once no launched step holds its row. False: no such live request."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self.commits.finish(seq, "abort")
        self._outbox.append(self.commits.final_output(seq, "abort"))
        return True

    def take(self, request_id: int) -> Sequence:
        """Hand over a finished request added with retain=True, and forget it."""
        if request_id not in self._finished:
            raise KeyError(f"no finished retained request {request_id}")
        return self._finished.pop(request_id)

    def num_live_requests(self) -> int:
        return len(self._seqs)

    def set_depth(self, depth: int) -> None:
        """Switch between the blocking (1) and pipelined (2) loop; in-flight steps drain first."""
        while self._inflight:
            self.step()
        self.config = dataclasses.replace(self.config, depth=depth)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight) or bool(self._outbox)

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then commit the oldest in-flight one once `depth` steps are in flight.
        With nothing new to launch, the in-flight steps drain. Returns every output made (all requests)."""
        t0 = time.perf_counter()
        if self.cluster is not None:
            self.cluster.check()                # a lost worker ended the engine: say so on every call
        outputs, self._outbox = self._outbox, []
        outputs += [self.commits.fail(seq, message) for seq, message in self.guided.poll()]
        launched = self._plan_and_launch(outputs)
        if self.scheduler.closing:
            outputs += self.commits.close(self.scheduler.closing)
        while self._inflight and (len(self._inflight) >= self.config.depth or not launched):
            outputs += self._wait_and_commit(self._inflight.popleft())
        if not launched and not self._inflight:
            self._last_committed = None             # drained: the next step's idle and period start afresh
            self._restart = True
            if not outputs:
                self.guided.wait_for_compile(timeout=0.05)  # only compiling grammars hold the requests back
        self._deliver(outputs)
        self._publish_kv_events()
        self.timings.wall += time.perf_counter() - t0
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not self._listeners:
            return
        for out in outputs:
            queue = self._listeners.get(out.request_id)
            if queue is not None:
                queue.append(out)
                if out.finished:
                    del self._listeners[out.request_id]

    def _plan(self, outputs) -> tuple[list, DecodeSlot] | None:
        """Schedule and fill the next slot. A row whose inputs cannot be written fails its request and the
        step is planned again without it; a scheduler failure cannot be pinned on one request, so it fails
        every request the scheduler holds (and frees their pages)."""
        slot = self.runner.slots[self._step_index % 2]
        while True:
            try:
                rows = self.scheduler.schedule()
            except Exception as exc:
                doomed = list(self.scheduler.running) + list(self.scheduler.waiting)
                outputs += [self.commits.fail(s, f"scheduling failed: {describe(exc)}") for s in doomed]
                return None
            if not rows:
                return None
            try:
                self.runner.prepare(slot, rows, quiet=self.scheduler.spec is not None and self.scheduler.spec.quiet)
                return rows, slot
            except RowError as err:
                outputs.append(self.commits.fail(rows[err.index].seq, f"could not prepare its step inputs: {err}"))

    def _plan_and_launch(self, outputs) -> bool:
        t0 = time.perf_counter()
        planned = self._plan(outputs)
        if planned is None:
            return False
        rows, slot = planned
        # before the rows count this step's tokens
        walk = _hostpath.guided_columns if self.scheduler.native else guided_columns
        snapshot = build_snapshot(slot.index, rows, self._step_index, 1 + slot.spec_k, walk) \
            if slot.guided_rows else None
        self.scheduler.launched(rows)
        all_greedy = slot.all_greedy
        t1 = time.perf_counter()
        try:
            with self.runner.sync_guard(), self._tp_watch():
                if self.cluster is not None:    # the workers launch the same step on their shards
                    self.cluster.channel.publish(slot, self._step_index, all_greedy, snapshot is not None)
                replay_s = self.runner.launch(slot, self._step_index, all_greedy, snapshot)
        except TensorParallelError:
            raise
        except Exception as exc:
            outputs += self._unlaunch(rows, f"launching its step failed: {describe(exc)}")
            return False
        self._inflight.append(InflightStep(self._step_index, slot, snapshot, t1))
        if self._restart:
            self._last_commit_time, self._restart = t0, False
        self._step_index += 1
        self.timings.add(plan=t1 - t0, launch=time.perf_counter() - t1, replay=replay_s, quiet_steps=slot.quiet)
        if self.blocks.query_tokens != self._counted_query:      # admissions looked up the prefix cache
            self._count_prefix_lookups()
        return True

    def _count_prefix_lookups(self) -> None:
        b = self.blocks
        self.timings.add(prefix_query_tokens=b.query_tokens - self._counted_query,
                         prefix_hit_tokens=b.hit_tokens - self._counted_hits)
        self._counted_query, self._counted_hits = b.query_tokens, b.hit_tokens

    def _unlaunch(self, rows, message: str) -> list[RequestOutput]:
        """A launch raised: which row caused it is unknown, so the step's requests fail. Nothing of the step
        will be committed, so its rows stop holding their sequences (pages can go back)."""
        outputs = []
        for row in rows:
            if self.scheduler.landed(row):
                outputs.append(self.commits.fail(row.seq, message))
        return outputs

    def _wait_and_commit(self, step: InflightStep) -> list[RequestOutput]:
        t0 = time.perf_counter()
        with self._tp_watch():
            tokens = self.runner.wait(step.slot)
        t1 = time.perf_counter()
        outputs = self.commits.step(step.slot.rows, tokens, self.guided.step_failure(step.snapshot),
                                    self.runner.logprobs(step.slot), spec=bool(step.slot.spec_k))
        fwd, mask, smp, idle = self.runner.gpu_times_ms(step.slot, step.index, self._last_committed)
        cb, delay = self.guided.callback_times(step.snapshot, max(self._tokens_landed, step.launched))
        self._last_committed, self._tokens_landed = step.index, t1
        t2 = time.perf_counter()
        self.timings.add_step(wait=t1 - t0, commit=t2 - t1, forward_gpu=fwd / 1e3, mask_wait_gpu=mask / 1e3,
                              sample_gpu=smp / 1e3, gpu_idle=idle / 1e3, callback=cb, callback_delay=delay,
                              guided_steps=step.snapshot is not None, tokens=len(tokens), rows=len(step.slot.rows),
                              extra=dict(period=t2 - self._last_commit_time, decode=step.slot.max_query_len == 1))
        self._last_commit_time = t2
        return outputs
