"""The engine's command-line options (`specdec generate`, `chat` and `serve` share them) and the EngineConfig
they make."""
from __future__ import annotations

import argparse

from engine.config import EngineConfig


def engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="'default', 'dummy:<shape>', a .gguf file or an HF directory "
                                                 "(default: $SPECDEC_MODEL or the bundled SmolLM2-135M)")
    p.add_argument("--tokenizer", default="", help="take the tokenizer from this model spec instead (e.g. "
                                                   "'default' for dummy weights of SmolLM2's shape)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--depth", type=int, default=2, choices=[1, 2],
                   help="1: blocking loop; 2: pipelined (the next step launches before this one commits)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--switch-interval", type=float, default=2e-4, metavar="S",
                   help="Python's GIL switch interval set on CUDA with guided decoding (0: leave it)")
    p.add_argument("--speculative", default="none", choices=["none", "ngram", "eagle", "draft_model"],
                   help="draft tokens and verify them in the step (ngram: prompt lookup; eagle: the trained head)")
    p.add_argument("--num-speculative-tokens", "--num-draft-tokens", type=int, default=3, metavar="K",
                   help="drafts per step")
    p.add_argument("--spec-head", default="", metavar="DIR",
                   help="eagle: draft head directory (default: the head shipped for the model; 'random')")
    p.add_argument("--spec-draft-model", default="", metavar="MODEL",
                   help="draft_model: a smaller model sharing the tokenizer (path, 'default', 'dummy:NAME')")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N GPUs (one process each; NCCL), or N processes on the CPU (gloo)")
    p.add_argument("--tp-timeout", type=float, default=120.0, metavar="S",
                   help="a tensor-parallel step taking longer than this ends the engine (a worker hung)")
    p.add_argument("--draft-masks", action="store_true",
                   help="guided + --speculative eagle|draft_model: each draft step picks under the grammar's mask")
    p.add_argument("--forced-drafts", action="store_true",
                   help="guided + --speculative: draft the text the grammar forces in place of the drafter's tokens")
    g = p.add_argument_group("grammar compilation (bounds on one guide: docs/server.md)")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="S",
                   help="a request whose grammar takes longer to compile fails with 400")
    g.add_argument("--grammar-compile-queue", type=int, default=64, metavar="N",
                   help="unfinished compiles before the server answers 429 (a client may have a quarter)")
    g.add_argument("--guide-max-bytes", type=int, default=256 << 10, metavar="N")
    g.add_argument("--guide-max-enum", type=int, default=4096, metavar="N", help="values of one enum, or choices")
    g.add_argument("--guide-max-depth", type=int, default=64, metavar="N", help="nesting of a JSON schema")
    g.add_argument("--guide-max-repeat", type=int, default=1000, metavar="N",
                   help="the count in a {n,m} repetition of a regex, pattern or grammar")


def engine_config(args, **extra) -> EngineConfig:
    return EngineConfig(**({"model": args.model} if args.model else {}), tokenizer=args.tokenizer,
                        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend, depth=args.depth,
                        enforce_eager=args.enforce_eager, speculative=args.speculative,
                        num_speculative_tokens=args.num_speculative_tokens, spec_head=args.spec_head,
                        spec_draft_model=args.spec_draft_model, guided_draft_masks=args.draft_masks,
                        guided_forced_drafts=args.forced_drafts, switch_interval=args.switch_interval,
                        tensor_parallel_size=args.tensor_parallel_size, tp_timeout_s=args.tp_timeout,
                        grammar_compile_timeout_s=args.grammar_compile_timeout,
                        grammar_compile_queue=args.grammar_compile_queue, guide_max_bytes=args.guide_max_bytes,
                        guide_max_enum=args.guide_max_enum, guide_max_depth=args.guide_max_depth,
                        guide_max_repeat=args.guide_max_repeat, **extra)
