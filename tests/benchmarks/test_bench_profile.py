"""bench/step/profile_step.py: the per-kind and per-kernel summary of a trace, and a CPU run of the speculative step
(host phases only: the kernel tables need CUDA)."""
import json
from types import SimpleNamespace as NS

import pytest
import torch

import bench.step.profile_step as profile_step
from bench.kernels.kernel_trace import busy_fraction, kernel_summary, kernels_by_grid
from bench.step.profile_step import main
from conftest import triton_module


def _event(name, start, end):
    return NS(name=name, time_range=NS(start=start, end=end))


def test_kernel_summary_by_kind_and_by_name():
    events = [_event("nvjet_tst_64x8_gemm", 0, 4), _event("_paged_attn_kernel", 4, 7),
              _event("nvjet_tst_64x8_gemm", 9, 13), _event("_rms_norm_kernel", 13, 14)]
    s = kernel_summary(events, steps=2, top=2)
    assert s["kernels"] == 2 and s["kernel_us"] == pytest.approx(6.0)
    assert s["kinds"]["matmul"] == dict(per_step=1.0, us_per_step=4.0, path_us_per_step=4.0)
    assert s["kinds"]["attention"]["us_per_step"] == pytest.approx(1.5)
    assert list(s["top_kernels"]) == ["nvjet_tst_64x8_gemm", "_paged_attn_kernel"]
    assert s["busy_frac"] == pytest.approx(12 / 14) == busy_fraction(events)


def test_path_time_counts_what_a_kernel_adds_to_the_latest_end():
    """Dependent launch: B starts 1 us before A ends and holds 2 us of the path, not its 3; C ends with A (0);
    D starts after a gap (its whole duration). The path times sum to the busy time."""
    events = [_event("A", 0, 4), _event("B", 3, 6), _event("C", 1, 4), _event("D", 8, 9)]
    s = kernel_summary(events, steps=1, top=4)
    path = {k: v["path_us_per_step"] for k, v in s["top_kernels"].items()}
    assert path == dict(A=4.0, B=2.0, D=1.0, C=0.0) and list(path) == ["A", "B", "D", "C"]
    assert sum(path.values()) == pytest.approx(busy_fraction(events) * 9)


def test_kernels_by_grid_keeps_each_launch_shape_apart():
    """--by-grid: the exported trace's kernels keyed by name and grid (one GEMV kernel, two matmul shapes), other
    trace events left out, path times as kernel_summary's."""
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "_decode_gemv_kernel", "ts": 0.0, "dur": 4.0, "args": {"grid": [768, 1, 1]}},
        {"cat": "kernel", "name": "_decode_gemv_kernel", "ts": 4.0, "dur": 2.0, "args": {"grid": [512, 1, 1]}},
        {"cat": "kernel", "name": "_decode_gemv_kernel", "ts": 6.0, "dur": 4.0, "args": {"grid": [768, 1, 1]}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 10.0}]}

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump(trace, f)

    rows = kernels_by_grid(Prof(), steps=2, top=5)
    assert list(rows) == ["_decode_gemv_kernel grid=(768, 1, 1)", "_decode_gemv_kernel grid=(512, 1, 1)"]
    assert rows["_decode_gemv_kernel grid=(768, 1, 1)"] == dict(per_step=1.0, us_per_step=4.0, path_us_per_step=4.0)


def test_variants_alternate_by_round_and_a_cut_run_resumes(tmp_path, monkeypatch):
    """--variants / --rounds: each stream count's variants in order, reversed in odd rounds, every record saved as
    it lands; --resume runs only what --out lacks; the summary gives each variant's period over the first's."""
    calls = []

    def fake(args, streams, overrides=None):
        calls.append((streams, dict(overrides)))
        off = overrides.get("kernels") == "reference"
        return dict(streams=streams, period_ms=2.0 if off else 1.0, path_us=900.0 if off else 600.0,
                    forward_gpu_ms=0.5, command="x", device="cpu", git_commit="c")

    monkeypatch.setattr(profile_step, "profile", fake)
    out = tmp_path / "p.json"
    argv = ["--streams", "1", "4", "--rounds", "2", "--variants", "on:", "off:kernels=reference", "--out", str(out)]
    main(argv)
    assert [(n, o.get("kernels", "on")) for n, o in calls] == [(1, "on"), (1, "reference"), (1, "reference"), (1, "on"),
                                                              (4, "on"), (4, "reference"), (4, "reference"), (4, "on")]
    records = json.loads(out.read_text())
    assert [(r["variant"], r["round"]) for r in records[:4]] == [("on", 0), ("off", 0), ("off", 1), ("on", 1)]
    out.write_text(json.dumps(records[:5]))                 # a run cut after its fifth profile
    calls.clear()
    main(argv + ["--resume"])
    assert calls == [(4, {"kernels": "reference"}), (4, {"kernels": "reference"}), (4, {})]
    summary = profile_step.variant_summary(json.loads(out.read_text()))
    assert [(r["streams"], r["variant"], r["rounds"], r["x_first"], r["path_x_first"]) for r in summary] == [
        (1, "on", 2, 1.0, 1.0), (1, "off", 2, 2.0, 1.5), (4, "on", 2, 1.0, 1.0), (4, "off", 2, 2.0, 1.5)]
    assert "| path_x_first |" in out.with_suffix(".md").read_text()


def test_render_rewrites_the_markdown_and_sums_the_path_of_older_records(tmp_path):
    """--render profiles nothing: it rewrites --out's markdown from its JSON, a record without path_us taking the
    sum of its kinds' critical paths."""
    kinds = {"matmul": dict(per_step=4, us_per_step=50.0, path_us_per_step=30.0),
             "attention": dict(per_step=2, us_per_step=20.0, path_us_per_step=12.5)}
    records = [dict(streams=1, variant=v, round=0, period_ms=p, forward_gpu_ms=0.4, kinds=kinds, top_kernels={},
                    command="x", device="cpu", git_commit="c") for v, p in (("a", 0.5), ("b", 0.6))]
    records[1]["path_us"] = 63.75
    out = tmp_path / "p.json"
    out.write_text(json.dumps(records))
    main(["--render", "--out", str(out)])
    text = out.with_suffix(".md").read_text()
    assert "| 1 | b | 1 | 0.600 | 0.400 | 0.064 | 1.20 | 1.50 |" in text, text
    assert json.loads(out.read_text()) == records


def test_context_lengthens_every_prompt_and_its_prefill_precedes_the_timed_steps(tmp_path):
    out = tmp_path / "p.json"
    main(["--device", "cpu", "--dtype", "float32", "--streams", "2", "--steps", "2", "--warmup-steps", "0",
          "--context", "300", "--engine", "max_num_batched_tokens=128", "--out", str(out)])
    (rec,) = json.loads(out.read_text())
    assert 300 <= rec["prompt_tokens"] < 340, rec["prompt_tokens"]
    assert rec["tokens_per_step"] == 2.0        # the prefill chunks went before the window: every step decoded both


def test_profile_of_the_speculative_step_on_the_cpu(tmp_path):
    out = tmp_path / "p.json"
    main(["--device", "cpu", "--dtype", "float32", "--streams", "1", "--steps", "2", "--warmup-steps", "1",
          "--tag", "eagle", "--engine", "speculative=eagle", "num_speculative_tokens=2", "spec_min_acceptance=0",
          "--out", str(out)])
    (rec,) = json.loads(out.read_text())
    assert rec["tag"] == "eagle" and rec["streams"] == 1 and rec["period_ms"] > 0
    assert rec["engine"] == dict(speculative="eagle", num_speculative_tokens=2, spec_min_acceptance=0)
    assert out.with_suffix(".md").read_text().count("| eagle |") == 1


def test_variant_keys_set_decode_gemms_launch_config_for_the_weights_named():
    """gemm.N.KEY and gemm.NxK.KEY keys of a variant are decode_gemm_config's, not EngineConfig's: inside
    kernel_configs a launch for a weight of N rows (of K) takes them (the argmax epilogue's partials show the
    programs), other weights the rule, and the rule is back afterwards."""
    gm = triton_module("matmul.decode_gemm")
    engine, gemm = profile_step.split_kernel_keys({"gemm.64.BLOCK_N": 16, "gemm.64.num_warps": 8, "depth": 2})
    assert engine == {"depth": 2} and gemm == {64: {"BLOCK_N": 16, "num_warps": 8}}
    assert profile_step.split_kernel_keys({"gemm.64x128.BLOCK_N": 32})[1] == {(64, 128): {"BLOCK_N": 32}}
    for bad in ("gemm.BLOCK_N", "gemm.x.BLOCK_N", "gemm.64.", "gemm.64x.BLOCK_N", "gemm.1x2x3.BLOCK_N"):
        with pytest.raises(ValueError, match="gemm.<weight rows>"):
            profile_step.split_kernel_keys({bad: 1})
    dev = "cpu" if gm.interpreted() else "cuda"
    x, w = torch.randn(8, 64, device=dev), torch.randn(64, 64, device=dev)
    rule = gm.decode_gemm_config
    assert rule(8, 64, 64)["BLOCK_N"] == 16
    with profile_step.kernel_configs({64: {"BLOCK_N": 32}}):
        assert gm.decode_gemm_config(8, 64, 64) == rule(8, 64, 64) | {"BLOCK_N": 32}
        assert gm.decode_gemm_config(8, 32, 64) == rule(8, 32, 64)
        assert gm.launch(x, w, 64, "none", epilogue="argmax")[0].shape == (8, 2)
        assert torch.allclose(gm.decode_linear(x, w), x @ w.T, atol=1e-3)
    with profile_step.kernel_configs({(64, 128): {"BLOCK_N": 32}, 64: {"BLOCK_N": 64, "num_warps": 8}}):
        assert gm.decode_gemm_config(8, 64, 128) == rule(8, 64, 128) | {"BLOCK_N": 32, "num_warps": 8}
        assert gm.decode_gemm_config(8, 64, 64) == rule(8, 64, 64) | {"BLOCK_N": 64, "num_warps": 8}
    assert gm.decode_gemm_config is rule
    assert gm.launch(x, w, 64, "none", epilogue="argmax")[0].shape == (8, 4)


def test_variant_keys_set_head_mmas_launch_config():
    """head.KEY keys are head_mma's head_config (its partials show the programs), and the rule is back after."""
    hm = triton_module("matmul.head_mma")
    engine, over = profile_step.split_kernel_keys({"head.BLOCK_V": 64, "head.num_warps": 8, "depth": 2})
    assert engine == {"depth": 2} and over == {"head": {"BLOCK_V": 64, "num_warps": 8}}
    dev = "cpu" if hm.interpreted() else "cuda"
    x, w = torch.randn(8, 64, device=dev), torch.randn(300, 64, device=dev)
    rule = hm.head_config
    with profile_step.kernel_configs(over):
        assert hm.head_config(8, 300, 64) == rule(8, 300, 64) | over["head"]
        assert hm.partials(x, w)[0].shape == (8, 5)
    assert hm.head_config is rule and hm.partials(x, w)[0].shape == (8, 3)
