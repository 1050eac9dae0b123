"""One side of bench/peers/peers_vllm.py, run in its own process: `python -m bench.peers.sides PLAN.json RESULT.json`.

The plan (written by the driver) names the side ("specdec" or "vllm"), the checkpoint directory, the prompts
as token ids, the settings and the drafter (`spec`: None, or n-gram at K with its n range); the result holds the
records and the output token ids for the cross-checks.
Everything here imports the side's engine lazily, so the vLLM side never imports `engine` and ours never vllm.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

from bench.common import note, record


# ---- the two engines behind one interface ------------------------------------------------------------------
# generate(prompts, specs) -> [(token ids, finish reason)]; counters() -> speculation counters so far:
# drafts (row-steps that verified at least one draft: vLLM's num_drafts), draft_tokens, accepted.
class Specdec:
    def __init__(self, plan: dict):
        from engine.llm_engine import LLMEngine
        s, spec = plan["settings"], plan.get("spec")
        drafter = dict(speculative="ngram", num_speculative_tokens=spec["k"], ngram_min_n=spec["min_n"],
                       ngram_max_n=spec["max_n"]) if spec else {}
        self.eng = LLMEngine(model=plan["model_dir"], dtype=plan["dtype"], max_num_seqs=max(plan["streams"]),
                             max_num_batched_tokens=s["max_num_batched_tokens"],
                             kv_cache_memory_fraction=s["memory_fraction"], enforce_eager=s["enforce_eager"],
                             **drafter, **s.get("engine", {}))
        c = self.eng.config
        self.info = dict(engine="specdec", depth=c.depth, graphs=self.eng.runner.graphs is not None,
                         attention_backend=c.attention_backend, grammar_node=c.tuning.grammar_node)
        if spec:
            self.info.update(spec_max_batch=c.spec_max_batch, spec_min_acceptance=c.spec_min_acceptance)
        self.drafts = 0

    def counters(self) -> dict:
        t = self.eng.timings
        return dict(drafts=self.drafts, draft_tokens=t.spec_proposed, accepted=t.spec_accepted,
                    verify_rows=t.spec_rows)

    def generate(self, prompts, specs):
        from engine.requests.sequence import SamplingParams
        params = [SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=s["ignore_eos"],
                                 json_schema=s.get("schema")) for s in specs]
        seqs = self.eng.generate(prompts, params)
        _sync()
        self.drafts += sum(q.spec.proposed_by_position[0] for q in seqs
                           if q.spec is not None and q.spec.proposed_by_position)
        return [(list(q.output_token_ids), q.finish_reason) for q in seqs]

    def close(self):
        self.eng.close()


class Vllm:
    def __init__(self, plan: dict):
        import vllm
        from vllm import LLM
        s, spec = plan["settings"], plan.get("spec")
        drafter = dict(speculative_config=dict(method="ngram", num_speculative_tokens=spec["k"],
                                               prompt_lookup_min=spec["min_n"], prompt_lookup_max=spec["max_n"]),
                       disable_log_stats=False) if spec else {}
        self.llm = LLM(model=plan["model_dir"], tokenizer=plan["model_dir"], dtype=plan["dtype"], seed=0,
                       max_num_seqs=max(plan["streams"]), max_num_batched_tokens=s["max_num_batched_tokens"],
                       gpu_memory_utilization=s["memory_fraction"], enforce_eager=s["enforce_eager"],
                       enable_prefix_caching=s["vllm_prefix_caching"],
                       structured_outputs_config=dict(backend="xgrammar", disable_any_whitespace=True),
                       **drafter, **s.get("vllm", {}))
        self.info = dict(engine="vllm", vllm_version=vllm.__version__, **_vllm_config(self.llm))

    def generate(self, prompts, specs):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        params = [SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=s["ignore_eos"],
                                 structured_outputs=StructuredOutputsParams(json=s["schema"]) if s.get("schema")
                                 else None) for s in specs]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

    def counters(self) -> dict:
        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
        out = dict.fromkeys(names.values(), 0)
        for m in self.llm.get_metrics():
            if m.name in names and hasattr(m, "value"):
                out[names[m.name]] += m.value
        return out

    def close(self):
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:                  # the engine core process: stop it now, not at exit
            core.shutdown(timeout=30)
        del self.llm


def _vllm_config(llm) -> dict:
    try:
        cfg = llm.llm_engine.vllm_config
        return dict(compilation_mode=str(cfg.compilation_config.mode),
                    cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
                    async_scheduling=getattr(cfg.scheduler_config, "async_scheduling", None))
    except Exception as e:                    # noqa: BLE001 - a record must never fail on this
        return dict(vllm_config_error=f"{type(e).__name__}: {e}")


SIDES = {"specdec": Specdec, "vllm": Vllm}


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- measurements ------------------------------------------------------------------------------------------
def timed(side, prompts, specs, repeats: int):
    """Median wall over `repeats` runs, and the last run's outputs."""
    walls, outs = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = side.generate(prompts, specs)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), outs


def decode(side, plan, n: int) -> tuple[dict, list]:
    prompts, warm, t = plan["prompts"][:n], plan["prompts"][-n:], plan["new_tokens"]
    spec = lambda k: [dict(max_tokens=k, ignore_eos=True)] * n             # noqa: E731
    side.generate(warm, spec(8))
    ttft, _ = timed(side, prompts, spec(1), plan["repeats"])
    wall, outs = timed(side, prompts, spec(t), plan["repeats"])
    generated = sum(len(o) for o, _ in outs)
    return dict(mode="decode", new_tokens=t, tok_s=generated / wall, ms_per_step=1e3 * wall / t, wall_s=wall,
                ttft_ms=1e3 * ttft, tpot_ms=1e3 * (wall - ttft) / max(t - 1, 1), generated_tokens=generated,
                short_outputs=sum(len(o) < t for o, _ in outs)), [o for o, _ in outs]


def jme_work(plan, n: int, schema: bool) -> tuple[list, list, list]:
    """Request k: JSON Mode Eval prompt k % S, EOS allowed, the guided cap; its schema as a guide if `schema`."""
    work, cap = plan["guided"], plan["guided_tokens"]
    items = [work[k % len(work)] for k in range(n)]
    specs = [dict(max_tokens=cap, ignore_eos=False, schema=w["schema"] if schema else None) for w in items]
    warm = [dict(max_tokens=cap, ignore_eos=False, schema=w["schema"] if schema else None) for w in work]
    return [w["prompt"] for w in items], specs, ([w["prompt"] for w in work], warm)


def to_eos(side, plan, n: int, mode: str, schema: bool) -> tuple[dict, list]:
    """JSON Mode Eval prompts to EOS or the cap (guided when `schema`); one untimed round first (grammars,
    and vLLM's n-gram tables warm). With a drafter: its counters over the timed runs."""
    prompts, specs, warm = jme_work(plan, n, schema)
    side.generate(*warm)
    before = side.counters() if plan.get("spec") else None
    wall, outs = timed(side, prompts, specs, plan["repeats"])
    generated = sum(len(o) for o, _ in outs)
    rec = dict(mode=mode, new_tokens=plan["guided_tokens"], tok_s=generated / wall,
               ms_per_step=1e3 * wall / max(len(o) for o, _ in outs), wall_s=wall, generated_tokens=generated,
               mean_len=generated / n, finished_frac=sum(r == "stop" for _, r in outs) / n,
               schemas=len(plan["guided"]), schemas_skipped=len(plan.get("skipped_schemas", ())),
               skipped_schemas=plan.get("skipped_schemas"))
    if before is not None:
        d = {k: v - before.get(k, 0) for k, v in side.counters().items()}
        rec.update({f"spec_{k}": v for k, v in d.items()})
        rec["accept_len"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else None
    return rec, [o for o, _ in outs]


def guided(side, plan, n: int) -> tuple[list[dict], dict]:
    g_rec, g_outs = to_eos(side, plan, n, "guided", schema=True)
    lengths = [max(len(o), 1) for o in g_outs]
    prompts = jme_work(plan, n, False)[0]
    f_wall, f_outs = timed(side, prompts, [dict(max_tokens=k, ignore_eos=True) for k in lengths], plan["repeats"])
    generated = sum(len(o) for o, _ in f_outs)
    f_rec = dict(mode="free", new_tokens=plan["guided_tokens"], tok_s=generated / f_wall,
                 ms_per_step=1e3 * f_wall / max(lengths), wall_s=f_wall, generated_tokens=generated,
                 mean_len=generated / n, schemas=len(plan["guided"]))
    g_rec["guided_over_free"] = g_rec["wall_s"] / f_wall
    j_rec, j_outs = to_eos(side, plan, n, "jme", schema=False)
    return [g_rec, f_rec, j_rec], {"guided": g_outs, "jme": j_outs}


def ngram(side, plan, n: int) -> tuple[list[dict], dict]:
    (a, a_outs), (b, b_outs) = (to_eos(side, plan, n, m, s) for m, s in (("ngram", False), ("ngram_guided", True)))
    return [a, b], {"ngram": a_outs, "ngram_guided": b_outs}


def decode_part(side, plan, n: int) -> tuple[list[dict], dict]:
    rec, outs = decode(side, plan, n)
    return [rec], {"decode": outs}


PARTS = {"decode": decode_part, "guided": guided, "ngram": ngram}


def run(plan: dict) -> dict:
    name, model = plan["side"], plan["model_name"]
    records, outputs, side, info = [], {}, None, {}

    def rec(fields: dict, n: int, **extra):
        fields = dict(fields, **extra, **info)
        mode, t = fields.pop("mode"), fields.pop("new_tokens")
        return record("peers_vllm", mode, model, plan["dtype"], n, t, fields.pop("tok_s", None),
                      fields.pop("ms_per_step", None), side=name, label=f"{name} {mode}", **fields)

    try:
        t0 = time.perf_counter()
        side = SIDES[name](plan)
        info = dict(side.info, startup_s=time.perf_counter() - t0)
        note(f"{name}: engine ready in {info['startup_s']:.0f} s")
    except Exception as e:                    # noqa: BLE001 - the driver records it for every row
        traceback.print_exc()
        return dict(records=[], outputs=outputs, error=f"{type(e).__name__}: {e}")
    for n in plan["streams"]:
        for part in plan["parts"]:
            try:
                rows, outs = PARTS[part](side, plan, n)
                records += [rec(r, n) for r in rows]
                for mode, ids in outs.items():
                    outputs.setdefault(mode, {})[str(n)] = ids
                note(f"{name} {part} streams={n}: " + ", ".join(f"{r['mode']} {r['tok_s']:,.0f} tok/s" for r in rows))
            except Exception as e:            # noqa: BLE001 - one failing case must not end the sweep
                traceback.print_exc()
                records += [rec(dict(mode=m, new_tokens=plan["new_tokens"]), n, error=f"{type(e).__name__}: {e}")
                            for m in plan["modes"][part]]
            gc.collect()
    return dict(records=records, outputs=outputs, error=None, side=side)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", type=Path, help="the plan, written by the driver")
    p.add_argument("result", type=Path, help="where the result goes")
    args = p.parse_args(argv)
    plan_path, result_path = args.plan, args.result
    result = run(json.loads(plan_path.read_text()))
    side = result.pop("side", None)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(result_path)                  # whole, before the engine closes: the driver ends a slow exit
    if side is not None:
        side.close()


if __name__ == "__main__":
    main()
