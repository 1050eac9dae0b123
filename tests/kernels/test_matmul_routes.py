"""Which kernel takes each matmul of a decode layer, by model shape and step rows, with the engine's default
switches: the routes bench/results/head_rows/ and bench/results/rows_by_model/ measured as the fastest on an H200.
Only the choice is exercised (meta tensors: no kernel runs)."""
import pytest
import torch

from engine.attention import TritonAttention
from engine.config import EngineConfig
from engine.kernels.matmul import decode_gemm as gm, decode_gemv as dg, gemv_checks
from engine.models.loader import DUMMY_SHAPES

GEMV, GEMM, CUBLAS = "gemv", "gemm", "cublas"


def _backend() -> TritonAttention:
    """The backend as the model runner builds it from EngineConfig's defaults."""
    backend = TritonAttention(**EngineConfig().backend_switches())
    backend._gemv, backend._gemm = dg, gm           # the modules these tests import (interpreter or CUDA builds)
    return backend


def _routes(backend, shape: str, rows: int) -> dict[str, str]:
    """Each matmul's kernel: qkv and gate_up with the norm prologue, o and down without one (down reads the
    activation that gate_up's SiLU epilogue stored)."""
    c = DUMMY_SHAPES[shape]
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"]
    qkv = heads + 2 * c["num_key_value_heads"] * c["head_dim"]
    matmuls = {"qkv": (qkv, hidden, False), "o": (hidden, heads, True), "gate_up": (2 * inter, hidden, False),
               "down": (hidden, inter, True)}
    names = {dg: GEMV, gm: GEMM, None: CUBLAS}
    out = {}
    for name, (n, k, plain) in matmuls.items():
        x, w = torch.empty(rows, k, device="meta"), torch.empty(n, k, device="meta")
        kw = {} if plain else dict(norm_weight=torch.empty(k, device="meta"), residual=torch.empty_like(x))
        out[name] = names[backend._gemv_for(x, w, None, plain=plain, **kw)]
    return out


def _all(kernel: str, down: str | None = None) -> dict[str, str]:
    return {"qkv": kernel, "o": kernel, "gate_up": kernel, "down": down or kernel}


@pytest.mark.parametrize("shape,rows,want", [
    ("smollm2-135m", 1, _all(GEMV)), ("smollm2-135m", 2, _all(GEMV)),
    ("smollm2-135m", 3, _all(GEMM)), ("smollm2-135m", 4, _all(GEMM)), ("smollm2-135m", 32, _all(GEMM)),
    ("llama-1b", 1, _all(GEMV)), ("llama-1b", 2, _all(GEMV, CUBLAS)), ("llama-1b", 4, _all(GEMV, CUBLAS)),
    ("llama-1b", 8, _all(GEMM, CUBLAS)),
    ("llama-8b", 1, _all(GEMV)), ("llama-8b", 2, _all(CUBLAS)), ("llama-8b", 4, _all(CUBLAS)),
    ("llama-8b", 8, _all(CUBLAS)),
])
def test_default_routes_by_model_shape(shape, rows, want, monkeypatch):
    """SmolLM2: the GEMV to 2 rows, decode_gemm from 3 (every weight under SPLIT_MAX_WEIGHT). Llama 1B: the GEMV to
    4 rows (weights past it), but its down projection (K = 8192, rows looped) on cuBLAS from 2; decode_gemm from 5
    rows up to its K = 2048. Llama 8B (K = 4096 and 14336): the GEMV at 1 row only, else cuBLAS."""
    monkeypatch.setattr(gemv_checks, "kernels_interpreted", lambda: True)     # meta tensors pass on a GPU too
    assert _routes(_backend(), shape, rows) == want
