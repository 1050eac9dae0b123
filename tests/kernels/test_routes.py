"""The route table (engine/kernels/routes.py) and its measurement (engine/kernels/tune.py): pins and their
errors, lookups by rows, the tuner's choice from given timings, the cache's key and how a damaged or stale file is
measured again, and that every route gives the reference's results in float32 (interpreter here, CUDA there)."""
import json
import warnings

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import route_cache, tune
from engine.kernels.timer import Timer
from engine.kernels.routes import Pin, RouteTable, Site, load_pins, parse_pins, pins
from engine.llm_engine import LLMEngine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- pins and lookups ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry,why", [
    (dict(kernel="fast"), "unknown kernel"), (dict(kernel="gemv", op="conv"), "unknown op"),
    (dict(kernel="gemm", op="head"), "cannot run 'head'"), (dict(kernel="mma", op="linear"), "cannot run"),
    (dict(kernel="gemm"), "name the op"), (dict(kernel="gemv", rows=[4, 2]), "rows must be"),
    (dict(kernel="gemv", rows=0), "rows must be"), (dict(kernel="gemv", n=-1), "n must be"),
    (dict(kernel="gemv", width=3), "unknown field"), (dict(kernel="persistent"), "name the op"),
    (dict(kernel="gemv", op="stack"), "cannot run 'stack'"), (dict(kernel="persistent", op="linear"), "cannot run"),
    (dict(kernel="stream_wide"), "name the op"), (dict(kernel="stream_narrow", op="head"), "cannot run 'head'"),
    (dict(kernel="stream_wide", op="linear"), "cannot run 'linear'"),
    (dict(kernel="stream_narrow", op="norm_linear_silu"), "cannot run 'norm_linear_silu'"),
])
def test_a_bad_pin_is_refused_naming_it(entry, why):
    with pytest.raises(ValueError, match=why):
        parse_pins({"pins": [entry]})


def test_a_route_file_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_pins(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_pins(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="holds"):
        load_pins('{"routes": []}')
    (tmp_path / "ok.json").write_text(pins(dict(kernel="cublas", op="linear", n=64, k=32, rows=[1, 4]),
                                           dict(kernel="stream_wide", op="norm_linear_silu")))
    assert load_pins(str(tmp_path / "ok.json")) == (Pin("cublas", "linear", 64, 32, (1, 4)),
                                                    Pin("stream_wide", "norm_linear_silu"))


def test_lookup_takes_the_cell_of_the_next_larger_rows_and_cublas_past_the_table():
    table = RouteTable({("linear", 64, 32): {1: "gemv", 2: "gemv", 4: "gemm", 8: "gemm", 16: "cublas"}})
    got = [table.lookup("linear", 64, 32, r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 200)]
    assert got == ["gemv", "gemv", "gemm", "gemm", "gemm", "gemm", "cublas", "cublas", "cublas", "cublas"]
    assert table.lookup("linear", 64, 64, 1) == "cublas"              # a matmul the table does not hold
    assert table.summary() == "linear 64x32: gemv 1-2, gemm 4-8, cublas 16"


def test_pins_override_the_table_the_later_one_winning():
    cells = {("linear", 64, 32): {1: "gemv", 4: "gemm"}, ("head", 100, 32): {1: "mma"}}
    table = RouteTable(cells, pins=(Pin("cublas", op="linear"), Pin("gemm", op="linear", rows=(3, 4))))
    assert [table.lookup("linear", 64, 32, r) for r in (1, 3, 4)] == ["cublas", "gemm", "gemm"]
    assert table.lookup("head", 100, 32, 1) == "mma"
    assert RouteTable(cells, reference=True).lookup("head", 100, 32, 1) == "cublas"


def test_the_stack_runs_layer_by_layer_unless_a_pin_says_persistent():
    """A pin of every op (no op named) routes the matmuls, not the stack; reference mode runs it layer by layer."""
    assert RouteTable().lookup("stack", 64, 96, 1) == "layers"
    table = RouteTable(pins=(Pin("persistent", op="stack", rows=(1, 2)), Pin("cublas")))
    assert [table.lookup("stack", 64, 96, r) for r in (1, 2, 3)] == ["persistent", "persistent", "layers"]
    assert table.lookup("linear", 64, 32, 1) == "cublas"
    assert RouteTable(pins=table.pins, reference=True).lookup("stack", 64, 96, 1) == "layers"


def test_a_stack_pin_for_a_model_it_cannot_run_is_refused_at_start():
    from engine.models.llama import LlamaForCausalLM
    from engine.models.loader import DUMMY_SHAPES
    from engine.runner.kernel_routes import decode_stack
    model = LlamaForCausalLM(dict(DUMMY_SHAPES["tiny"], model_type="qwen3", rms_norm_eps=1e-6))
    pinned = RouteTable(pins=(Pin("persistent", op="stack"),))
    with pytest.raises(ValueError, match="persistent decode stack cannot run this model: QK norm"):
        decode_stack(model, [], pinned)
    assert decode_stack(model, [], RouteTable()) is None


# ---- the tuner ----------------------------------------------------------------------------------------------------
class GivenTimes:
    """A timer whose timings are given: (op, rows, kernel) -> us."""

    def __init__(self, times, wrong=()):
        self.times, self.calls, self.wrong = times, [], set(wrong)

    def candidates(self, site, rows):
        return [kernel for (op, r, kernel) in self.times if op == site.op and r == rows]

    def agrees(self, site, rows, kernel, decode):
        return (site.op, rows, kernel) not in self.wrong

    def time_us(self, site, rows, kernel, decode):
        self.calls.append((site.op, rows, kernel, decode))
        return self.times[(site.op, rows, kernel)]


def _site(op, n=64, k=32):
    return Site(op, [torch.empty(n, k)])


def test_the_tuner_routes_each_cell_to_its_fastest_kernel_cublas_on_a_tie():
    timer = GivenTimes({("linear", 1, "gemv"): 3.0, ("linear", 1, "gemm"): 4.0, ("linear", 1, "cublas"): 9.0,
                        ("linear", 8, "gemm"): 5.0, ("linear", 8, "cublas"): 5.0,
                        ("head", 1, "mma"): 7.0, ("head", 1, "cublas"): 6.0, ("head", 8, "cublas"): 8.0})
    cells, timed = tune.measure([_site("linear"), _site("head", 100)], [1, 8], {1}, timer, progress=False)
    assert timed == 4
    table = tune.table_from_cells(cells)
    assert table.cells() == {("linear", 64, 32): {1: "gemv", 8: "cublas"},
                             ("head", 100, 32): {1: "cublas", 8: "cublas"}}
    assert cells["linear 64 32 1"]["us"] == {"gemv": 3.0, "gemm": 4.0, "cublas": 9.0}
    assert ("linear", 1, "gemv", True) in timer.calls and ("linear", 8, "gemm", False) in timer.calls  # decode rows


def test_a_kernel_that_disagrees_with_cublas_is_not_timed_nor_routed():
    timer = GivenTimes({("linear", 4, "gemv"): 1.0, ("linear", 4, "stream"): 2.0, ("linear", 4, "cublas"): 9.0},
                       wrong={("linear", 4, "gemv")})
    with pytest.warns(UserWarning, match="gemv disagrees with cuBLAS on linear"):
        cells, _ = tune.measure([_site("linear")], [4], set(), timer, progress=False)
    assert cells["linear 64 32 4"] == {"kernel": "stream", "us": {"stream": 2.0, "cublas": 9.0}}
    assert ("linear", 4, "gemv", False) not in timer.calls


def test_a_kernel_that_lost_by_over_drop_is_not_timed_at_more_rows():
    """gemv lost 3x at 2 rows: 4 and 8 rows do not time it (nor compile it); gemm, 1.5x, is timed on; cuBLAS,
    the fallback, is always timed, however far behind."""
    times = {("linear", r, kernel): us for r in (2, 4, 8) for kernel, us in
             (("gemv", 9.0), ("gemm", 4.5), ("stream", 3.0), ("cublas", 10.0))}
    timer = GivenTimes(times)
    cells, timed = tune.measure([_site("linear")], [2, 4, 8], {2, 4, 8}, timer, progress=False)
    assert timed == 3
    assert [r for (_, r, kernel, _) in timer.calls if kernel == "gemv"] == [2]
    assert [r for (_, r, kernel, _) in timer.calls if kernel in ("gemm", "cublas")] == [2, 2, 4, 4, 8, 8]
    assert cells["linear 64 32 8"] == {"kernel": "stream", "us": {"gemm": 4.5, "stream": 3.0, "cublas": 10.0}}


def test_each_row_count_is_prepared_at_once_before_its_timings_without_dropped_kernels():
    """A timer with `prepare` (the GPU's: it compiles a row count's kernels side by side) gets every site's
    candidates at one row count, before any of that count's timings, less the kernels dropped at fewer rows and
    cells cuBLAS alone can run."""
    class Preparing(GivenTimes):
        def prepare(self, calls):
            self.calls.append(("prepare", sorted((site.op, *rest) for site, *rest in calls)))
    times = {(op, r, kernel): us for op in ("linear", "norm_linear") for r in (2, 4) for kernel, us in
             (("gemv", 9.0), ("stream", 3.0), ("cublas", 10.0))}
    times[("head", 2, "cublas")] = 5.0
    timer = Preparing(times)
    tune.measure([_site("linear"), _site("norm_linear"), _site("head", 100)], [2, 4], {2}, timer, progress=False)
    prepares = [i for i, c in enumerate(timer.calls) if c[0] == "prepare"]
    assert prepares == [0, 7]       # six timings at 2 rows (the head's lone cuBLAS untimed), then 4 rows'
    assert timer.calls[0][1] == sorted((op, 2, kernel, True) for op in ("linear", "norm_linear")
                                       for kernel in ("gemv", "stream", "cublas"))
    assert timer.calls[7][1] == sorted((op, 4, kernel, False) for op in ("linear", "norm_linear")
                                       for kernel in ("stream", "cublas"))


def test_cached_cells_are_not_measured_again_and_one_site_a_shape_is():
    timer = GivenTimes({("linear", 1, "gemv"): 3.0, ("linear", 1, "cublas"): 9.0})
    cached = {"linear 64 32 1": {"kernel": "cublas", "us": {}}}
    cells, timed = tune.measure([_site("linear"), _site("linear")], [1], {1}, timer, cached, progress=False)
    assert timed == 0 and timer.calls == [] and cells == cached
    cells, timed = tune.measure([_site("linear"), _site("linear")], [1], {1}, timer, progress=False)
    assert timed == 1 and cells["linear 64 32 1"]["kernel"] == "gemv"


def test_pinned_cells_are_not_measured():
    """A pin decides its cells whatever they measure: the tuner times only the others (a test pinning cuBLAS
    everywhere starts with no tuning at all)."""
    timer = GivenTimes({("linear", r, k): 1.0 for r in (1, 8) for k in ("gemv", "cublas")})
    pinned = lambda op, n, k, rows: rows == 1      # noqa: E731
    cells, timed = tune.measure([_site("linear")], [1, 8], {1}, timer, progress=False, pinned=pinned)
    assert timed == 1 and set(cells) == {"linear 64 32 8"} and {c[1] for c in timer.calls} == {8}


class LayerTimes(GivenTimes):
    """Given times alone, and inside the layer a cost for each (op, kernel) the layer runs on."""

    def __init__(self, times, in_layer):
        super().__init__(times)
        self.in_layer, self.layer_calls = in_layer, []

    def time_layer_us(self, group, rows, choice, decode):
        self.layer_calls.append(dict(choice))
        return sum(self.in_layer[(site.op, choice[site.key])] for site in group)


def test_near_ties_alone_are_decided_inside_the_layer_and_clear_wins_are_not_timed_again():
    layer = [Site("norm_linear", [torch.empty(96, 32)] * 2), Site("linear", [torch.empty(32, 32)] * 2)]
    timer = LayerTimes({("norm_linear", 4, "gemv"): 2.6, ("norm_linear", 4, "gemm"): 2.7,
                        ("norm_linear", 4, "cublas"): 9.0, ("linear", 4, "gemv"): 2.0,
                        ("linear", 4, "gemm"): 5.0, ("linear", 4, "cublas"): 6.0},
                       {("norm_linear", "gemv"): 3.0, ("norm_linear", "gemm"): 2.5, ("linear", "gemv"): 1.0})
    cells, _ = tune.measure(layer, [4], {4}, timer, progress=False)
    assert cells["norm_linear 96 32 4"]["kernel"] == "gemm"              # slower alone, faster in its layer
    assert cells["norm_linear 96 32 4"]["layer_us"] == {"gemv": 4.0, "gemm": 3.5}
    assert cells["linear 32 32 4"]["kernel"] == "gemv" and "layer_us" not in cells["linear 32 32 4"]
    assert all(choice[("linear", 32, 32)] == "gemv" for choice in timer.layer_calls)
    assert len(timer.layer_calls) == 2


def test_a_layer_with_only_its_last_op_to_measure_is_still_refined():
    """Cells of a layer's first ops cached (a model sharing their shapes ran before), its last op new: the layer is
    timed again around it. Two ops of one kind and different shapes must not be told apart by their weights."""
    layer = [Site("norm_linear", [torch.empty(96, 32)] * 2), Site("linear", [torch.empty(32, 32)] * 2),
             Site("linear", [torch.empty(32, 64)] * 2)]
    cached = {"norm_linear 96 32 4": {"kernel": "gemv", "us": {"gemv": 2.6, "cublas": 9.0}},
              "linear 32 32 4": {"kernel": "gemv", "us": {"gemv": 2.0, "cublas": 6.0}}}
    timer = LayerTimes({("linear", 4, "gemv"): 2.0, ("linear", 4, "gemm"): 2.1, ("linear", 4, "cublas"): 6.0},
                       {("norm_linear", "gemv"): 3.0, ("linear", "gemv"): 2.0, ("linear", "gemm"): 1.0})
    cells, timed = tune.measure(layer, [4], {4}, timer, cached, progress=False)
    assert timed == 1 and timer.layer_calls          # the new cell, then the layer around it
    assert cells["linear 32 64 4"]["kernel"] == "gemm" and "layer_us" in cells["linear 32 64 4"]


def test_a_layer_wholly_on_one_kernel_wins_where_its_overlap_beats_the_mixed_choice():
    """stream is a little slower alone on both ops and on either one inside a layer of cuBLAS, but the layer wholly
    on stream is faster (its launches overlap): the tuner times that layer and routes both ops to stream."""
    layer = [Site("norm_linear", [torch.empty(96, 32)] * 2), Site("linear", [torch.empty(32, 32)] * 2)]
    alone = {("norm_linear", 8, "stream"): 10.5, ("norm_linear", 8, "cublas"): 10.0,
             ("linear", 8, "stream"): 6.2, ("linear", 8, "cublas"): 6.0}

    class Overlap(LayerTimes):
        def time_layer_us(self, group, rows, choice, decode):
            self.layer_calls.append(dict(choice))
            kernels = {choice[site.key] for site in group}
            return 12.0 if kernels == {"stream"} else 16.0 + 0.5 * (kernels == {"stream", "cublas"})

    timer = Overlap(alone, {})
    cells, _ = tune.measure(layer, [8], {8}, timer, progress=False)
    assert {cells[name]["kernel"] for name in ("norm_linear 96 32 8", "linear 32 32 8")} == {"stream"}
    assert cells["linear 32 32 8"]["whole_layer_us"] == {"stream": 12.0, "mixed": 16.0}
    assert len(timer.layer_calls) == len({tuple(sorted(c.items())) for c in timer.layer_calls})   # each once
    slower = Overlap({**alone, ("linear", 8, "stream"): 9.0}, {})      # not near on one op: the layer is not tried
    cells, _ = tune.measure(layer, [8], {8}, slower, progress=False)
    assert cells["linear 32 32 8"]["kernel"] == "cublas" and "whole_layer_us" not in cells["linear 32 32 8"]


def test_the_rows_measured_are_the_captured_ones_up_to_the_kernels_limit():
    assert tune.tuning_rows([1, 2, 4, 8, 16, 24, 32, 40, 64, 128, 256], [4, 8, 16, 32, 64, 96]) == \
        [1, 2, 4, 8, 16, 24, 32, 40, 64]


# ---- the cache ----------------------------------------------------------------------------------------------------
FP = dict(format=1, gpu="NVIDIA H200", capability="9.0", driver=13000, torch="2.11", triton="3.6", dtype="bfloat16",
          kernels="abc")


def test_the_cache_key_changes_with_every_part_of_the_fingerprint(tmp_path):
    paths = {route_cache.cache_path(tmp_path, {**FP, name: "other"}) for name in FP}
    assert len(paths) == len(FP) and route_cache.cache_path(tmp_path, FP) not in paths
    cells = {"linear 64 32 1": {"kernel": "gemv", "us": {"gemv": 1.0}}}
    route_cache.save_cache(route_cache.cache_path(tmp_path, FP), FP, cells)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert route_cache.load_cache(route_cache.cache_path(tmp_path, FP), FP) == cells


def test_the_fingerprint_digests_every_routed_matmul_kernel_source():
    """A change to any matmul kernel's source measures its routes again (cpu_gemm is the CPU's, never routed)."""
    from pathlib import Path
    matmul = Path(route_cache.__file__).parent / "matmul"
    sources = {f"matmul/{f.name}" for f in matmul.glob("*.py")} - {"matmul/__init__.py", "matmul/cpu_gemm.py"}
    assert sources <= set(route_cache._KERNEL_SOURCES)


@pytest.mark.parametrize("content", [
    "{damaged", json.dumps({"fingerprint": {**FP, "triton": "3.5"}, "cells": {}}),
    json.dumps({"fingerprint": FP, "cells": {"linear 64 32 1": {"kernel": "mma"}}}),
    json.dumps({"fingerprint": FP, "cells": {"linear 64 x 1": {"kernel": "gemv"}}}),
    json.dumps({"fingerprint": FP}), json.dumps([1, 2]),
])
def test_a_damaged_or_stale_cache_is_measured_again_with_a_warning(tmp_path, content):
    path = tmp_path / "routes.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="measuring again"):
        assert route_cache.load_cache(path, FP) == {}


# ---- the engine's options -----------------------------------------------------------------------------------------
def test_kernels_must_be_auto_or_reference_and_pins_need_auto():
    with pytest.raises(ValueError, match="unknown kernels 'fastest'"):
        EngineConfig(kernels="fastest")
    with pytest.raises(ValueError, match="kernel_routes pins routes of kernels='auto'"):
        EngineConfig(kernels="reference", kernel_routes=pins(dict(kernel="gemv")))


def test_the_cli_refuses_an_unknown_kernels_value(capsys):
    from engine.cli import main
    with pytest.raises(SystemExit):
        main(["generate", "--kernels", "fastest", "--prompt", "hi"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_a_route_file_naming_a_kernel_that_cannot_run_a_matmul_is_refused_at_start():
    """dummy:tiny's o_proj is 64 x 64: the GEMV takes 1-8 rows, not the 16 of a captured batch."""
    kw = dict(model="dummy:tiny", device=DEVICE, dtype="float32", attention_backend="triton", max_num_seqs=16,
              max_model_len=64, enforce_eager=True)
    with pytest.raises(ValueError, match=r"pin .*'rows': \(1, 16\).* -> 'gemv'.* cannot run linear 64x64 at 16 rows"):
        LLMEngine(**kw, kernel_routes=pins(dict(kernel="gemv", op="linear", rows=[1, 16])))
    with pytest.raises(ValueError, match="route file pin 0: unknown kernel 'gemv2'"):
        LLMEngine(**kw, kernel_routes=pins(dict(kernel="gemv")).replace('"gemv"', '"gemv2"'))


class Recording(RouteTable):
    """cuBLAS everywhere, remembering every (op, N, K) asked for."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def lookup(self, op, n, k, rows):
        self.asked.add((op, n, k))
        return super().lookup(op, n, k, rows)


@pytest.mark.parametrize("speculative", ["none", "eagle", "draft_model"])
def test_every_matmul_the_engine_routes_is_a_site_the_tuner_measures(speculative):
    """A matmul that route_sites() leaves out would never be measured: cuBLAS, whatever is faster."""
    from engine.requests.sequence import SamplingParams
    kw = dict(speculative=speculative, spec_head="random", spec_draft_model="dummy:tiny", num_speculative_tokens=2,
              spec_min_acceptance=0.0) if speculative != "none" else {}
    engine = LLMEngine(model="dummy:tiny", device=DEVICE, dtype="float32", attention_backend="triton",
                       max_num_seqs=4, max_model_len=64, enforce_eager=True, **kw)
    runner = engine.runner
    runner.backend.routes = recording = Recording()
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    sites = runner.model.route_sites() + (runner.program.drafter.route_sites() if runner.spec_k else [])
    assert recording.asked and recording.asked <= {s.key for s in sites}


# ---- every route gives the reference's results --------------------------------------------------------------------
def _call(backend, op, x, w, nw, residual):
    if op == "linear":
        return backend.linear(x, w)
    if op == "norm_linear":
        return backend.norm_linear(x, residual, nw, 1e-5, w)
    if op == "norm_linear_silu":
        return backend.norm_linear_silu(x, residual, nw, 1e-5, w)
    if op == "head":
        return backend.linear_argmax(x, w)
    return backend.norm_linear_argmax(x, nw, 1e-5, w)


@pytest.mark.parametrize("op,kernel", [(op, kernel) for op in ("linear", "norm_linear", "norm_linear_silu")
                                       for kernel in ("gemv", "gemm")] + [(op, kernel) for op in ("head", "norm_head")
                                                                          for kernel in ("gemv", "mma", "cublas")])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_route_matches_the_reference_in_float32(op, kernel, rows):
    from engine.backend import RoutedBackend
    torch.manual_seed(0)
    n, k = (96, 64) if op != "head" else (500, 64)
    w = torch.randn(n, k, device=DEVICE) * 0.2
    x, nw = torch.randn(rows, k, device=DEVICE), torch.rand(k, device=DEVICE) + 0.5
    residual = torch.randn(rows, k, device=DEVICE) if op.startswith("norm_linear") else None
    routed = RoutedBackend(routes=RouteTable.pinned(Pin(kernel, op=op)), device=DEVICE)
    assert routed.kernel_for(op, x, w, norm_weight=nw, residual=residual) == kernel
    reference = RoutedBackend(routes=RouteTable.pinned(Pin("cublas")), device=DEVICE)
    got, want = _call(routed, op, x, w, nw, residual), _call(reference, op, x, w, nw, residual)
    if op in ("head", "norm_head"):
        assert torch.equal(got, want)
        return
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- the GPU: a measured table, and its cache ---------------------------------------------------------------------
@pytest.mark.gpu
def test_a_gpu_start_measures_every_site_once_and_then_reads_the_cache(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    kw = dict(model="dummy:tiny", device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128)
    first = LLMEngine(**kw)
    sites = {s.key for s in first.runner.model.route_sites()}
    rows = [1, 2, 4, 8]
    assert set(first.runner.backend.routes.cells()) == sites
    assert all(sorted(cells) == rows for cells in first.runner.backend.routes.cells().values())
    assert "0 cells from" in capfd.readouterr().err
    del first
    second = LLMEngine(**kw)
    assert f"{len(sites) * len(rows)} cells from" in capfd.readouterr().err
    assert second.runner.backend.routes.cells()
    assert route_cache.fingerprint(torch.device("cuda"), torch.float32)["driver"] > 0     # a new driver measures again


@pytest.mark.gpu
def test_the_timer_checks_each_candidate_against_cublas():
    from engine.backend import RoutedBackend
    torch.manual_seed(0)
    w = [torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(2)]
    site = Site("linear", w)
    timer = Timer(torch.device("cuda"), lambda routes: RoutedBackend(routes=routes, device="cuda"))
    assert all(timer.agrees(site, 8, kernel, decode=True) for kernel in timer.candidates(site, 8))
    timer.backends["stream"].linear = lambda x, weight, meta=None, add=None: torch.zeros(
        x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)          # a kernel that computes wrong
    assert not timer.agrees(site, 8, "stream", decode=True)
