"""Request checks that need the engine (vocabulary, context, KV pool): run by `add_request`, so bad input
raises a ValueError naming the problem there, never later inside a step. `SamplingParams` checks its own
fields (types and ranges that fit the step buffers) when it is built."""
from __future__ import annotations

import numbers

from engine.memory.block_manager import BlockManager
from engine.requests.sequence import SamplingParams
from engine.sampling.limits import MAX_STOPS


def prompt_ids(prompt, encode) -> list[int]:
    """A prompt as token ids: strings go through `encode`, id lists must hold integers."""
    if isinstance(prompt, str):
        return encode(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if set(map(type, prompt)) <= {int}:     # the common case, checked in C (an abc check per id costs ms)
        return list(prompt)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        raise ValueError("prompt token ids must be integers")
    return [int(t) for t in prompt]


def check_request(ids: list[int], params, vocab: int, max_model_len: int, blocks: BlockManager, *,
                  has_tokenizer: bool, spec_k: int = 0, logprobs: bool = True, penalties: bool = True,
                  eos_ids=(), tensor_parallel: bool = False) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the context is {max_model_len} "
                         f"and at least one must be left to generate")
    bad = [t for t in ids if not 0 <= t < vocab] if min(ids) < 0 or max(ids) >= vocab else []
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad[:5]}")
    want = params.num_speculative_tokens
    if want and want > spec_k:
        raise ValueError(f"num_speculative_tokens={want} but this engine drafts at most {spec_k} "
                         f"(EngineConfig speculative / num_speculative_tokens)")
    if params.logprobs is not None and not logprobs:
        raise ValueError("logprobs: this engine computes none (EngineConfig.logprobs is False)")
    if params.prompt_logprobs is not None and tensor_parallel:
        raise ValueError("prompt_logprobs is not supported with tensor parallelism (tensor_parallel_size > 1)")
    if params.penalized and not penalties:
        raise ValueError("penalties, logit_bias, min_p and min_tokens: this engine has none "
                         "(EngineConfig.penalty_rows is 0)")
    if params.logit_bias:
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}")
        if tensor_parallel:
            raise ValueError("logit_bias is not supported with tensor parallelism (tensor_parallel_size > 1)")
    stops = min_tokens_stops(params, eos_ids)
    if params.min_tokens and len(stops) > MAX_STOPS:
        raise ValueError(f"min_tokens masks EOS and the stop token ids: at most {MAX_STOPS} of them, got {len(stops)}")
    if params.stop and not has_tokenizer:
        raise ValueError("this model has no tokenizer: stop strings cannot be matched")
    worst = min(len(ids) + params.max_tokens, max_model_len)
    if blocks.blocks_needed(worst, 0) > blocks.num_blocks:
        raise ValueError(f"request needs up to {worst} tokens of KV, more than the whole cache holds "
                         f"({blocks.num_blocks * blocks.block_size})")


def min_tokens_stops(params, eos_ids) -> tuple[int, ...]:
    """The ids min_tokens masks: EOS (unless ignored) and the stop token ids."""
    eos = () if params.ignore_eos else tuple(sorted(eos_ids))
    return tuple(dict.fromkeys(eos + params.stop_token_ids))
