"""The OpenAI request bodies the server accepts, and its error type.

Fields the engine cannot honour (echo, suffix, best_of) are declared so that setting them gets a
400 naming the field instead of being silently ignored; unknown fields are ignored, as OpenAI clients send new
ones over time. An explicit `null` is
the field's default, as in the OpenAI API. vLLM's extensions that the engine honours: `ignore_eos`, `top_k`,
`repetition_penalty`, `min_p`, `min_tokens`,
the guides (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`), the guide's
backend (`guided_backend`: auto, xgrammar or llguidance) and the chat
template's options (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.sampling.limits import MAX_LOGPROBS


class APIError(Exception):
    """An OpenAI-style error: HTTP `status` and {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return APIError(f"{param}: {first['msg']}{more}" if param else first["msg"] + more, param=param)


def validated(model, body: dict):
    """`body` as the request model, or a 400 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM's extension: usage so far on every chunk


class RequestBody(BaseModel):
    """A request body: unknown fields ignored, an explicit null taken as the field's default."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Common(RequestBody):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None          # token id (a string, as JSON keys are) -> [-100, 100]
    user: str | None = None
    # vLLM's guides (at most one, and not beside response_format or tools)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    guided_backend: str | None = None   # "auto" (default), "xgrammar" or "llguidance": which backend runs the guide

    def unsupported(self) -> list[str]:
        return []

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with integer token ids; a key that is not one is a 400 naming it."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().isdigit():
                raise APIError(f"logit_bias keys must be token ids, got {key!r}"[:200], param="logit_bias")
            out[int(key)] = bias
        return out

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off), or how many top tokens each token's entry lists."""
        return None


class ChatCompletionRequest(_Common):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        return bad + [k for k in ("echo", "suffix") if getattr(self, k)] + \
            (["best_of"] if self.best_of not in (None, self.n) else [])


Role = Literal["system", "developer", "user", "assistant", "tool"]
