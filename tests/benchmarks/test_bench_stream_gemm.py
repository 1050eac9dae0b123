"""bench/kernels/stream_gemm.py's CPU parts: the layer sites it times are the model's own route sites, and its
launch overrides take effect and are put back (its timings need CUDA)."""
import torch

from bench.kernels import stream_gemm as bench
from engine.kernels.matmul import stream_gemm


def test_the_sites_it_times_are_the_models_matmuls():
    from engine.llm_engine import LLMEngine
    engine = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
                       enforce_eager=True)
    try:
        model_keys = {site.key for site in engine.runner.model.route_sites() if site.op != "head"}
    finally:
        engine.close()
    sites = bench.layer_sites("tiny", 2, torch.device("cpu"), torch.float32)
    assert {site.key for site in sites.values()} == model_keys
    assert all(len(site.weights) == 2 for site in sites.values())
    assert (sites["qkv"].norm_weight is not None and sites["gate_up"].norm_weight is not None
            and sites["o"].norm_weight is None)


def test_a_launch_override_takes_effect_and_is_put_back():
    own_config, own_l2 = stream_gemm.config, stream_gemm.l2_ahead
    with bench.stream_launch(config=dict(BLOCK_N=64, NUM_STAGES=2), l2_ahead=False):
        cfg = stream_gemm.config(8, 2048, 2048, 2, 2, 200 << 10)
        assert cfg["BLOCK_N"] == 64 and cfg["NUM_STAGES"] == 2 and cfg["BLOCK_M"] == 16
        assert stream_gemm.l2_ahead(stream_gemm._stream_gemm_kernel, torch.device("cuda")) is False
    assert stream_gemm.config is own_config and stream_gemm.l2_ahead is own_l2
    assert all(set(cfg) == {"BLOCK_N", "BLOCK_K", "NUM_STAGES", "num_warps"} for cfg in bench.SWEEP)
