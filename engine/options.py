"""The engine's command-line options, made from EngineConfig's fields, and the EngineConfig they make.

`specdec generate`, `chat` and `serve` all take them from `engine_options`, so a new EngineConfig field is a flag
of every subcommand without an edit here: field `foo_bar` is `--foo-bar`, with the field's type and default, the
comment beside the field as its help and the section comment above it as its group. Tuning's fields are flags too,
listed in one line (experiments and A/B runs). The tables below only add what a field cannot say: names kept from
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

from engine.config import DTYPES, SPECULATIVE, EngineConfig, Tuning

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
}
TUNING_GROUP = "tuning (experiments and A/B runs: docs/configuration.md)"


def option_fields() -> list[dataclasses.Field]:
    """The fields that are flags: EngineConfig's (but its Tuning) and then Tuning's."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "tuning"] + list(dataclasses.fields(Tuning))


@cache
def _comments(cls) -> tuple[dict[str, str], dict[str, str]]:
    """({field: the comment on its line}, {field: the section comment above it})."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    lines = {node.lineno: node.target.id for node in body if isinstance(node, ast.AnnAssign)}
    beside, sections, section = {}, {}, ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if tok.start[0] in lines:
            beside[lines[tok.start[0]]] = text
        elif tok.line[:tok.start[1]].strip() == "":
            section = text
            for line, name in lines.items():
                if line > tok.start[0]:
                    sections[name] = section
    return beside, sections


def field_comments(cls=EngineConfig) -> dict[str, str]:
    """The comment beside each field of a dataclass."""
    return _comments(cls)[0]


def field_sections(cls=EngineConfig) -> dict[str, str]:
    """The section comment above each field of a dataclass ("" for fields before the first)."""
    return _comments(cls)[1]


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def flags(name: str) -> tuple[str, ...]:
    return (RENAMED.get(name, "--" + name.replace("_", "-")), *ALIASES.get(name, ()))


def dest(name: str) -> str:
    """Where a field's value lands in the parsed options: a renamed field's flag names it."""
    return RENAMED[name].lstrip("-").replace("-", "_") if name in RENAMED else name


def _add(group, f: dataclasses.Field, kind: type, default, why: str, listed: bool = True) -> None:
    text = (HELP.get(f.name) or field_comments(EngineConfig).get(f.name, "")).replace("%", "%%")
    text = (f"{text}; here {why}" if why else text) + " (default: %(default)s)"
    text = text if listed else argparse.SUPPRESS
    if kind is bool:
        group.add_argument(*flags(f.name), dest=dest(f.name), action=argparse.BooleanOptionalAction, default=default,
                           help=text)
        return
    metavar = {int: "N", float: "S" if f.name.endswith(("_s", "interval")) else "X"}.get(kind)
    group.add_argument(*flags(f.name), dest=dest(f.name), type=kind, default=default, choices=CHOICES.get(f.name),
                       metavar=metavar if f.name not in CHOICES else None, help=text)


def engine_options(p: argparse.ArgumentParser, defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """One flag per EngineConfig field, grouped by its section, and per Tuning field (listed in one line).
    `defaults` maps a field to (this command's default, why), shown in help."""
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in option_fields()}
    if unknown:
        raise ValueError(f"not EngineConfig or Tuning fields: {sorted(unknown)}")
    hints = typing.get_type_hints(EngineConfig) | typing.get_type_hints(Tuning)
    sections, groups = field_sections(EngineConfig), {}
    tuning_names = {f.name for f in dataclasses.fields(Tuning)}
    tuning_list = "each field a flag, --name-with-dashes (--no-... for a switch): " + \
        ", ".join(f.name for f in dataclasses.fields(Tuning))
    for f in option_fields():
        title = TUNING_GROUP if f.name in tuning_names else sections.get(f.name) or "engine"
        if title not in groups:
            groups[title] = p.add_argument_group(title, tuning_list if title == TUNING_GROUP else None)
        default, why = defaults.get(f.name, (field_default(f), ""))
        _add(groups[title], f, hints[f.name], default, why, listed=f.name not in tuning_names)


def engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    """The EngineConfig of parsed options (`extra` wins over them)."""
    given = {f.name: getattr(args, dest(f.name)) for f in option_fields() if hasattr(args, dest(f.name))}
    return EngineConfig.of(**(given | extra))
