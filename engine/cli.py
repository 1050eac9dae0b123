"""`specdec generate` and `specdec chat`: stream tokens as they come, report tokens/s at the end. `specdec serve`
and `specdec acceptance` hand over to their own modules."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine.options import engine_config, engine_options
from engine.requests.sequence import SamplingParams


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


# generate and chat run one prompt at a time: fewer rows mean fewer decode graphs to capture at start
ONE_PROMPT = {"max_num_seqs": (8, "one prompt at a time, and fewer rows capture fewer graphs")}


def _engine(args):
    from engine.llm_engine import LLMEngine
    return LLMEngine(engine_config(args))


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


def _stream(engine, prompt_ids, params, out=sys.stdout) -> tuple[str, str | None]:
    """Write the output as it comes; returns its text and its error (None: it did not fail)."""
    start, n, text, error = time.perf_counter(), 0, "", None
    for output in engine.stream(prompt_ids, params):
        n += len(output.new_token_ids)
        text += output.new_text
        out.write(output.new_text)
        out.flush()
        if output.finish_reason == "error":
            error = output.error
    if error is not None:
        after_text = "\n" if text else ""
        print(f"{after_text}specdec: error: {error}", file=sys.stderr)
        return text, error
    secs = time.perf_counter() - start
    print(f"\n[{n} tokens in {secs:.2f} s, {n / max(secs, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return text, None


def cmd_generate(args) -> int:
    engine = _engine(args)
    ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat_template \
        else engine.encode(args.prompt)
    _, error = _stream(engine, ids, _params(args))
    return 1 if error is not None else 0


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
        reply, error = _stream(engine, engine.apply_chat_template(messages), _params(args))
        if error is None:
            messages.append({"role": "assistant", "content": reply})
        else:                   # the failed turn leaves the conversation
            messages.pop()


def cmd_acceptance(args) -> int:
    # The study is specdec's (it imports the engine; nothing in engine/ imports specdec at import time): imported
    # here only, when this command runs.
    from specdec.acceptance import main as study_main
    return study_main(args.study_args, prog="specdec acceptance")


def parser() -> argparse.ArgumentParser:
    from engine.server.serve import SERVER_DEFAULTS, add_server_options, cmd_serve
    top = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", dest="chat_template", action="store_false",
                     help="feed the prompt as plain text instead of through the chat template")
    engine_options(gen, ONE_PROMPT)
    _request_options(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None)
    engine_options(chat, ONE_PROMPT)
    _request_options(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    engine_options(serve, SERVER_DEFAULTS)
    add_server_options(serve)
    serve.set_defaults(func=cmd_serve)
    # no option prefix: every argument, --help too, goes to the study's own parser (specdec/acceptance/cli.py)
    study = sub.add_parser("acceptance", help="acceptance-length study of the drafters (docs/acceptance.md)",
                           add_help=False, prefix_chars="\0")
    study.add_argument("study_args", nargs=argparse.REMAINDER)
    study.set_defaults(func=cmd_acceptance)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
