"""bench.step.roofline on the CPU: the floor against hand-counted shapes and the built model, the peak-bandwidth table,
the arguments' errors, and one tiny run that writes its JSON, table and heat map (the torch backend)."""
import importlib.util
import json

import pytest

from bench.step import roofline
from bench.step.roofline_floor import floor_bytes, kv_bytes, param_count, peak_gbps, weight_params
from engine.models.loader import DUMMY_SHAPES, resolve_model


def config(shape: str, **changes) -> dict:
    return dict(resolve_model(f"dummy:{shape}").config, **changes)


def test_floor_of_smollm2_135m():
    cfg = config("smollm2-135m")            # tied: the head is the embedding
    layer = 576 * (576 + 2 * 3 * 64) + 576 * 576 + 3 * 576 * 1536 + 2 * 576
    assert weight_params(cfg) == 30 * layer + 576 + 49152 * 576 == 134_515_008
    assert param_count(cfg) == 134_515_008
    assert kv_bytes(cfg, 8, 2048, 2) == 8 * 30 * 2048 * 2 * 3 * 64 * 2 == 377_487_360
    assert floor_bytes(cfg, 8, 2048, 2) == 2 * 134_515_008 + 377_487_360


def test_floor_of_llama_1b_and_8b():
    cfg = config("llama-1b")
    layer = 2048 * (2048 + 2 * 8 * 64) + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    assert weight_params(cfg) == 16 * layer + 2048 + 128256 * 2048 == 1_235_814_400
    assert kv_bytes(cfg, 32, 2048, 2) == 32 * 16 * 2048 * 2 * 8 * 64 * 2 == 2 << 30
    # the 32-stream, 2k-context cell's floor on an H200: ~0.962 ms
    assert 1e3 * floor_bytes(cfg, 32, 2048, 2) / 4800e9 == pytest.approx(0.96231, abs=1e-5)
    cfg8 = config("llama-8b")               # untied: the head counts, the embedding does not
    assert weight_params(cfg8) == 7_504_924_672
    assert param_count(cfg8) == 7_504_924_672 + 128256 * 4096 == 8_030_261_248


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_floor_counts_what_the_built_model_holds(model_type, tied):
    """Every parameter but an untied embedding: Qwen2's QKV bias and Qwen3's q/k norms too."""
    import torch
    from bench.step.throughput import step_weight_bytes
    from engine.models.llama import LlamaForCausalLM
    cfg = config("tiny", model_type=model_type, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert weight_params(cfg) * 4 == step_weight_bytes(model)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_peak_bandwidth_by_gpu_name():
    assert peak_gbps("NVIDIA H200") == 4800
    assert peak_gbps("NVIDIA H100 80GB HBM3") == 3350
    assert peak_gbps("NVIDIA H100 PCIe") == 2000
    assert peak_gbps("NVIDIA A100-SXM4-80GB") == 2039
    assert peak_gbps("NVIDIA A100-SXM4-40GB") == 1555
    assert peak_gbps("NVIDIA GH200 480GB", override=4000.0) == 4000
    with pytest.raises(ValueError, match="'NVIDIA GH200 480GB'.*give --peak-gbps"):
        peak_gbps("NVIDIA GH200 480GB")


def test_arguments_and_their_errors(capsys):
    args = roofline.parse_args([])
    assert args.shapes and set(args.shapes) <= set(DUMMY_SHAPES) and "llama-1b" in args.shapes
    assert args.streams == [1, 2, 4, 8, 16, 32, 64, 128] and args.contexts == [256, 2048]
    assert args.kernels == ["auto", "reference"] and args.max_num_seqs == 128
    with pytest.raises(SystemExit):
        roofline.parse_args(["--shapes", "llama-1b", "llama-70b"])
    err = capsys.readouterr().err
    assert "llama-70b" in err and "known: " in err and "llama-1b" in err and "tiny" in err
    for bad, says in ((["--contexts", "8"], "--contexts must be >= 16"), (["--streams", "0"], "--streams"),
                      (["--streams", "64", "--max-num-seqs", "32"], "below the largest --streams"),
                      (["--peak-gbps", "0"], "--peak-gbps must be > 0"), (["--kernels", "fast"], "invalid choice")):
        with pytest.raises(SystemExit):
            roofline.parse_args(bad)
        assert says in capsys.readouterr().err


def test_an_unknown_gpu_needs_peak_gbps(monkeypatch, tmp_path):
    monkeypatch.setattr(roofline, "device_name", lambda: "NVIDIA B300")
    with pytest.raises(SystemExit, match="no peak bandwidth known for 'NVIDIA B300'.*give --peak-gbps"):
        roofline.main(["--shapes", "tiny", "--out", str(tmp_path)])
    assert not (tmp_path / "roofline.json").exists()     # it stopped before any engine


def test_cells_alternate_the_sides_by_shape_and_prompts_centre_the_context():
    args = roofline.parse_args(["--shapes", "tiny", "smollm2-tiny", "--streams", "2", "1", "--contexts", "16"])
    assert [c[:3] for c in roofline.cells(args)] == [
        ("tiny", "auto", 1), ("tiny", "auto", 2), ("tiny", "reference", 1), ("tiny", "reference", 2),
        ("smollm2-tiny", "reference", 1), ("smollm2-tiny", "reference", 2),
        ("smollm2-tiny", "auto", 1), ("smollm2-tiny", "auto", 2)]
    # 128 streams of 2,048 tokens prefill in ~137 steps of 2,048; the steady steps read 2,048 a stream on average
    assert roofline.cell_tokens(128, 2048, 32, 2048) == (2048 - 85, 137 + 33)
    trace = [dict(decode=False, rows=2, tokens=1), dict(decode=False, rows=2, tokens=2),
             *[dict(decode=True, rows=2, tokens=2)] * 3, dict(decode=True, rows=1, tokens=1)]
    # steady steps 2-4 read the prompt and 1.5, 2.5, 3.5 tokens sampled a stream
    assert roofline.steady_kv_tokens(trace, 2, 100) == pytest.approx(102.5)


def test_a_tiny_run_writes_its_cells_table_and_heat_map(tmp_path):
    argv = ["--device", "cpu", "--dtype", "float32", "--peak-gbps", "50", "--shapes", "tiny", "--streams", "1", "2",
            "--contexts", "16", "--steps", "4", "--out", str(tmp_path)]
    roofline.main(argv)
    cells = json.loads((tmp_path / "roofline.json").read_text())
    assert sorted((c["kernels"], c["streams"], c["context"]) for c in cells) == [
        ("auto", 1, 16), ("auto", 2, 16), ("reference", 1, 16), ("reference", 2, 16)]
    for c in cells:
        assert not c.get("error") and not c.get("skipped"), c
        assert c["steady_steps"] >= 4 and c["period_ms"] > 0 and c["ms_per_step"] == c["period_ms"], c
        assert c["tok_s"] == pytest.approx(c["streams"] / (c["period_ms"] * 1e-3))
        assert c["kv_tokens"] == pytest.approx(16, abs=2), c
        assert c["floor_bytes"] == floor_bytes(config("tiny"), c["streams"], c["kv_tokens"], 4)
        assert c["x_floor"] == pytest.approx(c["period_ms"] / c["floor_ms"])
        assert "routes" in c and c["routes"] is None        # the CPU backend runs torch's matmuls: no table
    md = (tmp_path / "roofline.md").read_text()
    assert "| shape | streams | context | step ms (auto) | step ms (reference) | auto/ref |" in md
    assert "Targets:" in md and "no cell more than 2% slower" in md and "not measured" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "roofline.png").stat().st_size > 0
    roofline.main(argv + ["--resume"])      # every cell is there: no engine starts, the cells stay
    assert json.loads((tmp_path / "roofline.json").read_text()) == cells
