"""Multi-turn tool-calling agents, with prefix caching on and off in one run.

    python -m bench.serving.agent                           # default model, CUDA: 1 / 8 / 32 agents, 4 turns
    python -m bench.serving.agent --model dummy:llama-1b --tokenizer default  # a larger model: random weights
    python -m bench.serving.agent --device cpu --dtype float32 --agents 1 2 --turns 2 --system-tokens 300 \
        --out /tmp/a.json

Each agent is one conversation: a system prompt of instructions and tool schemas (BFCL function schemas from
--data, listed until the prompt reaches --system-tokens), then --turns turns. A turn is a user request, one
guided tool call (the tool's schema as the request's JSON schema) and a made-up tool result appended as the
next user message, so every turn's prompt extends the last one. All agents run at once (closed loop: an
agent sends its next turn when its call finishes). The agents share the system prompt; each agent's turns share
its history. Per (caching, agents): TTFT p50 / p99 (request added to its first token), output tok/s over the
run, time per tool call (added to finished), the share of prompt tokens found in the cache, and the share of
calls that validate against their tool's schema (jsonschema; a call cut at --max-tokens does not). One engine
per caching setting; a warm-up conversation first (other prompts).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import markdown_table, note, plot, progress, record, write_results
from bench.guided.guided_quality import check_output

from specdec.datasets import DEFAULT_ROOT, load_schemas, resolve

COLUMNS = ["mode", "streams", "turns", "ttft_p50_ms", "ttft_p99_ms", "tok_s", "call_ms", "cached_frac", "valid_frac",
           "requests"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default="", help="a model spec whose tokenizer to use (dummy weights have none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--agents", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=96, help="per tool call")
    p.add_argument("--data", default=str(DEFAULT_ROOT), help="root of maskbench/BFCL_*.json")
    p.add_argument("--out", default="bench/results/agent.json")
    return p.parse_args(argv)


def tools_from(data: str) -> list[tuple[str, dict]]:
    """(function name, the call's schema) of each BFCL schema: an object whose one property is the function."""
    out = []
    for _, doc in load_schemas(resolve("maskbench/BFCL_*.json", data)):
        schema = doc.get("schema", doc) if isinstance(doc, dict) else doc
        props = schema.get("properties") or {}
        if len(props) == 1:
            out.append((next(iter(props)), schema))
    if not out:
        raise SystemExit(f"no BFCL function schemas under {data}/maskbench")
    return out


def system_prompt(eng, tools, target: int) -> tuple[str, list]:
    """Instructions, then numbered tool listings (the tools again under new numbers) until `target` tokens;
    also the tools it lists (the only ones its agents call)."""
    text = ("You are an agent that acts only through tools. Answer every request with exactly one tool call, "
            "as a JSON object whose one key is the tool's name and whose value holds its arguments.\nTools:\n")
    i = 0
    while len(eng.encode(text)) < target:
        name, schema = tools[i % len(tools)]
        text += f"{i + 1}. {name}: {json.dumps(schema['properties'][name], separators=(',', ':'))}\n"
        i += 1
    return text, tools[:min(i, len(tools))]


class Agent:
    def __init__(self, index: int, system: str, tools, turns: int):
        self.index, self.tools, self.turns = index, tools, turns
        self.messages = [{"role": "system", "content": system}]
        self.turn = 0

    def next_request(self, eng, max_tokens: int):
        from engine.requests.sequence import SamplingParams
        name, schema = self.tools[(self.index + self.turn) % len(self.tools)]
        self.messages.append({"role": "user", "content": f"Request {self.turn + 1}: use {name} for case "
                                                         f"{self.index * 100 + self.turn}."})
        params = SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=schema)
        return eng.apply_chat_template(self.messages), params, schema

    def answered(self, text: str) -> bool:
        self.messages += [{"role": "assistant", "content": text},
                          {"role": "user", "content": f"Tool result: {{\"ok\": true, \"turn\": {self.turn + 1}}}"}]
        self.turn += 1
        return self.turn < self.turns


def run_agents(eng, agents, max_tokens: int) -> dict:
    """All agents at once until each did its turns; per request: TTFT, latency, tokens, cached share, JSON."""
    live, done, schemas = {}, [], {}

    def add_all(ready):
        # every request is templated before any is added: one's TTFT never includes another's templating
        for a, prompt, params, schema in [(a, *a.next_request(eng, max_tokens)) for a in ready]:
            rid = eng.add_request(prompt, params, retain=True)
            live[rid], schemas[rid] = a, schema

    t0 = time.perf_counter()
    add_all(agents)
    while live:
        ready = []
        for rid in [o.request_id for o in eng.step() if o.finished and o.request_id in live]:
            agent, seq = live.pop(rid), eng.take(rid)
            done.append((seq, schemas.pop(rid)))
            if agent.answered(seq.text):
                ready.append(agent)
        add_all(ready)
    wall = time.perf_counter() - t0
    valid = sum(check_output(schema, s.text)[0] == "valid" for s, schema in done) / len(done)
    done = [s for s, _ in done]
    ttft = sorted(1e3 * (s.first_token_time - s.arrival) for s in done if s.first_token_time)
    return dict(wall_s=wall, requests=len(done), output_tokens=sum(len(s.output_token_ids) for s in done),
                ttft_p50_ms=statistics.median(ttft), ttft_p99_ms=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                call_ms=statistics.mean(1e3 * (s.finish_time - s.arrival) for s in done),
                cached_frac=sum(s.num_cached_tokens for s in done) / sum(len(s.prompt_token_ids) for s in done),
                valid_frac=valid)


def bench(args) -> list[dict]:
    from engine.llm_engine import LLMEngine
    records = []
    for caching in progress([True, False], "prefix caching on / off"):
        eng = LLMEngine(model=args.model or "default", tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                        max_num_seqs=max(args.agents), max_model_len=4096, prefix_caching=caching)
        system, tools = system_prompt(eng, tools_from(args.data), args.system_tokens)
        # graphs, and each listed tool's grammar compiled once: TTFT measures serving, not compiles
        run_agents(eng, [Agent(10**4 + i, "Warm-up. " + system, tools, 1) for i in range(len(tools))],
               args.max_tokens)      # (a whole tool call: a budget shorter than one is refused)
        for n in args.agents:
            if caching:
                eng.reset_prefix_cache()        # each run starts cold: only its own requests fill the cache
            r = run_agents(eng, [Agent(i, system, tools, args.turns) for i in range(n)], args.max_tokens)
            mode = "caching on" if caching else "caching off"
            note(f"{mode}, {n} agents: TTFT p50 {r['ttft_p50_ms']:.1f} ms, cached {r['cached_frac']:.0%}")
            records.append(record("agent", mode, eng.source.name, eng.config.dtype, n, args.max_tokens,
                                  r["output_tokens"] / r["wall_s"], None, turns=args.turns,
                                  system_tokens=len(eng.encode(system)), tools=len(tools), **r))
        eng.close()
        del eng
    return records


def main(argv=None):
    args = parse_args(argv)
    records = bench(args)
    out = write_results(records, args.out)
    base = str(out).rsplit(".", 1)[0]
    plot(records, "streams", "ttft_p50_ms", "mode", base + ".png", "Agents: time to first token (p50)", logy=True)
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}; "
            f"{records[0]['model']} {records[0]['dtype']}, system prompt {records[0]['system_tokens']} tokens "
            f"listing {records[0]['tools']} tools, "
            f"{args.turns} turns, tool calls up to {args.max_tokens} tokens (streams = agents).\n\n"
            + markdown_table(records, COLUMNS))
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
