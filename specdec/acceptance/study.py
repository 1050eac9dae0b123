"""An acceptance-length study: which engines to build, which runs each does, and what a run measures.

One engine per method (drafter, K, draft masks, forced drafts), built and closed one after another, every step
speculating at K (spec_min_acceptance 0, spec_budget off, spec_max_batch = batch). Each runs every (dataset,
guided, temperature) it applies to: the dataset's prompts all at once (max_num_seqs = batch), to EOS or
max_tokens. A "none" engine (no speculation) runs the same prompts first: the tokens greedy speculation must
reproduce, and the tok/s a speedup is over.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from specdec.acceptance.measure import measure
from specdec.datasets import Dataset, is_schema_set, load_dataset, parse_dataset

DRAFTERS = ("ngram", "eagle", "draft_model")


@dataclass
class Study:
    datasets: list[str]
    drafters: list[str] = field(default_factory=lambda: ["ngram"])
    ks: list[int] = field(default_factory=lambda: [1, 2, 3])
    guided: list[bool] = field(default_factory=lambda: [False, True])
    draft_masks: list[bool] = field(default_factory=lambda: [False])
    forced_drafts: list[bool] = field(default_factory=lambda: [False])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    batch: int = 8
    max_tokens: int = 128
    prompts: int = 16
    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    data: str | None = None           # root holding maskbench/ (and raw/); None: tests/data
    heads: list[str] = field(default_factory=list)   # eagle: head directories ([]: the one shipped for the model)
    draft_model: str | None = None    # draft_model: a model spec sharing the tokenizer
    baseline: bool = True             # run "none" too: same_tokens_as_none and speedup
    seed: int = 0                     # sampled runs: prompt i has seed seed + i, in every engine
    passes: int = 1                   # runs of each case on the same engine (records carry `pass`): the later ones
                                      # see what a server that met those prompts before holds (compiled grammars,
                                      # the forced texts' tokens)
    engine: dict = field(default_factory=dict)    # further EngineConfig fields

    def validate(self) -> None:
        """Raise ValueError naming the command-line option of the first bad input."""
        if not self.datasets:
            raise ValueError("--datasets: give at least one dataset")
        for item in self.datasets:
            try:
                parse_dataset(item, self.data)
            except ValueError as e:
                raise ValueError(f"--datasets: {e}") from None
        checks = [("--drafters", self.drafters, lambda d: d in DRAFTERS, f"one of {', '.join(DRAFTERS)}"),
                  ("--k", self.ks, lambda k: isinstance(k, int) and 1 <= k <= 16, "an integer in 1..16"),
                  ("--temperature", self.temperatures, lambda t: t >= 0, ">= 0 (0 = greedy)")]
        for option, values, ok, want in checks:
            if not values:
                raise ValueError(f"{option}: give at least one value")
            for v in values:
                if not ok(v):
                    raise ValueError(f"{option}: {v!r} is not {want}")
        for option, value in (("--batch", self.batch), ("--max-tokens", self.max_tokens), ("--prompts", self.prompts),
                              ("--passes", self.passes)):
            if value < 1:
                raise ValueError(f"{option}: must be >= 1, got {value}")
        for head in self.heads:
            if not os.path.isfile(os.path.join(head, "head.json")):
                raise ValueError(f"--head: {head!r} is not a head directory (no head.json in it)")
        if "draft_model" in self.drafters and not self.draft_model:
            raise ValueError("--draft-model: --drafters draft_model needs a model spec (a path, 'default', 'dummy:X')")
        if not self.methods():
            raise ValueError("--draft-masks / --forced-drafts: every combination given is meaningless here (they "
                             "need --guided on, a schema dataset and an eagle or draft_model drafter)")
        if not self.cases():
            raise ValueError("--guided: nothing to run (only schema datasets can be guided; add --guided off)")

    # ---- the plan ----------------------------------------------------------------------------------------
    def cases(self, masks: bool = False) -> list[tuple[str, bool, float]]:
        """(dataset, guided, temperature) runs of one engine; draft masks or forced drafts: guided runs only."""
        out = []
        for item in self.datasets:
            schema = is_schema_set(parse_dataset(item, self.data)[1])
            for g in self.guided:
                if (g and not schema) or (masks and not g):
                    continue                       # free text is never guided; masks change only guided runs
                out += [(item, g, t) for t in self.temperatures]
        return list(dict.fromkeys(out))

    def methods(self) -> list[Method]:
        out = []
        for drafter in self.drafters:
            combos = [(False, False)] if drafter == "ngram" else \
                [(m, f) for m in self.draft_masks for f in self.forced_drafts]
            heads = self.head_labels() if drafter == "eagle" else {None: None}
            out += [Method(drafter, k, m, f, head, tag) for k in self.ks for head, tag in heads.items()
                    for m, f in combos if not (m or f) or self.cases(masks=True)]
        return list(dict.fromkeys(out))

    def head_labels(self) -> dict:
        """{head directory: its label in method names}: none for one head (or the shipped one), else the
        directory's name, with its parent's when two names are the same."""
        if len(self.heads) < 2:
            return {(self.heads or [None])[0]: None}
        names = [os.path.basename(os.path.normpath(h)) for h in self.heads]
        return {h: n if names.count(n) == 1 else os.path.join(*os.path.normpath(h).split(os.sep)[-2:])
                for h, n in zip(self.heads, names)}

    def plan(self) -> list[tuple[Method, list]]:
        """(method, its cases) in run order: "none" first, over every case any method runs."""
        plan = [(m, self.cases(masks=m.draft_masks or m.forced_drafts)) for m in self.methods()]
        if self.baseline:
            union = list(dict.fromkeys(c for _, cases in plan for c in cases))
            plan.insert(0, (Method("none", 0), union))
        return [(m, c) for m, c in plan if c]


@dataclass(frozen=True)
class Method:
    drafter: str
    k: int
    draft_masks: bool = False
    forced_drafts: bool = False
    head: str | None = None          # eagle: the head directory (None: the shipped one)
    head_label: str | None = None    # shown in the name when a study compares heads

    @property
    def name(self) -> str:
        tag = f"[{self.head_label}]" if self.head_label else ""
        return self.drafter + tag + "+masks" * self.draft_masks + "+forced" * self.forced_drafts

    def engine_kwargs(self, study: Study) -> dict:
        kw = dict(max_num_seqs=study.batch, device=study.device, **({"model": study.model} if study.model else {}),
                  **({"dtype": study.dtype} if study.dtype else {}))
        if self.drafter != "none":
            kw.update(speculative=self.drafter, num_speculative_tokens=self.k, spec_max_batch=study.batch,
                      spec_min_acceptance=0.0, spec_budget=False, guided_draft_masks=self.draft_masks,
                      guided_forced_drafts=self.forced_drafts)
        if self.drafter == "eagle" and self.head:
            kw["spec_head"] = self.head
        if self.drafter == "draft_model":
            kw["spec_draft_model"] = study.draft_model
        return kw | study.engine


# ---- running it ----------------------------------------------------------------------------------------------
def run_study(study: Study, progress: bool = True) -> list[dict]:
    """One record per (method, dataset, guided, temperature); see report.py for the fields' meaning."""
    study.validate()
    plan = study.plan()
    bar = _bar(sum(len(c) for _, c in plan), progress)
    datasets: dict[str, Dataset] = {}
    baseline: dict[tuple, dict] = {}
    records = []
    try:
        for method, cases in plan:
            eng = _build(method, study)
            try:
                for item in dict.fromkeys(c[0] for c in cases):
                    datasets.setdefault(item, _fit(load_dataset(eng, item, study.data, study.prompts), eng, study))
                for item, guided, temp in cases:
                    bar.set_postfix_str(f"{method.name}{f' K={method.k}' * bool(method.k)} {item}"
                                        f"{' guided' * guided}{f' T={temp:g}' * bool(temp)}")
                    for run in range(1, study.passes + 1):
                        rec, outputs = measure(eng, datasets[item], guided, temp, batch=study.batch,
                                              max_tokens=study.max_tokens, seed=study.seed)
                        rec.update(method=method.name, drafter=method.drafter, k=method.k,
                                   draft_masks=method.draft_masks, forced_drafts=method.forced_drafts,
                                   head=method.head, **({"pass": run} if study.passes > 1 else {}))
                        _compare(rec, outputs, baseline, (item, guided, temp, run), method)
                        records.append(rec)
                    bar.update()
            finally:
                _close(eng)
    finally:
        bar.close()
    return records


def _bar(total: int, enabled: bool):
    import sys

    from tqdm import tqdm
    return tqdm(total=total, desc="acceptance runs", unit="run", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


def _build(method: Method, study: Study):
    from engine.llm_engine import LLMEngine
    return LLMEngine(**method.engine_kwargs(study))


def _close(eng) -> None:
    import gc

    import torch
    eng.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fit(ds: Dataset, eng, study: Study) -> Dataset:
    """Drop the prompts that cannot run: too long for the context, or a schema SamplingParams refuses."""
    from engine.requests.sequence import SamplingParams
    keep = []
    for i, prompt in enumerate(ds.prompts):
        if len(prompt) + study.max_tokens > eng.max_model_len:
            continue
        if ds.schemas is not None and True in study.guided:
            try:
                SamplingParams(json_schema=ds.schemas[i])
            except ValueError:
                continue
        keep.append(i)
    if not keep:
        raise ValueError(f"dataset {ds.name}: no prompt fits (max_model_len {eng.max_model_len})")
    schemas = [ds.schemas[i] for i in keep] if ds.schemas is not None else None
    return Dataset(ds.name, [ds.prompts[i] for i in keep], schemas)


def _compare(rec: dict, outputs: list, baseline: dict, case: tuple, method: Method) -> None:
    """Keep the baseline's tokens and tok/s; fill a speculative record's same_tokens_as_none and speedup."""
    if method.drafter == "none":
        baseline[case] = dict(outputs=outputs, tok_s=rec["tok_s"])
        return
    base = baseline.get(case)
    greedy = rec["temperature"] == 0
    rec["same_tokens_as_none"] = (outputs == base["outputs"]) if base and greedy else None
    # CPU tok/s says nothing about speed (interpreted kernels, no graphs): no speedup is derived from it
    gpu = rec["device"] != "cpu"
    rec["speedup"] = round(rec["tok_s"] / base["tok_s"], 3) if base and gpu else None
