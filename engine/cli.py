"""`specdec generate` and `specdec chat`: stream tokens as they come, report tokens/s at the end."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.sequence import SamplingParams


def _engine_options(p: argparse.ArgumentParser) -> None:
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


def _request_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    g = p.add_argument_group("guided decoding (at most one guide)")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON", help="output matches this JSON schema")
    g.add_argument("--json", action="store_true", help="output is a JSON object")
    g.add_argument("--regex", default=None, help="output matches this regular expression")
    g.add_argument("--grammar", default=None, metavar="FILE", help="output matches this xgrammar EBNF grammar")
    g.add_argument("--choice", nargs="+", default=None, help="output is exactly one of these strings")
    g.add_argument("--any-whitespace", action="store_true", help="JSON guides: allow free whitespace")


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


def _engine(args):
    from engine.llm_engine import LLMEngine
    return LLMEngine(engine_config(args, max_num_seqs=8))


def _read(value: str | None, what: str) -> str | None:
    """A file's text if `value` names a file, else `value` itself (inline JSON)."""
    if value is None or value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {value!r}: {exc.strerror}") from exc


def _params(args) -> SamplingParams:
    grammar = _read(args.grammar, "grammar") if args.grammar else None
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, json_schema=_read(args.json_schema, "JSON schema"),
                          json_object=args.json, regex=args.regex, ebnf=grammar, choice=args.choice,
                          any_whitespace=args.any_whitespace)


def _stream(engine, prompt_ids, params, out=sys.stdout) -> str:
    start, n, text = time.perf_counter(), 0, ""
    for output in engine.stream(prompt_ids, params):
        n += len(output.new_token_ids)
        text += output.new_text
        out.write(output.new_text)
        out.flush()
        if output.finish_reason == "error":
            print(f"\n[error: {output.error}]", file=sys.stderr)
    secs = time.perf_counter() - start
    print(f"\n[{n} tokens in {secs:.2f} s, {n / max(secs, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return text


def cmd_generate(args) -> int:
    engine = _engine(args)
    ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat_template \
        else engine.encode(args.prompt)
    params = _params(args)
    _stream(engine, ids, params)
    return 0


def cmd_chat(args) -> int:
    engine = _engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("specdec chat: type a message, /exit or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        reply = _stream(engine, engine.apply_chat_template(messages), _params(args))
        messages.append({"role": "assistant", "content": reply})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", dest="chat_template", action="store_false",
                     help="feed the prompt as plain text instead of through the chat template")
    _engine_options(gen)
    _request_options(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None)
    _engine_options(chat)
    _request_options(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    from engine.server.serve import add_server_options, cmd_serve
    _engine_options(serve)
    add_server_options(serve)
    serve.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
