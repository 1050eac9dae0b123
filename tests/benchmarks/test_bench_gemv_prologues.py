"""bench/kernels/gemv_prologues.py: the decode GEMV by prologue and launch config (timing needs CUDA; the configs and
the rendering do not)."""
import json

import pytest
import torch

from bench.kernels import gemv_prologues as gp


def test_shipped_config_is_the_engines_and_others_set_rows_and_warps():
    assert gp.config("shipped", 28672, 4096) == gp.decode_gemv.decode_gemv_config(28672, 4096)
    assert gp.config("shipped", 28672, 4096)["num_warps"] == 4
    assert gp.config("shipped", 4096, 14336)["num_warps"] == 8
    cfg = gp.config("4x16", 28672, 4096)
    assert (cfg["BLOCK_N"], cfg["num_warps"], cfg["BLOCK_K"]) == (4, 16, 4096)


def test_render_writes_the_table_and_plot_from_records(tmp_path):
    """The plot where matplotlib is installed (the bench extra), the table everywhere."""
    base = dict(command="c", device="d", git_commit="g", model="llama8b", N=8, K=4, block_n=2, warps=4, tb_s=4.0,
                x_store=1.0, max_abs_diff=0.0, ref_max=1.0)
    records = [base | dict(config=c, mode=m, us=u) for c, m, u in
               [("shipped", "plain", 1.0), ("shipped", "norm", 1.2), ("2x4", "plain", 1.1), ("2x4", "norm", 1.0)]]
    out = tmp_path / "r.json"
    out.write_text(json.dumps(records))
    gp.main(["--render", "--out", str(out)])
    table = (tmp_path / "r.md").read_text()
    assert table.count("| shipped |") == 2 and "| 2x4 |" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "r.png").exists()
    else:
        assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a CUDA device")
def test_without_cuda_it_says_it_needs_a_cuda_device(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gp.main(["--out", str(tmp_path / "g.json")])
