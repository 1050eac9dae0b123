"""The OpenAI request bodies the server accepts, and its error type.

Every field the OpenAI or vLLM protocol defines is honoured or refused: the fields the engine honours are declared
below; those it cannot honour (`NOT_HONOURED`: beam search, custom logits processors, audio, ...) get a 400 naming
the field when set to anything but the value that asks for nothing. A field neither protocol defines is ignored, as
vLLM does (clients send new OpenAI fields over time), and the response says so in its `specdec-warning` header. An
explicit `null` is the field's default, as in the OpenAI API, and a float field must be finite. vLLM's extensions
that the engine honours: `ignore_eos`, `top_k` (-1 or 0: off), `repetition_penalty`, `min_p`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `bad_words`, `truncate_prompt_tokens`, `prompt_logprobs`,
`request_id`, the guides (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structural_tag`,
`structured_outputs`), the guide's backend (`guided_backend` or `guided_decoding_backend`) and the chat template's
options (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `add_special_tokens`).
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


# field: (the values that ask for nothing, why anything else cannot be honoured)
NOT_HONOURED = {
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1,), "it weighs beams, and beam search is not implemented"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always left out of the text"),
    "allowed_token_ids": ((), "use a guide (guided_choice, guided_regex) to restrict the output"),
    "logits_processors": ((), "the server runs no custom logits processors"),
    "guided_whitespace_pattern": ((), "JSON guides take compact or free whitespace only"),
    "priority": ((0,), "requests are served in arrival order"),
    "cache_salt": ((), "the prefix cache is not salted per request"),
    "kv_transfer_params": ((), "there is no disaggregated serving"),
    "vllm_xargs": ((), "the server has no extensions that read it"),
    "mm_processor_kwargs": (({},), "the models served take text only"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "chat_template": ((), "the model's own chat template is used (its variables: chat_template_kwargs)"),
    "echo": ((False,), "a chat response holds the new message alone"),
    "documents": ((), "pass them to the chat template through chat_template_kwargs"),
    "return_tokens_as_token_ids": ((False,), "logprob tokens are given as text and bytes"),
    "return_token_ids": ((False,), "responses carry text"),
    "audio": ((), "the models served output text only"),
    "modalities": ((["text"],), "the models served output text only"),
    "prediction": ((), "predicted outputs are not implemented"),
    "web_search_options": ((), "the server has no web search"),
    "functions": ((), "use tools"),
    "function_call": ((), "use tool_choice"),
    "store": ((False,), "chat completions are not stored"),
    "service_tier": (("auto", "default"), "the server has one service tier"),
    "reasoning_effort": (("none",), "the server runs no reasoning"),
    "verbosity": (("medium",), "the output length is set by max_tokens and the prompt alone"),
}
NO_OPS = ("user", "metadata", "prompt_cache_key", "safety_identifier", "include_reasoning")    # change no output


class RequestBody(BaseModel):
    """A request body: fields outside the protocols kept aside (`ignored()`), an explicit null taken as the
    field's default, floats finite."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def ignored(self) -> list[str]:
        """The fields neither OpenAI's nor vLLM's protocol defines (after refusing those it cannot honour)."""
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in NOT_HONOURED and value not in NOT_HONOURED[name][0]:
                raise APIError(f"{name} is not supported by this server: {NOT_HONOURED[name][1]}", param=name)
        return sorted(k for k in extra if k not in NOT_HONOURED and k not in NO_OPS)


class _Common(RequestBody):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)             # vLLM's -1 and 0: off
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
    best_of: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)   # keep the prompt's last N tokens
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    request_id: str | None = Field(None, max_length=128)     # the response's id is the prefix and this
    add_special_tokens: bool | None = None                   # the tokenizer's BOS / EOS around the prompt text
    # a guided output ends valid before max_tokens; a JSON value repeating itself is closed (docs/guided.md)
    close_at_budget: bool = True
    repetition_guard: bool = True
    # vLLM's guides (at most one, and not beside response_format or tools)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict | str | None = None
    structured_outputs: dict | None = None
    guided_backend: str | None = None   # "auto" (default), "xgrammar" or "llguidance": which backend runs the guide
    guided_decoding_backend: str | None = None      # vLLM's name of guided_backend ("guidance": llguidance)

    def unsupported(self) -> list[str]:
        return ["best_of"] if self.best_of not in (None, self.n) else []

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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[str]:
        return super().unsupported() + [k for k in ("echo", "suffix") if getattr(self, k)]


Role = Literal["system", "developer", "user", "assistant", "tool"]
