"""Runs one step: fills a DecodeSlot from scheduled rows, launches forward + sampling, brings tokens back.

Streams (CUDA): the slot's inputs go up on `copy_in_stream` (event `inputs_ready`); forward and sampling
run on `compute_stream`; the sampled tokens come back on `copy_out_stream`, anchored to the step's
`sampled_ready` event, and `copy_done` tells the host they landed. Nothing runs on the default stream.
On the CPU the same calls run synchronously. With `native_launch` a graph step makes these calls in one native
call (engine/runner/native_launch.py).
"""
from __future__ import annotations

import contextlib

import torch

from engine.backend import make_backend
from engine.config import EngineConfig
from engine.guided.draft_masks import DraftMasks
from engine.guided.masks import GrammarMasks
from engine.memory.kv_cache import KVBudget, PagedCache, kv_pages
from engine.memory.token_pool import TokenPool
from engine.models.loader import ModelSource
from engine.models.weights import build_model
from engine.parallel.group import SINGLE
from engine.runner.graphs import StepGraphs
from engine.runner import native_launch
from engine.runner.kernel_routes import decode_stack, route_table
from engine.runner.rows import fill_slot
from engine.runner.slots import DecodeSlot
from engine.runner.step import StepProgram, StepVariant
from engine.runner.step_costs import time_steps
from engine.sampling.logprobs import HostLogprobs
from engine.sampling.penalties import PenaltyState
from engine.sampling.sampler import apply_bitmask
from engine.speculative.drafters import drafter_caches, make_drafter
from engine.runner.spec_step import SpecStepProgram
from engine.speculative.state import SpecState
from engine.speculative.tree import config_tree

_EVENT_RING = 4  # timing events per step index: a step's are read at its commit, two launches later at most


class ModelRunner:
    """One rank's runner. With tensor parallelism (`tp` a DistGroup) every rank builds the same runner over
    its shard of the model and runs the same steps; rank 0's engine plans them and fills the grammar masks,
    the other ranks receive both (engine/workers/worker.py). `draft`: the draft model's ModelSource with
    speculative="draft_model" (LLMEngine resolves it, once for every rank)."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, encode=None, tp=SINGLE,
                 draft=None):
        self.config, self.tp = config, tp
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.cuda = self.device.type == "cuda"
        self.max_model_len = max_model_len
        self.model = build_model(source, self.dtype, self.device, max_model_len, tp)
        self.vocab = source.config["vocab_size"]
        self.backend = make_backend(config.backend_name(), **config.backend_options(), device=self.device)
        self.draft_source = draft
        self.kv_budget = self._kv_budget(source)
        self.num_blocks = tp.agree_min(self._num_kv_blocks())    # block tables index every rank's
        self.kv_caches = self._allocate_kv(source.config)
        new_stream = (lambda: torch.cuda.Stream(self.device)) if self.cuda else (lambda: None)
        self.compute_stream, self.copy_in_stream, self.copy_out_stream = new_stream(), new_stream(), new_stream()
        self.spec_k = config.spec_k
        tuning = config.tuning
        self.masks = GrammarMasks(self.vocab, config.max_num_seqs, self.device, tuning.grammar_threads, self.spec_k,
                                  tp, python=tuning.grammar_node == "python", tree=config_tree(config)) \
            if config.guided else None
        self.spec_rows = spec_rows_limit(config)
        # a row for every sequence that may hold pages: running ones, and finished ones in in-flight steps
        pool_rows = 3 * config.max_num_seqs
        self.pool = SpecState(pool_rows, max_model_len, self.spec_k, self.device) if self.spec_k \
            else TokenPool(pool_rows, 0, self.device)
        args = (self.model, self.kv_caches, self.backend, max_model_len, self.compute_stream, self.masks)
        step_io = config.tuning.step_io_kernels and self.backend.fused and tp.world == 1
        self.penalties = PenaltyState(config.penalty_rows, self.vocab, self.device) if config.penalty_rows else None
        self.eos_ids: frozenset[int] = frozenset()      # what min_tokens masks besides stop ids (set by the engine)
        if self.spec_k:
            drafter = make_drafter(config, source, self.model, self.backend, self.num_blocks, max_model_len,
                                   self.draft_source)
            self.program = SpecStepProgram(*args, state=self.pool, drafter=drafter,
                                           block_size=config.block_size, draft_max_rows=self.spec_rows,
                                           draft_masks=self._draft_masks(drafter, encode), penalties=self.penalties,
                                           spec_kernels=config.use_spec_kernels(),
                                           finish_kernel=config.use_spec_kernels() and config.tuning.spec_finish_kernel,
                                           tree=config_tree(config), step_io=step_io)
        else:
            self.program = StepProgram(*args, penalties=self.penalties, pool=self.pool, step_io=step_io)
        self.draft_masks = getattr(self.program, "draft_masks", None)     # guided drafting's host side, or None
        # positions past a row's inputs the drafter writes KV at (the scheduler reserves pages for them)
        self.draft_lookahead = self.program.drafter.lookahead if self.spec_k else 0
        max_blocks = -(-max_model_len // config.block_size)
        self.slots = [DecodeSlot(i, config.max_num_batched_tokens, config.max_num_seqs, max_blocks, self.device,
                                 self.spec_k, config.logprobs, bool(config.penalty_rows)) for i in range(2)]
        self.slot_events = [self._events(("inputs_ready", "copy_done"), timing=False) for _ in self.slots]
        self.step_events = [self._events(("start", "sampled_ready"), timing=True) for _ in range(_EVENT_RING)]
        for slot in self.slots:         # recorded inside the step (graphs too): read at the slot's commit
            slot.marks = self._events(("forward_done", "mask_waited"), timing=True, external=True)
        if self.backend.name == "triton":      # the drafter's matmuls are routed too: the table comes after it
            sites = self.model.route_sites() + (self.program.drafter.route_sites() if self.spec_k else [])
            self.backend.routes = route_table(config, sites, self.backend, self.spec_rows)
            self.backend.stack = decode_stack(self.model, self.kv_caches, self.backend.routes,
                                              getattr(self.program, "aux_layers", ()))
        self.graphs = None
        if self.cuda and not config.enforce_eager and self.backend.name == "triton":
            self.graphs = StepGraphs(config, max_model_len, guided=self.masks is not None, spec_rows=self.spec_rows)
            self.graphs.capture(self.program, self.slots, self.compute_stream)
        # seconds a step by (K, rows), for the draft budget (engine/speculative/budget.py); every rank times them,
        # in the same order (a tensor-parallel step's collectives pair up)
        timed = self.graphs is not None and self.spec_k and config.tuning.spec_budget
        self.step_costs = time_steps(self.graphs, self.slots[0], self.compute_stream, self.num_blocks,
                                     config.block_size) if timed else {}
        self.native = native_launch.for_runner(self, config.tuning.native_launch)

    # ---- setup -------------------------------------------------------------------------------
    def _kv_shape(self, cfg):
        attn = self.model.layers[0].self_attn
        return (self.config.block_size, attn.num_kv_heads, attn.head_dim), cfg["num_hidden_layers"]

    def _kv_budget(self, source) -> KVBudget:
        """Every cache the block tables index: the target's (this rank's heads), and a head's or a draft
        model's, which have one page per block id too."""
        (_, h, d), layers = self._kv_shape(source.config)
        caches = [PagedCache("target", layers, h, d)]
        if self.config.spec_k:
            caches += drafter_caches(self.config, source, self.draft_source)
        return KVBudget(tuple(caches), self.config.block_size, self.dtype)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            return self.kv_budget.pages_for_memory(free, self.config.kv_cache_memory_fraction)
        bs = self.config.block_size
        per_seq = -(-min(self.max_model_len, 4096) // bs)
        return per_seq * min(self.config.max_num_seqs, 8)

    def _allocate_kv(self, cfg):
        shape, layers = self._kv_shape(cfg)
        return kv_pages(layers, (self.num_blocks, *shape), self.dtype, self.device)

    def _draft_masks(self, drafter, encode):
        """Grammar masks / forced tokens for the draft steps of a drafter that picks tokens (not n-gram)."""
        c = self.config
        forced = c.tuning.guided_forced_drafts and encode is not None
        if self.masks is None or drafter.uses_history or not (c.tuning.guided_draft_masks or forced):
            return None
        return DraftMasks(self.masks, self.spec_k, self.spec_rows, c.tuning.guided_draft_masks, forced, encode,
                          getattr(self.backend, "apply_bitmask", apply_bitmask), c.num_speculative_tokens)

    def _events(self, names, timing: bool, external: bool = False):
        if not self.cuda:
            return None
        # external: recorded as event nodes inside a captured graph, so their times stay readable per replay
        return {k: torch.cuda.Event(enable_timing=timing, external=external) for k in names}

    def close(self) -> None:
        if self.graphs is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.graphs.close()

    # ---- plan (host only) --------------------------------------------------------------------
    def prepare(self, slot: DecodeSlot, rows, quiet: bool = False) -> None:
        """Fill the slot's host buffers for these rows and pick its graph (engine/runner/rows.py fill_slot).
        quiet: a plain step of a speculating engine that drafts nothing (engine/speculative/plan.py). Raises
        RowError naming the row whose inputs could not be written."""
        fill_slot(slot, rows, self.config.block_size, self.spec_k, self.penalties, self.eos_ids,
                  self.spec_k and self.program.drafter.uses_history)
        slot.quiet = bool(quiet and self.spec_k and not slot.spec_k)
        admits = self.spec_k and not slot.spec_k and slot.max_query_len > 1     # (spec steps admit no request)
        slot.vocab_writes = self.program.drafter.vocab_writes(rows) if admits else None
        slot.graph_key = self.graphs.key_for(slot) if self.graphs else None
        if slot.graph_key:
            self.graphs.pad(slot, slot.graph_key)

    # ---- launch (enqueue only) ---------------------------------------------------------------
    def launch(self, slot: DecodeSlot, step_index: int, all_greedy: bool, snapshot=None, guided: bool | None = None,
               download: bool = True) -> float:
        """Enqueue upload, forward, (grammar branch), sampling and the token copy; returns without waiting
        (on CUDA) the host seconds of the step graph's replay (0: an eager step; a native launch: its whole
        call). `snapshot`: the step's guided rows (engine/guided/masks.py), None if it has none. A
        tensor-parallel worker runs guided steps without a snapshot (`guided`: rank 0 fills the masks) and reads
        no tokens back (`download` False). `slot.extras` picks the variant with logprobs and penalties."""
        variant = StepVariant(snapshot is not None if guided is None else guided, all_greedy, slot.extras)
        if self.native is not None and self.native.takes(slot):
            return self._launch_native(slot, step_index, variant, snapshot, download)
        prev = self.slots[1 - slot.index]
        ev, te = self.slot_events[slot.index], self.step_events[step_index % _EVENT_RING]
        if self.cuda:
            with torch.cuda.stream(self.copy_in_stream):
                slot.upload(padded=StepGraphs.padded_seqs(slot.graph_key))
                ev["inputs_ready"].record()
            self.compute_stream.wait_event(ev["inputs_ready"])
        compute = torch.cuda.stream(self.compute_stream) if self.cuda else contextlib.nullcontext()
        with compute, torch.inference_mode():
            if self.cuda:
                te["start"].record()
            if snapshot is not None:
                self.masks.push(snapshot)
            if slot.bias_writes:
                self.penalties.write_bias(slot.bias_writes)
            if slot.span_writes:
                self.penalties.write_span(slot.span_writes)
            if slot.history_writes:
                self.pool.write_history(slot.history_writes)
            if slot.vocab_writes:
                self.program.drafter.write_vocab(slot.vocab_writes)
            replay_s = 0.0
            try:
                if slot.graph_key:
                    replay_s = self.graphs.replay(slot, variant)
                else:
                    self.program.step(slot, prev, variant)
            except BaseException:
                if snapshot is not None:
                    self.masks.unpush(snapshot)
                raise
            if self.cuda:
                te["sampled_ready"].record()
        if snapshot is not None and self.draft_masks is not None:
            self.draft_masks.learn_forced()             # (the step is on its way)
        if not download:
            return replay_s
        if self.cuda:
            self.copy_out_stream.wait_event(te["sampled_ready"])
            with torch.cuda.stream(self.copy_out_stream):
                slot.download_sampled()
                ev["copy_done"].record()
        else:
            slot.download_sampled()
        return replay_s

    def _launch_native(self, slot, step_index: int, variant, snapshot, download: bool) -> float:
        if snapshot is not None:
            self.masks.push(snapshot)
        try:
            return self.native.launch(slot, step_index, variant, StepGraphs.padded_seqs(slot.graph_key), download)
        except BaseException:
            if snapshot is not None:
                self.masks.unpush(snapshot)
            raise

    def sync_guard(self):
        """debug_sync: any device->host synchronisation while enqueuing a step raises (CUDA only)."""
        if not (self.config.tuning.debug_sync and self.cuda):
            return contextlib.nullcontext()
        return _sync_debug_mode("error")

    # ---- results -----------------------------------------------------------------------------
    def wait(self, slot: DecodeSlot) -> list:
        """Block until this slot's tokens are on the host (an event sync: it releases the GIL). One token per
        sampling row; in a speculating step one list per row: emitted tokens (PAD after), then drafts verified
        (a plain step of a speculating engine emits its one token in the first column)."""
        if self.cuda:
            self.slot_events[slot.index]["copy_done"].synchronize()
        if not self.spec_k:
            return slot.sampled_host[:slot.num_sample].tolist()
        out = slot.spec_out_host[:slot.num_sample]
        return out.tolist() if slot.spec_k else out[:, 0].tolist()

    def logprobs(self, slot: DecodeSlot) -> HostLogprobs | None:
        """The logprobs of a slot whose tokens were waited for, if its step recorded them."""
        return HostLogprobs(slot.logprobs_host, slot.num_sample, self.vocab) if slot.want_logprobs else None

    def gpu_times_ms(self, slot: DecodeSlot, step_index: int, prev_index: int | None) -> tuple:
        """(forward, mask wait, sampling, idle before it) device times of a step whose tokens were waited
        for. Mask wait: the compute stream waiting for `mask_ready` after the forward (0 when unguided).
        Idle: from the end of step `prev_index` on the compute stream to this step's start."""
        if not self.cuda:
            return 0.0, 0.0, 0.0, 0.0
        te, marks = self.step_events[step_index % _EVENT_RING], slot.marks
        pairs = [(te["start"], marks["forward_done"]), (marks["forward_done"], marks["mask_waited"]),
                 (marks["mask_waited"], te["sampled_ready"])]
        if prev_index is not None and step_index - prev_index < _EVENT_RING:
            pairs.append((self.step_events[prev_index % _EVENT_RING]["sampled_ready"], te["start"]))
        times = self.native.elapsed_ms(pairs) if self.native is not None else [a.elapsed_time(b) for a, b in pairs]
        return times[0], times[1], times[2], max(0.0, times[3]) if len(times) > 3 else 0.0


def spec_rows_limit(config: EngineConfig) -> int:
    """Most rows a spec step may hold (graph sizes too): the policy's, the batch's and the token budget's."""
    k = config.spec_k
    return min(config.spec_max_batch, config.max_num_seqs, config.max_num_batched_tokens // (k + 1)) if k else 0


@contextlib.contextmanager
def _sync_debug_mode(mode: str):
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
