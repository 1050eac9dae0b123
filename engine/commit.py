"""What a waited step's tokens do to its requests: append them (several with speculation), stop, finish or fail a
request, and make their outputs. One per engine (LLMEngine.commits); it shares the engine's maps of live requests
and of finished ones added with retain=True.

A request that breaks while its tokens are committed fails alone: the others of the step commit as usual.
"""
from __future__ import annotations

import time

from engine.requests import _hostpath
from engine.requests.output import OutputProcessor, RequestOutput
from engine.requests.sequence import Sequence
from engine.sampling.logprobs import HostLogprobs
from engine.sampling.sampler import NO_TOKEN
from engine.scheduler import Scheduler
from engine.speculative.plan import commit_row, miss_level, tree_row
from engine.timings import StepTimings


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Commits:
    def __init__(self, scheduler: Scheduler, output: OutputProcessor, timings: StepTimings, spec_k: int,
                 live: dict[int, Sequence], retained: dict[int, Sequence]):
        self.scheduler, self.output, self.timings, self.spec_k = scheduler, output, timings, spec_k
        self.live, self.retained = live, retained
        self.native = True      # runs of common plain commits in native code (engine/requests/csrc/hostpath.cpp);
                                # False: all in Python, their definition

    def step(self, rows, tokens: list, guided_failure: str | None = None,
             logprobs: HostLogprobs | None = None, spec: bool = False) -> list[RequestOutput]:
        """A step's rows with the tokens its device work sampled: one per sampling row, or in a speculating step
        (`spec`) a list per row (ModelRunner.wait). A plain step of a speculating engine commits as any plain
        step does, the common rows in native code."""
        outputs = []
        now = time.perf_counter()
        spec_rows = spec_proposed = spec_accepted = spec_leaves = 0
        levels = self.timings.spec_levels
        k = self.spec_k if spec else 0
        i, native = 0, self.native and not k and isinstance(tokens, list)
        while i < len(rows):
            if native:      # a run of rows that need nothing else (the loop below, for them), in one call
                i = _hostpath.commit_plain(rows, i, tokens, bool(guided_failure), now, self.output.eos_ids, outputs,
                                           self._commit_failed)
                if i == len(rows):
                    break
            row = rows[i]
            i += 1
            seq = row.seq
            if not self.scheduler.landed(row):    # zombie: rode along, commits nothing
                self.timings.zombie_rows += 1
                continue
            if not row.sample:
                continue
            guided_error = seq.guided and (seq.guided.error or guided_failure)
            if guided_error:
                outputs.append(self.fail(seq, guided_error))
                continue
            try:
                if not k:
                    out = self.output.commit_plain(seq, tokens[row.sample_idx])
                    if out is not None:         # the common decode row: one token that ends nothing
                        if seq.closer is not None:
                            seq.closer.committed(seq, 1)
                        seq.first_token_time = seq.first_token_time or now
                        outputs.append(out)
                        continue
                new = commit_row(seq, row, tokens[row.sample_idx], k) if k \
                    else tokens[row.sample_idx:row.sample_idx + 1]
                if row.spec_k:
                    self.scheduler.rejected(row, len(new) - 1)
                if row.num_drafts:      # (a row that verified no draft did not speculate)
                    drafted, accepted = tokens[row.sample_idx][-1], len(new) - 1
                    levels[row.spec_k] = levels.get(row.spec_k, 0) + 1
                    spec_rows, spec_proposed, spec_accepted = spec_rows + 1, spec_proposed + drafted, \
                        spec_accepted + accepted
                    policy = self.scheduler.spec
                    tree, leaf = tree_row(policy, row, tokens[row.sample_idx])
                    spec_leaves += leaf
                    policy.budget.observe(drafted, accepted, tree, leaf, miss_level(policy, row, tree))
                lps = logprobs.entries(row.sample_idx, len(new), seq.params.logprobs) \
                    if seq.logprobs is not None else None
                outputs.append(self.append(seq, new, now, lps))
            except Exception as exc:
                outputs.append(self._commit_failed(seq, exc))
        if spec_rows:
            self.timings.add(spec_rows=spec_rows, spec_proposed=spec_proposed, spec_accepted=spec_accepted,
                             spec_leaves=spec_leaves)
            self.scheduler.spec.observe(spec_accepted, spec_rows)
        return outputs

    def _commit_failed(self, seq: Sequence, exc: BaseException) -> RequestOutput:
        return self.fail(seq, f"committing its tokens failed: {describe(exc)}")

    def close(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Rows the scheduler found closing (Closer.closes_now): each appends its whole forced closing and ends,
        with no step."""
        outputs, now = [], time.perf_counter()
        for seq in seqs:
            if seq.finalized:
                continue
            try:
                outputs.append(self.append(seq, list(seq.closer.forced), now))
            except Exception as exc:
                outputs.append(self._commit_failed(seq, exc))
        return outputs

    def append(self, seq: Sequence, new: list[int], now: float, logprobs: list | None = None) -> RequestOutput:
        """Append a step's tokens for one request (several with speculation); it may stop inside them.
        `logprobs`: an entry per token of `new`, for a request that asked for them."""
        if NO_TOKEN in new:
            return self.fail(seq, "no token was allowed here (the request's token mask was empty)")
        before = len(seq.output_token_ids)
        reason = self.output.commit(seq, new)
        if seq.closer is not None and not reason:
            seq.closer.committed(seq, len(seq.output_token_ids) - before)
        if logprobs is not None:
            seq.logprobs.extend(logprobs[:len(seq.output_token_ids) - before])
        seq.first_token_time = seq.first_token_time or now
        if reason:
            self.finish(seq, reason, now)
        out = self.output.output(seq, len(seq.output_token_ids) - before, seq.finalized, reason)
        if not reason:
            return out
        return out._replace(spec=seq.spec.as_dict() if seq.spec is not None else None,
                            cached_tokens=seq.num_cached_tokens, prompt_logprobs=seq.prompt_logprobs,
                            closed_by=seq.closed_by)

    def finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        seq.finish_time = now or time.perf_counter()
        self.scheduler.finish(seq, reason)
        self.live.pop(seq.seq_id, None)
        if seq.retain:
            self.retained[seq.seq_id] = seq

    def fail(self, seq: Sequence, message: str) -> RequestOutput:
        seq.error = message
        if not seq.finalized:
            self.finish(seq, "error")
        return self.final_output(seq, "error", message)

    def final_output(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        try:
            return self.output.fail(seq, reason, error)
        except Exception:                     # the request's output state is what broke: report it bare
            return RequestOutput(seq.seq_id, (), "", True, reason, error, tuple(seq.output_token_ids), seq.text)
