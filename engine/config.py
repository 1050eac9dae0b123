"""The engine's one configuration object: EngineConfig, what a user sets, in groups (model and cache, scheduler,
speculative decoding, guided decoding, kernels), and its Tuning, the switches for experiments and A/B runs."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a method needs it: the server's supervisor and API processes build and check an
# EngineConfig but never load torch (seconds of CPU and hundreds of MB a process)
SPECULATIVE = ("none", "ngram", "eagle", "draft_model")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_NUM_SEQS = 256     # sequences a step holds unless the config says otherwise


@dataclass(frozen=True)
class Tuning:
    """Switches for experiments and A/B runs: each kernel or internal path of the engine turned off, or set by hand.
    The defaults are what the engine is tested and measured with (docs/configuration.md says what each does)."""
    # kernels of the Triton backend (off: the plain path)
    rope_attention: bool = True        # decode and verification: RoPE and the KV store inside the attention kernel
    split_merge: bool = True           # split attention merges its splits in the attention kernel itself
    step_io_kernels: bool = True       # a step's input ids + embedding, and its tokens' copies, one kernel each
    decode_attention: bool = True      # one-token steps: attention with its prologue before the dependent-launch wait
    decode_attention_splits: int = 0   # decode_attention's KV splits: 0 by rule, else a power of two up to 32
    decode_attention_prefetch: int = 0  # KV tiles a decode_attention split reads before the wait: 0 by rule, 1, 2
    verify_attention: bool = True      # steps of 2-32 new tokens for up to 4 sequences: decode_attention's plan
    native_launch: bool = True         # a graph step's upload, events, replay and download in one native call
    spec_kernels: bool = True          # one kernel each: the spec step's correction, draft layout, n-gram search
    spec_finish_kernel: bool = True    # a greedy spec step's acceptance and finish in one kernel
    draft_gather: bool = True          # the draft layout kernel also gathers the EAGLE head's inputs
    spec_budget: bool = True           # each step verifies K, a lower level or none: what its cost makes fastest
    # grammar
    grammar_node: str = "native"       # who fills the masks: "native" (C++, no GIL) or "python" (the reference)
    grammar_threads: int = 4           # threads the grammar node fills a step's rows on (from 8 rows)
    switch_interval: float = 2e-4      # Python's GIL switch interval on CUDA with guided decoding (0: leave it)
    guide_max_bytes: int = 256 << 10   # one guide's size, checked before it compiles (engine/guided/limits.py)
    guide_max_enum: int = 4096         # values of one enum, or choices
    guide_max_depth: int = 64          # nesting of one JSON schema
    guide_max_repeat: int = 1000       # the count of one {n,m} repetition of a regex, pattern or grammar
    # speculation
    spec_tree: int = 0                 # eagle: drafts a row holds as a tree, K of them its chain (0: a chain)
    spec_draft_vocab: str = ""         # eagle: a JSON token ranking drafts come from ("": the head's, "none")
    spec_draft_vocab_size: int = 16384  # eagle: drafts from this many of the ranking's tokens (0: all)
    spec_prompt_vocab: int = 256       # eagle: ... and this many more, lent to recent prompts' tokens it leaves out
    guided_draft_masks: bool = False   # guided + speculative: every draft step picks its token under the grammar
    guided_forced_drafts: bool = False  # guided + speculative: text the grammar forces is drafted as it is
    guided_repeat_limit: int = 48      # a JSON value repeating one n-gram this many tokens is closed (0: never)
    # tensor parallelism and debugging
    tp_backend: str = "auto"           # the collectives: "auto" (NCCL on CUDA, gloo on the CPU), "nccl", "gloo"
    tp_timeout_s: float = 120.0        # a step or worker start taking longer ends the engine (a hung worker)
    debug_sync: bool = False           # raise on any device-to-host sync while a step is enqueued (CUDA)

    def __post_init__(self):
        if self.guided_repeat_limit < 0:
            raise ValueError(f"guided_repeat_limit must be >= 0 (0: no guard), got {self.guided_repeat_limit}")
        if self.grammar_node not in ("native", "python"):
            raise ValueError(f"grammar_node must be 'native' or 'python', got {self.grammar_node!r}")
        for name in ("grammar_threads", "guide_max_bytes", "guide_max_enum", "guide_max_depth", "guide_max_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        splits = self.decode_attention_splits
        if splits and (splits < 1 or splits > 32 or splits & (splits - 1)):
            raise ValueError(f"decode_attention_splits must be 0 (by rule) or a power of two up to 32, got {splits}")
        if self.decode_attention_prefetch not in (0, 1, 2):
            raise ValueError("decode_attention_prefetch must be 0 (by rule), 1 or 2, got "
                             f"{self.decode_attention_prefetch}")
        for name in ("spec_draft_vocab_size", "spec_prompt_vocab"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tp_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"unknown tp_backend {self.tp_backend!r}; choose from auto, nccl, gloo")
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")


TUNING = frozenset(f.name for f in fields(Tuning))


@dataclass(frozen=True)
class EngineConfig:
    # model and cache
    model: str = field(default_factory=lambda: os.environ.get("SPECDEC_MODEL", "default"))
    tokenizer: str = ""                # another model's tokenizer ("": the model's own)
    device: str = "auto"               # "auto": cuda where there is one, else cpu
    dtype: str = "auto"                # "auto": bfloat16 on cuda, float32 on cpu
    max_model_len: int = 0             # the longest sequence (0: the model's context length)
    block_size: int = 16               # tokens per KV page
    num_kv_blocks: int = 0             # KV pages (0: from kv_cache_memory_fraction)
    kv_cache_memory_fraction: float = 0.5  # share of free device memory the KV cache takes
    prefix_caching: bool = True        # prompts with a common prefix share its full KV pages
    kv_events_endpoint: str = ""       # publish cached-page events (vLLM's KVEvents) on this ZMQ address
    # scheduler
    max_num_seqs: int = 0              # sequences in one step (0: 256, or max_num_batched_tokens if fewer)
    max_num_batched_tokens: int = 2048  # tokens in one step (longer prompts are prefilled in chunks)
    depth: int = 2                     # 2: step t+1 is launched before step t commits; 1: one step at a time
    enforce_eager: bool = False        # no CUDA graphs
    seed: int = 0                      # draws the sampling seed of each request that sends none
    # speculative decoding
    speculative: str = "none"          # the drafter: "none", "ngram", "eagle" or "draft_model"
    num_speculative_tokens: int = 6    # K: drafts a speculating sequence holds, the most a step verifies
    spec_head: str = ""                # eagle: a head directory ("": the one shipped for the model, "random")
    spec_draft_model: str = ""         # draft_model: a model sharing the tokenizer (a path, "default", "dummy:X")
    spec_max_batch: int = 32           # steps with more sequences do not speculate
    spec_min_acceptance: float = 1.3   # without step costs (eager, spec_budget off): pause below this acceptance
    ngram_min_n: int = 1               # ngram: the shortest suffix looked up in the prompt and output
    ngram_max_n: int = 3               # ngram: the longest
    # guided decoding and sampling
    guided: bool = True                # requests may carry a grammar (JSON schema, regex, choice, EBNF)
    logprobs: bool = True              # requests may ask for logprobs (every step graph is captured twice)
    penalty_rows: int = 64             # requests with penalties, min_p or min_tokens at once (0: refused)
    grammar_compile_threads: int = 4   # grammars compiling at once
    grammar_compile_queue: int = 64    # compiles unfinished at once before the server answers 429
    grammar_compile_timeout_s: float = 10.0  # a request whose grammar compiles longer fails
    grammar_compile_processes: bool = False  # compile in child processes, killed once no request waits
    grammar_cache_mb: int = 512        # compiled grammars kept for reuse, least recently used dropped first
    # kernels and parallelism
    attention_backend: str = "auto"    # "triton", "torch", or "auto" (triton on cuda)
    kernels: str = "auto"              # "auto": each matmul on the kernel measured fastest here; "reference": cuBLAS
    kernel_routes: str = ""            # a route file (or its JSON) pinning kernels over the measured ones
    tensor_parallel_size: int = 1      # GPUs one model is split over
    tuning: Tuning = field(default_factory=Tuning)  # switches for experiments and A/B runs

    @classmethod
    def of(cls, **options) -> "EngineConfig":
        """An EngineConfig from flat options: Tuning's fields may be given beside EngineConfig's."""
        own, tuning = _split(options)
        base = own.pop("tuning", None) or Tuning()
        return cls(**own, tuning=replace(base, **tuning) if tuning else base)

    def with_options(self, **options) -> "EngineConfig":
        """This config with some options changed, Tuning's fields among them."""
        own, tuning = _split(options)
        return replace(self, **own, tuning=replace(self.tuning, **tuning))

    def __post_init__(self):
        if not isinstance(self.tuning, Tuning):
            raise TypeError(f"tuning must be a Tuning, got {type(self.tuning).__name__}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs must be >= 0 (0: the default) and max_num_batched_tokens positive")
        if self.max_num_seqs == 0:
            object.__setattr__(self, "max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens))
        for name in ("grammar_compile_threads", "grammar_compile_queue", "grammar_cache_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.kernels not in ("auto", "reference"):
            raise ValueError(f"unknown kernels {self.kernels!r}; choose from auto, reference")
        if self.kernel_routes and self.kernels != "auto":
            raise ValueError("kernel_routes pins routes of kernels='auto'; 'reference' runs cuBLAS for every matmul")
        if self.depth not in (1, 2):
            raise ValueError(f"depth must be 1 (blocking) or 2 (pipelined), got {self.depth}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"unknown speculative {self.speculative!r}; choose from {SPECULATIVE}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1, got {self.spec_max_batch}")
        tree = self.tuning.spec_tree
        if tree:
            if self.speculative != "eagle":
                raise ValueError(f"spec_tree needs the EAGLE head's ranked drafts (speculative='eagle'), got "
                                 f"speculative={self.speculative!r}")
            if not self.num_speculative_tokens < tree <= 32:
                raise ValueError(f"spec_tree must be more than num_speculative_tokens ({self.num_speculative_tokens}) "
                                 f"and at most 32, got {tree}")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(f"need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.tuning.tp_backend == "gloo" and self.device != "cpu" \
                and not self.enforce_eager and _cuda_available():
            raise ValueError("tp_backend='gloo' on CUDA cannot be captured in CUDA graphs: set enforce_eager=True")
        if self.kv_events_endpoint:
            scheme, sep, rest = self.kv_events_endpoint.partition("://")
            if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
                raise ValueError(f"kv_events_endpoint {self.kv_events_endpoint!r} is not a ZMQ address: give "
                                 "tcp://HOST:PORT (e.g. tcp://*:5557), ipc://PATH or inproc://NAME")
            if not self.prefix_caching:
                raise ValueError("kv_events_endpoint publishes the prefix cache's pages: it needs prefix_caching")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")

    @property
    def spec_k(self) -> int:
        """Draft slots per speculating row (0: speculation off): a tree's nodes, else K."""
        return 0 if self.speculative == "none" else self.tuning.spec_tree or self.num_speculative_tokens

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
        return self.tuning.spec_kernels and self.backend_name() == "triton"

    def backend_name(self) -> str:
        if self.attention_backend == "auto":
            return "triton" if self.torch_device().type == "cuda" else "torch"
        return self.attention_backend

    def backend_options(self) -> dict:
        """The Triton backend's keywords but its routes and device (engine/backend.py RoutedBackend)."""
        t = self.tuning
        return dict(rope_attention=t.rope_attention, split_merge=t.split_merge, decode_attention=t.decode_attention,
                    decode_attention_splits=t.decode_attention_splits,
                    decode_attention_prefetch=t.decode_attention_prefetch, verify_attention=t.verify_attention)

def _split(options: dict) -> tuple[dict, dict]:
    """(EngineConfig's options, Tuning's) of flat options."""
    return ({k: v for k, v in options.items() if k not in TUNING}, {k: v for k, v in options.items() if k in TUNING})


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
