"""One side of bench/peers_vllm.py, run in its own process: `python bench/peers/sides.py PLAN.json RESULT.json`.

The plan (written by the driver) names the side ("specdec" or "vllm"), the checkpoint directory, the prompts
as token ids and the settings; the result holds the records and the output token ids for the cross-checks.
Everything here imports the side's engine lazily, so the vLLM side never imports `engine` and ours never vllm.
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:                 # run as a script: bench.common from the repository
    sys.path.insert(0, str(REPO))

from bench.common import note, record  # noqa: E402


# ---- the two engines behind one interface: generate(prompts, specs) -> [(token ids, finish reason)] -------------
class Specdec:
    def __init__(self, plan: dict):
        from engine.llm_engine import LLMEngine
        s = plan["settings"]
        self.eng = LLMEngine(model=plan["model_dir"], dtype=plan["dtype"], max_num_seqs=max(plan["streams"]),
                             max_num_batched_tokens=s["max_num_batched_tokens"],
                             kv_cache_memory_fraction=s["memory_fraction"], enforce_eager=s["enforce_eager"],
                             **s.get("engine", {}))
        c = self.eng.config
        self.info = dict(engine="specdec", depth=c.depth, graphs=self.eng.runner.graphs is not None,
                         attention_backend=c.attention_backend, grammar_node=c.grammar_node)

    def generate(self, prompts, specs):
        from engine.sequence import SamplingParams
        params = [SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=s["ignore_eos"],
                                 json_schema=s.get("schema")) for s in specs]
        seqs = self.eng.generate(prompts, params)
        _sync()
        return [(list(q.output_token_ids), q.finish_reason) for q in seqs]

    def close(self):
        self.eng.close()


class Vllm:
    def __init__(self, plan: dict):
        import vllm
        from vllm import LLM
        s = plan["settings"]
        self.llm = LLM(model=plan["model_dir"], tokenizer=plan["model_dir"], dtype=plan["dtype"], seed=0,
                       max_num_seqs=max(plan["streams"]), max_num_batched_tokens=s["max_num_batched_tokens"],
                       gpu_memory_utilization=s["memory_fraction"], enforce_eager=s["enforce_eager"],
                       enable_prefix_caching=s["vllm_prefix_caching"],
                       structured_outputs_config=dict(backend="xgrammar", disable_any_whitespace=True),
                       **s.get("vllm", {}))
        self.info = dict(engine="vllm", vllm_version=vllm.__version__, **_vllm_config(self.llm))

    def generate(self, prompts, specs):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        params = [SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=s["ignore_eos"],
                                 structured_outputs=StructuredOutputsParams(json=s["schema"]) if s.get("schema")
                                 else None) for s in specs]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

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


def guided(side, plan, n: int) -> tuple[list[dict], list]:
    work, cap = plan["guided"], plan["guided_tokens"]
    items = [work[k % len(work)] for k in range(n)]
    prompts = [w["prompt"] for w in items]
    specs = [dict(max_tokens=cap, ignore_eos=False, schema=w["schema"]) for w in items]
    side.generate([w["prompt"] for w in work], [dict(max_tokens=cap, ignore_eos=False, schema=w["schema"])
                                                for w in work])             # compiles (and caches) every grammar
    g_wall, g_outs = timed(side, prompts, specs, plan["repeats"])
    lengths = [max(len(o), 1) for o, _ in g_outs]
    f_wall, f_outs = timed(side, prompts, [dict(max_tokens=k, ignore_eos=True) for k in lengths], plan["repeats"])
    recs = []
    for mode, wall, outs in (("guided", g_wall, g_outs), ("free", f_wall, f_outs)):
        generated = sum(len(o) for o, _ in outs)
        recs.append(dict(mode=mode, new_tokens=cap, tok_s=generated / wall, ms_per_step=1e3 * wall / max(lengths),
                         wall_s=wall, generated_tokens=generated, mean_len=generated / n, schemas=len(work)))
    recs[0].update(guided_over_free=g_wall / f_wall, finished_frac=sum(r == "stop" for _, r in g_outs) / n)
    return recs, [o for o, _ in g_outs]


def run(plan: dict) -> dict:
    name, model = plan["side"], plan["model_name"]
    records, outputs, side, info = [], {"decode": {}, "guided": {}}, None, {}

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
        for part, modes in (("decode", ["decode"]), ("guided", ["guided", "free"])):
            if part not in plan["parts"]:
                continue
            try:
                res, outs = decode(side, plan, n) if part == "decode" else guided(side, plan, n)
                records += [rec(r, n) for r in (res if isinstance(res, list) else [res])]
                outputs[part][str(n)] = outs
                note(f"{name} {part} streams={n}: " + ", ".join(f"{r['mode']} {r['tok_s']:,.0f} tok/s"
                                                               for r in records[-len(modes):]))
            except Exception as e:            # noqa: BLE001 - one failing case must not end the sweep
                traceback.print_exc()
                records += [rec(dict(mode=m, new_tokens=plan["new_tokens"]), n, error=f"{type(e).__name__}: {e}")
                            for m in modes]
            gc.collect()
    return dict(records=records, outputs=outputs, error=None, side=side)


def main(argv=None):
    plan_path, result_path = map(Path, (argv or sys.argv[1:])[:2])
    result = run(json.loads(plan_path.read_text()))
    side = result.pop("side", None)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(result_path)                  # whole, before the engine closes: the driver ends a slow exit
    if side is not None:
        side.close()


if __name__ == "__main__":
    main()
