"""The engine's command-line options, made from EngineConfig's fields, and the EngineConfig they make.

`specdec generate`, `chat` and `serve` all take them from `engine_options`, so a new EngineConfig field is a flag
of every subcommand without an edit here: field `foo_bar` is `--foo-bar`, with the field's type and default, and
the comment beside the field as its help. The tables below only add what a field cannot say: names kept from
before (older scripts pass them), choices, and help for the fields that carry no comment."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from functools import cache

from engine.config import DTYPES, SPECULATIVE, EngineConfig

ALIASES = {                     # field -> more flags that set it
    "num_speculative_tokens": ("--num-draft-tokens",),
    "tensor_parallel_size": ("-tp",),
    "tp_timeout_s": ("--tp-timeout",),
    "grammar_compile_timeout_s": ("--grammar-compile-timeout",),
    "guided_draft_masks": ("--draft-masks",),
    "guided_forced_drafts": ("--forced-drafts",),
}
RENAMED = {"seed": "--engine-seed"}     # --seed is a request's seed in generate and chat
CHOICES = {
    "attention_backend": ("auto", "torch", "triton"),
    "depth": (1, 2),
    "dtype": ("auto", *DTYPES),
    "grammar_node": ("native", "python"),
    "kernels": ("auto", "reference"),
    "speculative": SPECULATIVE,
    "tp_backend": ("auto", "nccl", "gloo"),
}
HELP = {                        # fields without a comment in engine/config.py
    "model": "'default' (the bundled SmolLM2-135M), 'dummy:<shape>', a .gguf file or an HF directory; "
             "$SPECDEC_MODEL sets the default",
    "kv_cache_memory_fraction": "share of free device memory the KV cache takes when num_kv_blocks is 0",
    "guide_max_enum": "values of one enum, or choices",
    "guide_max_depth": "nesting of a JSON schema",
    "guide_max_repeat": "the count in a {n,m} repetition of a regex, pattern or grammar",
    "ngram_min_n": "ngram drafter: shortest suffix looked up in the prompt and output",
    "ngram_max_n": "ngram drafter: longest suffix looked up",
    "seed": "draws the sampling seed of each request that sends none",
}
GROUPS = (                      # (field name prefixes, argument group); the rest are "engine"
    (("kernels", "kernel_routes"), "kernels (docs/decode_step.md)"),
    (("grammar_compile_", "grammar_cache_", "guide_max_"), "grammar compilation (bounds on one guide: docs/server.md)"),
    (("speculative", "num_speculative", "spec_", "ngram_", "guided_draft", "guided_forced"),
     "speculative decoding (docs/speculative.md)"),
    (("tensor_parallel", "tp_"), "tensor parallelism (docs/tensor_parallel.md)"),
)


@cache
def field_comments(cls=EngineConfig) -> dict[str, str]:
    """The comment beside each field of a dataclass, its continuation lines joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    starts = sorted((node.lineno, node.target.id if isinstance(node, ast.AnnAssign) else None) for node in body)
    found: dict[str, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        owner = [name for line, name in starts if line <= tok.start[0]]
        if owner and owner[-1]:
            found.setdefault(owner[-1], []).append(tok.string.lstrip("#").strip())
    return {name: " ".join(parts) for name, parts in found.items()}


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def flags(name: str) -> tuple[str, ...]:
    return (RENAMED.get(name, "--" + name.replace("_", "-")), *ALIASES.get(name, ()))


def dest(name: str) -> str:
    """Where a field's value lands in the parsed options: a renamed field's flag names it."""
    return RENAMED[name].lstrip("-").replace("-", "_") if name in RENAMED else name


def _group(groups: dict, name: str):
    title = next((title for prefixes, title in GROUPS if name.startswith(prefixes)), "engine (EngineConfig)")
    return groups[title]


def _add(group, f: dataclasses.Field, kind: type, default, why: str) -> None:
    text = (HELP.get(f.name) or field_comments().get(f.name, "")).replace("%", "%%")
    text = (f"{text}; here {why}" if why else text) + " (default: %(default)s)"
    if kind is bool:
        group.add_argument(*flags(f.name), dest=dest(f.name), action=argparse.BooleanOptionalAction, default=default,
                           help=text)
        return
    metavar = {int: "N", float: "S" if f.name.endswith(("_s", "interval")) else "X"}.get(kind)
    group.add_argument(*flags(f.name), dest=dest(f.name), type=kind, default=default, choices=CHOICES.get(f.name),
                       metavar=metavar if f.name not in CHOICES else None, help=text)


def engine_options(p: argparse.ArgumentParser, defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """One flag per EngineConfig field. `defaults` maps a field to (this command's default, why), shown in help."""
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"not EngineConfig fields: {sorted(unknown)}")
    hints = typing.get_type_hints(EngineConfig)
    groups = {title: p.add_argument_group(title) for title in ["engine (EngineConfig)", *(t for _, t in GROUPS)]}
    for f in dataclasses.fields(EngineConfig):
        default, why = defaults.get(f.name, (field_default(f), ""))
        _add(_group(groups, f.name), f, hints[f.name], default, why)


def engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    """The EngineConfig of parsed options (`extra` wins over them)."""
    fields = dataclasses.fields(EngineConfig)
    given = {f.name: getattr(args, dest(f.name)) for f in fields if hasattr(args, dest(f.name))}
    return EngineConfig(**(given | extra))
