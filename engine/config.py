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
    spec_finish_kernel: bool = True    # with spec_kernels, a greedy unguided spec step's acceptance, finish and the
                                       # head's next ids in one kernel (engine/kernels/speculative/spec_finish.py)
    kernels: str = "auto"              # "auto": each matmul and LM head on the kernel measured fastest for its
                                       # shape and rows on this GPU (engine/kernels/routes.py, cached on disk);
                                       # "reference": cuBLAS for all of them, the baseline for equality and speed
    kernel_routes: str = ""            # a route file pinning kernels over the measured ones (experiments)
    rope_attention: bool = True        # decode and verification steps: RoPE and the KV store inside the attention
                                       # kernel, not a kernel of their own (Triton backend)
    split_merge: bool = True           # attention split over the KV merges its splits in the attention kernel, not in
                                       # a combine kernel (Triton backend, where the launch's programs fit one an SM)
    step_io_kernels: bool = True       # plain and guided steps: input ids + embedding rows in one kernel, and the
                                       # tokens' copy to the slot and the pool in one (Triton backend, one rank)
    decode_attention: bool = True      # steps of one new token a sequence: attention that loads its metadata, RoPE
                                       # rows and first KV tile before the dependent-launch wait (Triton backend)
    decode_attention_splits: int = 0   # decode_attention's KV splits: 0 by paged_attention's rule, else a power of
                                       # two up to 32 for every such step
    decode_attention_prefetch: int = 0  # KV tiles each decode_attention split reads before the wait: 1 or 2; 0 by
                                        # rule (decode_attention.prefetch_rule)
    native_launch: bool = True         # graph steps enqueue upload, events, replay and download in one native call
                                       # (engine/runner/native_launch.py); warns and keeps the Python launch where
                                       # it cannot run
    spec_kernels: bool = True          # the speculative step's correction and draft layout in one Triton kernel each
    spec_finish_kernel: bool = True    # with spec_kernels, a greedy unguided spec step's acceptance, finish and the
                                       # head's next ids in one kernel
    draft_gather: bool = True          # with spec_kernels, the draft layout kernel also gathers the EAGLE head's
                                       # step-0 query and feature of each row
    guided: bool = True                # guided decoding: grammar masks, and graph variants holding their branch
    grammar_node: str = "native"       # who fills the masks: "native" (the grammar node: C++ through tvm-ffi,
                                       # no GIL) or "python" (xgrammar's Python API; the reference path)
    grammar_threads: int = 4           # threads the grammar node fills a step's rows on (from 8 rows)
    switch_interval: float = 2e-4      # Python's GIL switch interval set on CUDA (0: leave it): a Python grammar
                                       # callback waits up to this for the GIL (the default 5 ms > a step)
    speculative: str = "none"          # drafter: "none" | "ngram" | "eagle" | "draft_model" (speculative/drafters)
    spec_head: str = ""                # eagle: a head directory ("" = the one shipped for the model, "random")
    spec_draft_vocab: str = ""         # eagle: a JSON list of token ids, most frequent first (specdec.eagle.
                                       # token_ranks); unguided drafts come from its first spec_draft_vocab_size
                                       # only, a smaller LM head. "": the head directory's token_ranks.json where
                                       # it has one; "none": the whole vocabulary
    spec_draft_vocab_size: int = 16384  # eagle: unguided drafts from this many of the ranking's ids (0: all)
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
                                       # token under the row's grammar (one grammar node per draft step; off: the
                                       # draft steps never wait for the grammar stream)
    guided_forced_drafts: bool = False  # guided + speculative: where the grammar allows one continuing text, draft
                                        # its tokens in place of the drafter's (engine/guided/draft_masks.py)
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
        if self.kernels not in ("auto", "reference"):
            raise ValueError(f"unknown kernels {self.kernels!r}; choose from auto, reference")
        if self.kernel_routes and self.kernels != "auto":
            raise ValueError("kernel_routes pins routes of kernels='auto'; 'reference' runs cuBLAS for every matmul")
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

    def backend_options(self) -> dict:
        """The Triton backend's keywords but its routes and device (engine/backend.py RoutedBackend)."""
        return dict(rope_attention=self.rope_attention, split_merge=self.split_merge,
                    decode_attention=self.decode_attention, decode_attention_splits=self.decode_attention_splits,
                    decode_attention_prefetch=self.decode_attention_prefetch)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
