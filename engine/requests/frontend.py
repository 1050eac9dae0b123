"""The request-level API on top of the loop (mixed into LLMEngine): prompts as text or chat messages, handles
and streams that see only their own outputs, and `generate` for whole batches."""
from __future__ import annotations

from collections import deque

from engine.requests.request_handle import RequestHandle
from engine.requests.sequence import SamplingParams


class EngineFrontend:
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.source.name} has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.source.name} has no chat template")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def open(self, prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Add a request and return a handle that receives its outputs, and only its outputs."""
        request_id = self.add_request(prompt, params, stream=True)
        queue = self._listeners[request_id] = deque()
        return RequestHandle(self, request_id, queue)

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield the request's RequestOutputs as they come (driving the loop); closing the generator early
        aborts the request. Other requests' outputs are not lost: they go to their own handles."""
        handle = self.open(prompt, params)
        try:
            yield from handle
        finally:
            handle.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Run prompts (strings or token id lists) to completion; returns the finished Sequences in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = []
        try:
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.add_request(prompt, sp, retain=True))
        except ValueError:
            for i in ids:                         # all or nothing: the ones already added go again
                self.abort(i)
                self.take(i)
            raise
        while self.has_unfinished():
            self.step()
        return [self.take(i) for i in ids]
