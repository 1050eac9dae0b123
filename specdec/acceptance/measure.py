"""One run of a study: a dataset's prompts through one engine, timed, and what the run measures (see
report.py for the fields)."""
from __future__ import annotations

import time
from dataclasses import replace

from specdec.datasets import Dataset


def _params(ds: Dataset, guided: bool, temp: float, max_tokens: int, seed: int) -> list:
    from engine.requests.sequence import SamplingParams
    return [SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed + i if temp > 0 else None,
                           json_schema=ds.schemas[i] if guided else None) for i in range(len(ds.prompts))]


def measure(eng, ds: Dataset, guided: bool, temp: float, *, batch: int, max_tokens: int,
            seed: int) -> tuple[dict, list]:
    """One run: the dataset's prompts through `eng`, timed; -> (record, output token ids per prompt)."""
    import torch
    params = _params(ds, guided, temp, max_tokens, seed)
    cuda = eng.runner.device.type == "cuda"
    if cuda:                                  # kernels, allocator and the grammars warm outside the timing
        eng.generate(ds.prompts, [replace(p, max_tokens=1) for p in params])
        torch.cuda.synchronize()
    eng.timings.reset()
    drafts = draft_masks(eng)
    if drafts is not None:
        drafts.forced_drafts = 0
    t0 = time.perf_counter()
    seqs = eng.generate(ds.prompts, params)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rec = dict(dataset=ds.name, guided=guided, temperature=temp, prompts=len(seqs), model=eng.source.name,
               dtype=str(eng.runner.dtype).replace("torch.", ""), device=_device_name(eng), batch=batch,
               max_tokens=max_tokens, wall_s=round(wall, 4)) | _counts(eng.timings, seqs, wall)
    rec["forced_per_step"] = forced_per_step(eng)
    rec["valid_frac"] = _valid_frac(seqs, ds.schemas) if guided else None
    return rec, [s.output_token_ids for s in seqs]


def draft_masks(eng):
    """The guided drafts' host state (its forced-draft counter, its callback time), when the engine has one."""
    return getattr(getattr(eng.runner, "program", None), "draft_masks", None)


def forced_per_step(eng) -> float:
    """Grammar-forced drafts per verifying row-step since the counters were last reset."""
    d, rows = draft_masks(eng), eng.timings.spec_rows
    return round(d.forced_drafts / rows, 3) if d is not None and rows else 0.0


def _valid_frac(seqs, schemas) -> float | None:
    """Of the outputs that ended by EOS or the grammar's end, the share that validates against its schema."""
    from specdec.validate import check_output
    done = [(s, schema) for s, schema in zip(seqs, schemas) if s.finish_reason == "stop"]
    return round(sum(check_output(schema, s.text)[0] == "valid" for s, schema in done) / len(done), 4) if done else None


def _counts(t, seqs, wall: float) -> dict:
    tokens = sum(len(s.output_token_ids) for s in seqs)
    accepted, proposed = _by_position(seqs)
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    return dict(new_tokens=tokens, steps=t.steps, rows=t.rows, spec_rows=t.spec_rows,
                spec_frac=round(t.spec_rows / max(t.rows, 1), 4), guided_steps=t.guided_steps,
                acceptance_length=round(t.acceptance_length, 4) if t.spec_rows else None,
                tokens_per_step=round(tokens / max(t.steps, 1), 4),
                accepted_by_position=accepted, proposed_by_position=proposed,
                rate_by_position=[round(a / p, 4) for a, p in zip(accepted, proposed) if p],
                tok_s=tokens / wall, ms_per_step=1e3 * wall / max(t.steps, 1),
                finished_frac=round(len(stopped) / max(len(seqs), 1), 4),
                json_frac=round(sum(_parses(s.text) for s in stopped) / len(stopped), 4) if stopped else None,
                errors=sum(s.error is not None for s in seqs))


def _by_position(seqs) -> tuple[list[int], list[int]]:
    """Drafts accepted and proposed at each draft position, summed over the finished requests' SpecStats."""
    width = max((len(s.spec.proposed_by_position) for s in seqs if s.spec is not None), default=0)
    accepted, proposed = [0] * width, [0] * width
    for s in seqs:
        if s.spec is not None:
            for i, (a, p) in enumerate(zip(s.spec.by_position, s.spec.proposed_by_position)):
                accepted[i] += a
                proposed[i] += p
    return accepted, proposed


def _parses(text: str) -> bool:
    import json
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _device_name(eng) -> str:
    import torch
    device = eng.runner.device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
