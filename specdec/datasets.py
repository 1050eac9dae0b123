"""Prompt sets shared by the studies (specdec.acceptance) and the benchmarks (bench/ imports them from here).

Chat: QUESTIONS cycled, each with an index suffix, through the model's chat template. Schemas: a directory or a
glob of .json files, each either MaskBench's `{description, meta, schema, tests}` or a bare JSON schema, in
natural order (JME_2 before JME_10), prompted with PROMPT through the chat template. JSONL: one
{"prompt": ...} or {"messages": [...]} per line. Standard library only: the benchmarks' client sides import it.
"""
from __future__ import annotations

import glob
import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO / "tests" / "data"           # holds maskbench/: a few JME and BFCL schemas
PROMPT = "Produce a JSON object that matches this schema: {}"
DATASETS = {"JME": "maskbench/JME_*.json", "BFCL": "maskbench/BFCL_*.json", "Glaive": "raw/Glaiveai2K",
            "Github_easy": "raw/Github_easy"}
CHAT = "chat"

QUESTIONS = (
    "What is the capital of France, and why did it become the capital?",
    "Explain how a hash map works to a new programmer.",
    "Write a short poem about autumn leaves.",
    "What are the main differences between TCP and UDP?",
    "Give me three tips for improving my sleep.",
    "How does photosynthesis turn light into chemical energy?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Plan a one-day sightseeing trip in Rome.",
    "Why is the sky blue?",
    "Describe how to make a simple tomato pasta sauce.",
    "What causes inflation, and how do central banks respond to it?",
    "Explain recursion with a small example.",
    "What should I pack for a week-long hiking trip?",
    "How do vaccines train the immune system?",
    "Compare electric cars and petrol cars for a daily commute.",
)


# ---- chat ------------------------------------------------------------------------------------------------
def _chat_ids(obj, messages) -> list[int]:
    if hasattr(obj, "runner"):                          # an LLMEngine: its own template wrapper
        return obj.apply_chat_template(messages)
    out = obj.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _has_template(obj) -> bool:
    tok = getattr(obj, "tokenizer", obj) if hasattr(obj, "runner") else obj
    return tok is not None and bool(getattr(tok, "chat_template", None))


def random_prompts(vocab: int, n: int, length: int = 32, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def chat_prompts(tokenizer_or_engine, n: int) -> list[list[int]]:
    """n distinct chat prompts (token ids): the questions cycled, each with an index suffix.

    Takes an LLMEngine or a tokenizer with a chat template. Without one (dummy models) it returns
    random token ids of about a chat prompt's length (seeded: the same every run)."""
    if not _has_template(tokenizer_or_engine):
        vocab = 49152
        if hasattr(tokenizer_or_engine, "runner"):
            vocab = int(tokenizer_or_engine.runner.vocab)
        return random_prompts(vocab, n)
    return [_chat_ids(tokenizer_or_engine, [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}])
            for i in range(n)]


# ---- schemas ---------------------------------------------------------------------------------------------
def resolve(spec: str, root: str | None = None) -> str:
    """A path or glob, tried under `root` (itself resolved), as given, and relative to the repository."""
    for base in ([resolve(root)] if root else []) + [os.getcwd(), str(REPO)]:
        cand = os.path.join(base, spec)
        if os.path.exists(cand) or glob.glob(cand):
            return cand
    return spec


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def load_schemas(spec: str, limit: int | None = None, largest: float | None = None) -> list[tuple[str, object]]:
    """(stem, schema) in natural order; `largest`: only that share of the files, the biggest in bytes."""
    files = glob.glob(os.path.join(spec, "*.json")) if os.path.isdir(spec) else glob.glob(spec)
    if not files:
        raise FileNotFoundError(f"no schema files at {spec}")
    if largest is not None:
        if not 0 < largest <= 1:
            raise ValueError(f"largest must be in (0, 1], got {largest}")
        files = sorted(files, key=os.path.getsize, reverse=True)[:max(1, math.ceil(largest * len(files)))]
    files.sort(key=lambda f: _natural(os.path.basename(f)))
    out = []
    for f in files[:limit]:
        try:
            d = json.loads(Path(f).read_text())
        except ValueError:
            d = None                      # unreadable: SamplingParams refuses it (counted as rejected)
        if isinstance(d, dict) and "schema" in d and ("tests" in d or "meta" in d):
            d = d["schema"]               # MaskBench wrapper
        out.append((Path(f).stem, d))
    return out


def schema_prompt(eng, schema) -> list[int]:
    return eng.apply_chat_template([{"role": "user", "content": PROMPT.format(json.dumps(schema))}])


# ---- a study's dataset: NAME, chat or NAME=PATH ------------------------------------------------------------
@dataclass
class Dataset:
    name: str
    prompts: list[list[int]]
    schemas: list | None              # one per prompt for schema sets (they may be decoded under it); None: free text


def parse_dataset(item: str, root: str | None = None) -> tuple[str, str | None]:
    """'chat', a built-in name or 'NAME=PATH' -> (name, path or glob; None for chat). Raises ValueError naming
    the valid choices, or the path that holds nothing."""
    name, eq, path = item.partition("=")
    if eq:
        if not name or not path:
            raise ValueError(f"dataset {item!r}: give NAME=PATH")
        if not (os.path.exists(path) or glob.glob(path)):
            raise ValueError(f"dataset {name}: no file or directory at {path}")
        return name, path
    if name == CHAT:
        return name, None
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join([*DATASETS, CHAT])} or NAME=PATH")
    root = str(root or DEFAULT_ROOT)
    path = resolve(DATASETS[name], root)
    if not glob.glob(path):
        raise ValueError(f"dataset {name}: no schema files at {os.path.join(root, DATASETS[name])}")
    return name, path


def is_schema_set(path: str | None) -> bool:
    return path is not None and not path.endswith(".jsonl")


def load_dataset(eng, item: str, root: str | None, limit: int) -> Dataset:
    """Up to `limit` prompts of one dataset, as token ids through the engine's chat template."""
    name, path = parse_dataset(item, root)
    if path is None:
        return Dataset(name, chat_prompts(eng, limit), None)
    if not is_schema_set(path):
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:limit]
        msgs = [d.get("messages") or [{"role": "user", "content": d["prompt"]}] for d in lines]
        return Dataset(name, [eng.apply_chat_template(m) for m in msgs], None)
    schemas = [schema for _, schema in load_schemas(path, limit) if schema is not None]
    return Dataset(name, [schema_prompt(eng, s) for s in schemas], schemas)
