"""The guided loads of bench.step.host_step: JSON-schema requests, and the outputs they take with the model's forward
taken out (each row's lowest allowed token, or the model's own outputs recorded once and replayed)."""
from __future__ import annotations

from contextlib import ExitStack

GUIDED_PROMPT_TOKENS = 512  # schemas whose prompt is longer are left out


def guided_work(eng, schemas: str, max_tokens: int, closing: bool = False) -> list[tuple[list[int], object]]:
    """(prompt ids, guided params) of each schema at `schemas` whose prompt fits GUIDED_PROMPT_TOKENS; `closing`:
    outputs close at their budget (else they are cut there: the grammar's host cost alone)."""
    from engine.requests.sequence import SamplingParams
    from specdec.datasets import load_schemas, resolve, schema_prompt
    work = []
    for _, schema in load_schemas(resolve(schemas)):
        ids = schema_prompt(eng, schema)
        if len(ids) <= GUIDED_PROMPT_TOKENS:
            work.append((ids, SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=schema,
                                              close_at_budget=closing)))
    if not work:
        raise ValueError(f"no schema at {schemas} has a prompt of at most {GUIDED_PROMPT_TOKENS} tokens")
    return work


def first_allowed(bitmask):
    """Each row's lowest allowed token (xgrammar's layout: bit j of word w allows token 32w + j), NO_TOKEN where
    none is: what the sampler picks from all-zero logits under that mask. numpy and Python ints: torch's per-op
    overhead on these small arrays would be most of a step."""
    import numpy as np
    import torch
    from engine.sampling.sampler import NO_TOKEN
    words = bitmask.numpy()
    first = (words != 0).argmax(1)
    word = words[np.arange(len(words)), first].astype(np.int64) & 0xFFFFFFFF
    return torch.tensor([32 * f + (w & -w).bit_length() - 1 if w else NO_TOKEN
                         for f, w in zip(first.tolist(), word.tolist())], dtype=torch.int64)


def first_allowed_model(stack: ExitStack, eng) -> None:
    """The model's layers give zeros and each row takes the lowest token its grammar allows, read from the mask
    the grammar node filled (undone when the stack closes). The sampler's masking of the whole vocabulary on the
    CPU (~2.6 ms at 32 rows, a GPU's work) would otherwise be most of the step and evict the host's data."""
    import torch
    program = eng.runner.program
    hidden = program.model.head_weight.shape[1]
    program.hidden = lambda slot, extras=False: torch.zeros(slot.num_sample, hidden) if slot.num_sample else None
    program.model.compute_logits = lambda h: h[:, :1]          # unread: the tokens come from the mask
    program.sample = lambda slot, logits, rows, greedy, mask=None, extras=False: program.emit(
        slot, first_allowed(mask[:rows]), rows)
    program.masked_greedy = lambda hidden, variant: False      # every guided row through `sample` above
    for name in ("hidden", "sample", "masked_greedy"):
        stack.callback(delattr, program, name)
    stack.callback(delattr, program.model, "compute_logits")


def record_outputs(eng, work) -> dict[tuple, list[int]]:
    """Each work item's output as the model writes it (greedy, its own forward; EOS included where it ends), by
    its prompt."""
    seqs = eng.generate([ids for ids, _ in work], [params for _, params in work])
    return {tuple(ids): list(s.output_token_ids) for (ids, _), s in zip(work, seqs)}


def replayed_model(stack: ExitStack, eng, outputs: dict[tuple, list[int]]) -> None:
    """The model's layers give zeros and each row takes the token its prompt's recorded output holds at the index
    it samples (undone when the stack closes): the outputs the model writes, at the host cost alone."""
    import torch

    from engine.sampling.sampler import NO_TOKEN
    program, of_seq = eng.runner.program, {}

    def replay(slot, logits, rows, greedy, mask=None, extras=False):
        tokens, steps = [NO_TOKEN] * rows, slot.np["steps"]
        for row in slot.rows:
            if row.sample and 0 <= row.sample_idx < rows:
                seq = row.seq
                out = of_seq.get(seq.seq_id)
                if out is None:
                    out = of_seq[seq.seq_id] = outputs[tuple(seq.prompt_token_ids)]
                i = int(steps[row.sample_idx])
                tokens[row.sample_idx] = out[i] if i < len(out) else NO_TOKEN
        program.emit(slot, torch.tensor(tokens, dtype=torch.int64), rows)

    first_allowed_model(stack, eng)
    program.sample = replay
