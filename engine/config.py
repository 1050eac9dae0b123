"""The engine's one configuration object."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a method needs it: the server's supervisor and API processes build and check an
# EngineConfig but never load torch (~3.5 s of CPU and ~200 MB a process)
SPECULATIVE = ("none", "ngram", "eagle", "draft_model")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default_factory=lambda: os.environ.get("SPECDEC_MODEL", "default"))
    tokenizer: str = ""                # "" -> the model's own; else a model spec whose tokenizer to use (e.g.
                                       # "default" for dummy weights of SmolLM2's shape)
    device: str = "auto"               # "auto" -> cuda if available else cpu
    dtype: str = "auto"                # "auto" -> bfloat16 on cuda, float32 on cpu
    attention_backend: str = "auto"    # "torch" | "triton" | "auto" (triton on cuda)
    block_size: int = 16               # tokens per KV page
    num_kv_blocks: int = 0             # 0 -> size from kv_cache_memory_fraction / max_model_len
    kv_cache_memory_fraction: float = 0.5
    max_num_seqs: int = 64             # rows in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    max_model_len: int = 0             # 0 -> the model's context length
    depth: int = 2                     # 1 = blocking loop, 2 = pipelined (step t+1 launched before t commits)
    prefix_caching: bool = True        # full KV pages shared by prompts with the same prefix, kept after their
                                       # request until evicted (engine/memory/block_manager.py)
    enforce_eager: bool = False        # True: no CUDA graphs (steps are captured on CUDA + Triton)
    decode_gemv: bool = True           # steps of <= 4 rows: the fused path's matmuls are engine/kernels/matmul/
                                       # decode_gemv.py (weights read before the dependent-launch wait), not cuBLAS
    draft_gemv: bool = True            # the EAGLE draft steps' LM head argmax and residual on the decode GEMV
                                       # (engine/kernels/matmul/draft_gemv.py) where decode_gemv is on
    spec_finish_kernel: bool = True    # with spec_kernels, a greedy unguided spec step's acceptance, finish and the
                                       # head's next ids in one kernel (engine/kernels/spec/spec_finish.py)
    verify_gemv: bool = False          # a greedy verification (unguided, no extras, <= decode_gemv_rows rows) takes
                                       # the target's LM head argmax from draft_gemv's kernels, no logits, where
                                       # those run; off: no faster than cuBLAS + argmax at 4 rows on an H100
    head_gemv: bool = True             # a greedy step (plain or verifying; unguided, no extras) takes its tokens
                                       # without float32 logits: from draft_gemv's LM head argmax kernels (plain
                                       # steps of <= decode_gemv_rows rows), else cuBLAS's logits and engine/
                                       # kernels/sampling/argmax.py, where those run (the Triton backend)
    head_mma: bool = True              # greedy heads of up to head_mma_to rows that the GEMV does not keep (see
                                       # head_mma_from) take their tokens from engine/kernels/matmul/head_mma.py's
                                       # argmax on tensor cores, no logits, in place of the GEMV's argmax or cuBLAS's
                                       # logits and the argmax's block max, where the backend is Triton. H200: 16 us
                                       # a head at 1-4 rows against the GEMV argmax's 19 / 31 / 48 (bench/results/
                                       # head_mma_step/); in the step past 4 rows within noise (head_rows/)
    head_mma_from: int = 1             # with head_mma, also the GEMV's heads of N rows or more (0: none; 1: all,
                                       # an EAGLE draft's after the final norm's kernel, which the GEMV folds in)
    head_mma_to: int = 4               # with head_mma, only heads of at most N rows (up to 64, all it can take)
    long_row_gemv: bool = True         # the decode GEMV also takes matmuls without a prologue whose rows are past
                                       # 8192 (up to 16384, 8 warps a row): Llama 8B's down projection (14336),
                                       # which silu_epilogue left without one, off cuBLAS and its split-K reduce:
                                       # 4.14 -> 4.10 ms a step, 32 kernels fewer (H200, bench/results/
                                       # attention_rules/); SmolLM2 and Llama 1B have no such rows
    long_k_gemv_rows: int = 1          # the decode GEMV takes a matmul of K past 2048, whose rows it takes one at a
                                       # time (a pass over its registers each), only in steps of at most this many
                                       # rows (1 to 8); cuBLAS takes larger ones: Llama 8B's 4-row step 9.68 -> 4.59
                                       # ms (H200, bench/results/rows_by_model/); SmolLM2 has no such K
    decode_gemv_rows: int = 4          # the decode GEMV (and draft_gemv's argmax) takes steps of at most this many
                                       # rows (1 to 8), but for the matmuls decode_gemm_split gives decode_gemm
    decode_gemm_rows: int = 32         # steps of decode_gemv_rows + 1 to this many rows (at most 32; 0: none): the
                                       # fused path's matmuls are engine/kernels/matmul/decode_gemm.py (tensor cores,
                                       # weights read before the wait) not cuBLAS, where decode_gemv is on; under
                                       # dependent launch (SPECDEC_PDL_MAX_ROWS, 32) on an H100 8 streams 0.97 ->
                                       # 0.83 ms a step, 32 streams 1.05 -> 0.90 (bench/results/decode_rows/)
    decode_gemm_split: bool = True     # steps of 3 to decode_gemv_rows rows where decode_gemv is on: decode_gemm takes
                                       # the matmuls of small weights (at most 2 M elements: all of SmolLM2's), the
                                       # GEMV the rest (all of Llama 1B's and 8B's); engine/attention.py's
                                       # _split_to_gemm. H200, head_mma on: SmolLM2 4 streams 0.540 -> 0.499 ms a step
                                       # (bench/results/head_rows/); Llama 1B 1.32 against 1.68 with decode_gemm on
                                       # every matmul (bench/results/rows_by_model/); at 2 rows the GEMV is faster
                                       # (SmolLM2 0.482 against 0.493)
    rope_attention: bool = True        # steps whose sequences' new tokens fit one attention block (decode,
                                       # verification): RoPE and the KV store inside the attention kernel, not a
                                       # kernel of their own (engine/kernels/attention/rope_kv.py), where the backend
                                       # is Triton
    split_merge: bool = True           # attention split over KV (small batches) merges its splits in the attention
                                       # kernel (a counter per group, engine/kernels/attention/split_merge.py), not in a
                                       # combine kernel of its own, where the backend is Triton and the launch's
                                       # programs fit one an SM (split_merge.merges). H200 (bench/results/
                                       # llama8b_floor/): Llama 1B 0.838 -> 0.809 ms a step, 8B 4.01 -> 3.96; SmolLM2's
                                       # kernel path 0.417 -> 0.415 ms at 1 stream, 0.634 -> 0.607 at 8
    silu_epilogue: bool = True         # steps on the decode GEMV: SiLU * up in the epilogue of the gate_up GEMV, so
                                       # the down projection reads the activation (engine/kernels/matmul/decode_gemv.py)
    gemm_silu_epilogue: bool = True    # the same in decode_gemm (steps of decode_gemv_rows + 1 .. decode_gemm_rows
                                       # rows): gate_up stores half as much and down reads half, with no SiLU. H200
                                       # (bench/results/gemm_silu_epilogue/): forward 0.730 -> 0.653 ms a step at 32
                                       # streams, 0.603 -> 0.535 at 8
    step_io_kernels: bool = True       # plain and guided steps: their input ids (carried from the token pool) and
                                       # embedding rows in one kernel, and their tokens' copy to the slot and the
                                       # pool in one (engine/kernels/step_io.py), in place of seven torch kernels,
                                       # where the backend is Triton and the model on one rank. H200 (bench/results/
                                       # step_ends/): period 0.414 -> 0.405 ms a step at 1 stream, 0.667 -> 0.654 at 32
    decode_attention: bool = True      # steps of one new token a sequence (decode, the EAGLE head's draft steps):
                                       # attention whose metadata, RoPE rows and first cached KV tile load before
                                       # the dependent-launch wait (engine/kernels/attention/decode_attention.py):
                                       # SmolLM2 1 stream 0.446 -> 0.414 ms, Llama 1B 0.871 -> 0.799 (H200,
                                       # bench/results/decode_attention/)
    decode_attention_splits: int = 0   # decode_attention's KV splits: 0 picks them by paged_attention's rule for the
                                       # step's grid and context bound; a power of two up to 32 sets them for every
                                       # such step (2 or 4 beat the rule nowhere on an H200: bench/results/
                                       # attention_rules/)
    decode_attention_prefetch: int = 0 # cached KV tiles (64 keys) of each decode_attention split read before the
                                       # dependent-launch wait: 1 or 2 (227 registers against 185 on sm_90, no
                                       # spills), 0 by rule: 2 where a launch does not split KV (SmolLM2 32 streams
                                       # 0.814 -> 0.776 ms a step), else 1 (decode_attention.prefetch_rule)
    native_launch: bool = True         # graph steps enqueue their upload, events, replay and token download in one
                                       # native call (engine/runner/native_launch.py), not nine torch calls: the
                                       # host launch 224 -> 19 us at 1 stream on an H200 machine, guided 1.02 /
                                       # 1.04 / 1.06x at 1 / 8 / 32 streams (bench/results/native_launch/); warns
                                       # and keeps the Python launch where it cannot run
    spec_kernels: bool = True          # the speculative step's correction and draft layout in one Triton kernel each
                                       # (engine/kernels/spec/spec_ops.py) where the backend is Triton
    draft_gather: bool = True          # with spec_kernels, the draft layout kernel also gathers the EAGLE head's
                                       # step-0 query and feature of each row (two torch kernels fewer a step:
                                       # EAGLE K = 3 step 0.802 -> 0.795 ms, H100, bench/results/draft_vocab/)
    guided: bool = True                # guided decoding: grammar masks, and graph variants holding their branch
    grammar_node: str = "native"       # who fills the masks: "native" (the grammar node: C++ through tvm-ffi,
                                       # no GIL) or "python" (xgrammar's Python API; the reference path)
    grammar_threads: int = 4           # threads the grammar node fills a step's rows on (from 8 rows); H100
                                       # host, 128 JSON rows: 1.77 / 0.74 / 0.52 ms with 1 / 2 / 4 threads
    switch_interval: float = 2e-4      # Python's GIL switch interval set on CUDA (0: leave it): a Python grammar
                                       # callback waits up to this for the GIL (the default 5 ms > a step)
    speculative: str = "none"          # drafter: "none" | "ngram" | "eagle" | "draft_model" (engine/spec/drafters)
    spec_head: str = ""                # eagle: a head directory ("" = the one shipped for the model, "random")
    spec_draft_vocab: str = ""         # eagle: a JSON list of token ids, most frequent first (specdec.eagle.
                                       # token_ranks); unguided drafts come from its first spec_draft_vocab_size
                                       # only, a smaller LM head. "": the head directory's token_ranks.json where
                                       # it has one; "none": the whole vocabulary
    spec_draft_vocab_size: int = 16384  # 0: every id of the ranking. 16 K of the shipped head's ranking: batch-1
                                       # chat 1.54x -> 1.62x, JME 2.12x -> 2.13x (bench/results/draft_vocab/)
    spec_draft_model: str = ""         # draft_model: a model spec sharing the tokenizer (path, "default", "dummy:X")
    grammar_compile_threads: int = 4   # grammars compiling at once (engine/guided/compiler.py)
    grammar_compile_queue: int = 64    # a server's compiles unfinished at once before it answers 429 (a client
                                       # may have a quarter of them, and run grammar_compile_threads - 1)
    grammar_compile_timeout_s: float = 10.0     # a request whose grammar compiles longer fails (and its compile
                                                # is stopped, with grammar_compile_processes)
    grammar_compile_processes: bool = False     # xgrammar compiles in child processes at low CPU priority, killed
                                                # once no request waits (engine/guided/compile_procs.py; serve's
                                                # default); off: on threads of this process, run to their end
    grammar_cache_mb: int = 512        # compiled grammars kept for reuse, by their size; least recently used go first
    guide_max_bytes: int = 256 << 10   # bounds on one guide, checked before compiling (engine/guided/limits.py)
    guide_max_enum: int = 4096
    guide_max_depth: int = 64
    guide_max_repeat: int = 1000
    guided_draft_masks: bool = False   # guided + speculative: each draft step of a head / draft model picks its
                                       # token under the row's grammar (one grammar node per draft step). Off:
                                       # acceptance 3.50 -> 3.64, but each draft step waits for its mask on the
                                       # grammar stream: 1.96x vs the head's 2.35x at batch 1 on an H100, with
                                       # native nodes (bench/results/grammar_node/spec_guided_streams.md)
    guided_forced_drafts: bool = False  # guided + speculative: where the grammar allows one continuing text, draft
                                       # its tokens in place of the drafter's (engine/guided/draft_masks.py); off
                                       # for the same reason (one callback per step for +0.07 acceptance)
    logprobs: bool = True              # requests may ask for logprobs (engine/sampling/logprobs.py); on CUDA every step
                                       # graph is captured twice, with and without them (False: refused)
    penalty_rows: int = 64             # requests with presence / frequency / repetition penalties holding pages at
                                       # once (engine/sampling/penalties.py: a [rows, vocab] count table; admission
                                       # waits for a row); 0: no penalties, min_p or min_tokens (refused)
    num_speculative_tokens: int = 3    # K: drafts per speculating row (graph shapes are sized from it)
    spec_max_batch: int = 32           # steps with more rows than this do not speculate (they cost more than
                                       # they gain once the forward is no longer launch-bound)
    spec_min_acceptance: float = 1.3  # steps stop speculating while the recent acceptance length (tokens per
                                       # verifying row) is below this; 1 spec step in 16 measures it again
    ngram_min_n: int = 1
    ngram_max_n: int = 3
    tensor_parallel_size: int = 1      # ranks one model is split over (engine/parallel/, engine/workers/): one process
                                       # and GPU each
    tp_backend: str = "auto"           # the step's collectives: "auto" (NCCL on CUDA, gloo on the CPU), "nccl",
                                       # "gloo" (on CUDA: every rank on one GPU, eager steps; for tests)
    tp_timeout_s: float = 120.0        # a step (or a worker's start) taking longer ends the engine: a worker hung
    debug_sync: bool = False           # raise on any device->host sync while a step is enqueued (CUDA)
    seed: int = 0

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.grammar_node not in ("native", "python"):
            raise ValueError(f"grammar_node must be 'native' or 'python', got {self.grammar_node!r}")
        if self.grammar_threads < 1:
            raise ValueError(f"grammar_threads must be >= 1, got {self.grammar_threads}")
        for name in ("grammar_compile_threads", "grammar_compile_queue", "grammar_cache_mb", "guide_max_bytes",
                     "guide_max_enum", "guide_max_depth", "guide_max_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if not 0 <= self.head_mma_from <= 64:                                 # head_mma.MAX_ROWS
            raise ValueError(f"head_mma_from must be 0 to 64, got {self.head_mma_from}")
        if not max(1, self.head_mma_from) <= self.head_mma_to <= 64:
            raise ValueError(f"head_mma_to must be head_mma_from ({self.head_mma_from}) or more, up to 64; got "
                             f"{self.head_mma_to}")
        for name in ("long_k_gemv_rows", "decode_gemv_rows"):
            if not 1 <= getattr(self, name) <= 8:                             # decode_gemv.MAX_ROWS
                raise ValueError(f"{name} must be 1 to 8, got {getattr(self, name)}")
        if self.decode_gemm_rows and not self.decode_gemv_rows < self.decode_gemm_rows <= 32:
            raise ValueError(f"decode_gemm_rows must be 0 (off) or decode_gemv_rows + 1 "
                             f"({self.decode_gemv_rows + 1}) to 32, got {self.decode_gemm_rows}")
        splits = self.decode_attention_splits
        if splits and (splits < 1 or splits > 32 or splits & (splits - 1)):
            raise ValueError(f"decode_attention_splits must be 0 (by rule) or a power of two up to 32, got {splits}")
        if self.decode_attention_prefetch not in (0, 1, 2):
            raise ValueError("decode_attention_prefetch must be 0 (by rule), 1 or 2, got "
                             f"{self.decode_attention_prefetch}")
        if self.spec_draft_vocab_size < 0:
            raise ValueError(f"spec_draft_vocab_size must be >= 0, got {self.spec_draft_vocab_size}")
        if self.depth not in (1, 2):
            raise ValueError(f"depth must be 1 (blocking) or 2 (pipelined), got {self.depth}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"unknown speculative {self.speculative!r}; choose from {SPECULATIVE}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1, got {self.spec_max_batch}")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(f"need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"unknown tp_backend {self.tp_backend!r}; choose from auto, nccl, gloo")
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.tensor_parallel_size > 1 and self.tp_backend == "gloo" and self.device != "cpu" \
                and not self.enforce_eager and _cuda_available():
            raise ValueError("tp_backend='gloo' on CUDA cannot be captured in CUDA graphs: set enforce_eager=True")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")

    @property
    def spec_k(self) -> int:
        """Draft slots per speculating row (0: speculation off)."""
        return 0 if self.speculative == "none" else self.num_speculative_tokens

    def torch_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def use_spec_kernels(self) -> bool:
        """spec_kernels where they can run: Triton kernels, so on the Triton backend only."""
        return self.spec_kernels and self.backend_name() == "triton"

    def backend_name(self) -> str:
        if self.attention_backend == "auto":
            return "triton" if self.torch_device().type == "cuda" else "torch"
        return self.attention_backend

    def backend_switches(self) -> dict:
        """The Triton backend's keywords (engine/attention.py TritonAttention, but its device): the GEMV's paths
        only where decode_gemv is on."""
        gemv = self.decode_gemv
        return dict(decode_gemv=gemv, draft_gemv=self.draft_gemv and gemv,
                    decode_gemm_rows=self.decode_gemm_rows if gemv else 0, decode_gemv_rows=self.decode_gemv_rows,
                    decode_gemm_split=self.decode_gemm_split and gemv, rope_attention=self.rope_attention,
                    split_merge=self.split_merge, silu_epilogue=self.silu_epilogue,
                    gemm_silu_epilogue=self.gemm_silu_epilogue, decode_attention=self.decode_attention,
                    decode_attention_splits=self.decode_attention_splits,
                    decode_attention_prefetch=self.decode_attention_prefetch,
                    long_row_gemv=self.long_row_gemv and gemv, long_k_gemv_rows=self.long_k_gemv_rows,
                    head_mma=self.head_mma, head_mma_from=self.head_mma_from, head_mma_to=self.head_mma_to)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
