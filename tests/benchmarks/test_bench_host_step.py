"""bench/step/host_step.py: the host's plan, launch and commit of a step with the forward taken out, on the CPU."""
import json

import pytest

from bench.step import guided_load, host_step


def test_plan_holds_its_parts_and_every_round_is_kept(tmp_path):
    out = tmp_path / "h.json"
    host_step.main(["--streams", "1", "2", "--steps", "5", "--rounds", "2", "--warmup-steps", "2", "--out", str(out)])
    records = json.loads(out.read_text())
    assert [r["streams"] for r in records] == [1, 2]
    for r in records:
        us = r["us"]
        # (streams decoding throughout: nothing is admitted in the timed steps)
        assert len(r["us_rounds"]) == 2 and all(us[k] > 0 for k in host_step.PARTS if k != "admit")
        assert us["admit"] == 0 and r["admitted_per_step"] == 0
        for rnd in r["us_rounds"]:      # schedule, prepare and launched run inside plan; the phases inside a step
            assert rnd["schedule"] + rnd["prepare"] + rnd["launched"] <= rnd["plan"]
            assert rnd["plan"] + rnd["launch"] + rnd["commit"] <= rnd["period"] <= rnd["loop"]
    assert "| 2 |" in out.with_suffix(".md").read_text()


def test_a_profile_round_names_the_engines_functions_after_the_timed_rounds(tmp_path):
    out = tmp_path / "h.json"
    host_step.main(["--streams", "2", "--steps", "4", "--rounds", "1", "--warmup-steps", "2", "--profile", "60",
                    "--out", str(out)])
    (r,) = json.loads(out.read_text())
    assert len(r["us_rounds"]) == 1 and len(r["profile"]) == 60
    names = [f["function"] for f in r["profile"]]
    assert any("commit" in n for n in names), names
    own = [f["own_us"] for f in r["profile"]]
    assert own == sorted(own, reverse=True) and all(f["cumulative_us"] >= f["own_us"] for f in r["profile"])
    assert "cProfile round, 2 streams" in out.with_suffix(".md").read_text()


def test_an_agent_load_replaces_finished_requests(tmp_path):
    """--prompt-tokens: requests of that many prompt tokens finish after --max-tokens and are replaced, so more
    requests than streams ran and every step still had work."""
    out = tmp_path / "h.json"
    host_step.main(["--streams", "2", "--prompt-tokens", "40", "--max-tokens", "3", "--steps", "12", "--rounds", "1",
                    "--warmup-steps", "2", "--out", str(out)])
    (r,) = json.loads(out.read_text())
    assert r["prompt_tokens"] == 40 and r["requests"] >= 2 + 12 * 2 // 5
    assert r["us"]["prepare"] > 0 and r["us"]["plan"] <= r["us"]["period"]
    assert r["stagger"] and r["admitted_per_step"] > 0 and 0 < r["us"]["admit"] < r["us"]["loop"]


def test_stagger_spreads_budgets_over_the_upper_half():
    """--stagger: budgets of replaced requests vary over [M / 2, M], so they finish at an even rate; without it
    each is M."""
    def budgets(*flags):
        load = host_step.Load(None, host_step.parse_args(["--prompt-tokens", "8", "--max-tokens", "10", *flags]), 4, 0)
        out = []
        for made in range(40):
            load.made = made
            out.append(load.request()[1].max_tokens)
        return out
    spread = budgets()
    assert min(spread) == 5 and max(spread) == 10 and len(set(spread)) == 6
    assert set(budgets("--no-stagger")) == {10}


def test_ids_only_requests_are_timed_as_the_servers_engine_adds_them(tmp_path):
    out = tmp_path / "h.json"
    host_step.main(["--streams", "2", "--ids-only", "--steps", "4", "--rounds", "1", "--warmup-steps", "2",
                    "--out", str(out)])
    (r,) = json.loads(out.read_text())
    assert r["ids_only"] and r["us"]["commit"] > 0


def test_a_guided_load_times_its_snapshot_and_push(tmp_path):
    """--guided: JSON-schema requests on the zeroed model take grammar-allowed tokens (none fails: the load would
    raise), finish after --max-tokens and are replaced; the guided parts are timed and the model is back after.
    A request waits for its schema's grammar to compile (on another thread), so a loaded machine finishes fewer in
    the same steps: 24 steps leave room for that (in 10, one run under CI's load added only three requests)."""
    from engine.guided import snapshot
    out = tmp_path / "h.json"
    records = host_step.main(["--streams", "2", "--guided", "--max-tokens", "3", "--steps", "24", "--rounds", "1",
                              "--warmup-steps", "2", "--out", str(out)])
    (r,) = json.loads(out.read_text())
    assert r["guided"] and r["requests"] >= 4          # finished ones were replaced
    assert r["us"]["snapshot"] > 0 and r["us"]["push"] > 0 and r["us"]["snapshot"] <= r["us"]["plan"]
    assert "| snapshot | push |" in out.with_suffix(".md").read_text() and records[0]["max_tokens"] == 3
    import engine.llm_engine as llm_engine
    assert llm_engine.build_snapshot is snapshot.build_snapshot     # the timer put back a module's own function


def test_the_guided_load_takes_what_the_sampler_picks_from_zero_logits():
    """--guided replaces the sampler by each row's lowest allowed token: equal to the sampler's own pick under the
    same masks, rows allowing nothing (NO_TOKEN) and a word's top bit (a negative int32) included."""
    import torch
    from engine.sampling.sampler import sample
    gen, vocab, n = torch.Generator().manual_seed(0), 100, 6
    for _ in range(50):
        allowed = torch.rand(n, vocab, generator=gen) < 0.1 * torch.rand(n, 1, generator=gen)
        allowed[0], allowed[1, 31], allowed[1, :31] = False, True, False
        bits = torch.nn.functional.pad(allowed.long(), (0, 28)).view(n, 4, 32) << torch.arange(32)
        words = ((bits.sum(-1) + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)
        zeros = torch.zeros(n, dtype=torch.long)
        want = sample(torch.zeros(n, vocab), torch.zeros(n), zeros, torch.ones(n), zeros, zeros, bitmask=words,
                      all_greedy=True)
        assert torch.equal(guided_load.first_allowed(words), want)


def test_replayed_outputs_are_the_models_own(engine):
    """--replay: with the forward taken out, each request takes its prompt's recorded output token by token, so a
    generate under the replay gives the outputs the model wrote (EOS-ended ones end there, the rest at the budget)."""
    from contextlib import ExitStack
    work = guided_load.guided_work(engine, "tests/data/maskbench/JME_*.json", max_tokens=24)[:3]
    recorded = guided_load.record_outputs(engine, work)
    assert all(0 < len(out) <= 24 for out in recorded.values())
    program = engine.runner.program
    with ExitStack() as stack:
        guided_load.replayed_model(stack, engine, recorded)
        assert "sample" in vars(program)
        replayed = engine.generate([ids for ids, _ in work], [params for _, params in work])
    assert "sample" not in vars(program)                    # the model is back
    for (ids, _), seq in zip(work, replayed):
        assert seq.output_token_ids == recorded[tuple(ids)] and seq.finish_reason != "error"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        host_step.parse_args(["--rounds", "0"])
    with pytest.raises(ValueError, match="--prompt-tokens"):
        host_step.parse_args(["--prompt-tokens", "-1"])
    with pytest.raises(ValueError, match="--profile"):
        host_step.parse_args(["--profile", "-1"])
    with pytest.raises(ValueError, match="--guided"):
        host_step.parse_args(["--guided", "--prompt-tokens", "10"])
    with pytest.raises(ValueError, match="--guided runs"):
        host_step.parse_args(["--replay"])
    with pytest.raises(ValueError, match="give one"):
        host_step.parse_args(["--guided", "--replay", "--real-model"])
