"""The frames between API processes and the engine process: msgspec structs, msgpack-encoded, over ZeroMQ IPC
sockets (engine/server/processes/engine_process.py, engine/server/processes/engine_client.py).

Sockets: every API process PUSHes to each engine process's PULL socket (`inbox`, one an engine); each engine PUSHes
to each API process's own PULL socket (`outbox_<client>`), which all engines share: a frame names its submission
or token, and those are the API process's own. One frame per message; a step's outputs for one API process
travel as one `Outputs` frame, most rows as columns of ids (the engine's loop pays for a struct a row). Requests
go in as token ids; text comes back only for the choices that have stop strings (the engine must read text to stop
on it), every other choice is detokenized by its API process.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import msgspec

from engine.guided.guide import Guide
from engine.requests.sequence import SamplingParams


# ---- API process -> engine -----------------------------------------------------------------------------------
class Add(msgspec.Struct, tag=True, array_like=True):
    client: int
    sub: int                    # the API process's id for this submission (its choices share it)
    prompt: list[int]
    params: list[dict]          # one SamplingParams' fields per choice


class Abort(msgspec.Struct, tag=True, array_like=True):
    client: int
    sub: int


class Compile(msgspec.Struct, tag=True, array_like=True):
    client: int
    token: int
    guide: tuple[str, str, bool, str]   # Guide(kind, source, any_whitespace, backend)
    owner: str | None                   # the client whose share of the compile pool it takes


class CancelCompile(msgspec.Struct, tag=True, array_like=True):
    client: int
    token: int


class Stats(msgspec.Struct, tag=True, array_like=True):
    client: int
    token: int


class ResetCache(msgspec.Struct, tag=True, array_like=True):
    """Forget the prefix cache's unheld pages; answered by a StatsReply {"reset_pages": n}."""
    client: int
    token: int


# ---- engine -> API process -----------------------------------------------------------------------------------
class Added(msgspec.Struct, tag=True, array_like=True):
    sub: int
    code: str = ""              # "" (added), "invalid" (400), "overloaded" (429), "dead" (503)
    message: str = ""


class Out(msgspec.Struct, array_like=True):
    sub: int
    choice: int
    new_ids: list[int]
    text: str | None            # set only for choices the engine detokenizes (stop strings)
    finished: bool = False
    reason: str | None = None
    error: str | None = None
    spec: dict | None = None
    logprobs: list | None = None    # an entry per new id (engine/sampling/logprobs.py), for choices that asked
    cached: int = 0                 # prompt tokens found in the prefix cache (final output)
    prompt_lp: list | None = None   # prompt_logprobs entries (final output of a choice that asked)
    closed_by: str | None = None    # a guided output the engine closed (final output)


class Outputs(msgspec.Struct, tag=True, array_like=True):
    """A step's outputs for one API process. A row that brings only new token ids travels in the columns (a
    choice's every output but its last, unless it reads text or logprobs), the others as `Out`s. The client
    applies the columns first: a choice's outputs within one frame never go both ways but for its final one."""
    items: list[Out]
    subs: list[int] = msgspec.field(default_factory=list)
    choices: list[int] = msgspec.field(default_factory=list)
    counts: list[int] = msgspec.field(default_factory=list)     # each row's new ids
    ids: list[int] = msgspec.field(default_factory=list)        # the rows' new ids, one after another


class Compiled(msgspec.Struct, tag=True, array_like=True):
    token: int
    code: str                   # "ok", "invalid" (400) or "busy" (429)
    message: str = ""
    minimum: int = 0            # "ok": the guide's shortest whole output in tokens (0: not known)


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    token: int
    stats: dict


class Fatal(msgspec.Struct, tag=True, array_like=True):
    message: str                # the engine stopped: why
    engine: int = 0             # which of the server's engine processes


ToEngine = Add | Abort | Compile | CancelCompile | Stats | ResetCache
ToClient = Added | Outputs | Compiled | StatsReply | Fatal

encode = msgspec.msgpack.Encoder().encode


def engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToEngine)


def client_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToClient)


# ---- values --------------------------------------------------------------------------------------------------
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def params_to_wire(params: SamplingParams) -> dict:
    """The constructor's fields (SamplingParams validates them again in the engine process)."""
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


def params_from_wire(fields: dict) -> SamplingParams:
    unknown = set(fields) - set(_PARAM_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
    return SamplingParams(**fields)


def guide_to_wire(guide: Guide) -> tuple[str, str, bool, str]:
    return (guide.kind, guide.source, guide.any_whitespace, guide.backend)


def guide_from_wire(wire) -> Guide:
    return Guide(*wire)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side needs to know of the engine (sent once, when the engine process is ready)."""
    name: str
    max_model_len: int
    vocab: int
    eos_ids: tuple[int, ...]
    tokenizer_path: str | None          # the engine's tokenizer directory (None: the model has none)
    compile_timeout_s: float
    started: float                      # time.time() when the engine came up
    block_size: int = 16                # tokens a KV page
    prefix_caching: bool = False


def model_info(engine) -> ModelInfo:
    path = engine.tokenizer_source.path if engine.tokenizer is not None else None
    return ModelInfo(engine.source.name, engine.max_model_len, engine.runner.vocab, tuple(sorted(engine.eos_ids)),
                     str(path) if path is not None else None, engine.config.grammar_compile_timeout_s, time.time(),
                     engine.config.block_size, engine.config.prefix_caching)


@dataclasses.dataclass(frozen=True)
class Addresses:
    """IPC endpoints of one server, in a private temporary directory."""
    folder: str

    @classmethod
    def create(cls) -> "Addresses":
        return cls(tempfile.mkdtemp(prefix="specdec-ipc-"))

    def inbox(self, engine: int = 0) -> str:
        return f"ipc://{self.folder}/engine-{engine}"

    def kv_events(self, engine: int) -> str:
        """Where engine `engine` publishes its cached pages, for the API processes' placement (several engines)."""
        return f"ipc://{self.folder}/kv-{engine}"

    def outbox(self, client: int) -> str:
        return f"ipc://{self.folder}/api-{client}"

    def remove(self) -> None:
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)
